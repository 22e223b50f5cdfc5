"""Counters of the HTTP layer, and the one snapshot /health (and any metrics endpoint) reads."""
from dataclasses import dataclass, field


@dataclass
class ServerStats:
    """Written on the IOLoop thread only."""

    counters: dict = field(
        default_factory=lambda: {
            "http_requests": 0,
            "http_client_errors": 0,  # 4xx
            "http_server_errors": 0,  # 5xx
            "streams": 0,
            "client_disconnects": 0,  # generations withdrawn because the client left
        }
    )

    def count_response(self, status: int) -> None:
        self.counters["http_requests"] += 1
        if 400 <= status < 500:
            self.counters["http_client_errors"] += 1
        elif status >= 500:
            self.counters["http_server_errors"] += 1


def snapshot(engine, server: ServerStats) -> dict:
    return {
        "status": "ok",
        "model_loaded": engine is not None,
        "queue_depth": engine.queue_depth(),
        "running": engine.running(),
        "engine": dict(engine.stats.counters),
        "server": dict(server.counters),
        "kv": {"slots": engine.stats.kv_slots, "bytes": engine.stats.kv_bytes},
        "queue_wait_s": {"count": sum(engine.stats.queue_waits), "sum": engine.stats.queue_wait_sum},
    }
