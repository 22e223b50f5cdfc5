"""Prometheus metrics for GET /metrics, in a registry of our own.

A dedicated CollectorRegistry (not prometheus_client's global one) keeps two
apps in one process (tests) from sharing series. What /health shows is read
at scrape time from the same snapshot, so the two never disagree; only what
the snapshot lacks (per-request timings, token counts by status) is
recorded here as requests finish.
"""
import gc
import itertools

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from tornchat.engine import processors
from tornchat.engine.types import GenerationRequest, Usage
from tornchat.engine.worker import QUEUE_WAIT_BUCKETS
from tornchat.server import stats

# Seconds. Time to first token spans prefill of long prompts on a CPU; the
# gap between tokens is a few milliseconds on a GPU, tens on a CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)



class Metrics:
    def __init__(self, engine, server_stats: stats.ServerStats):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tornchat_http_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "tornchat_time_to_first_token_seconds", "From request arrival to its first generated text", buckets=TTFT_BUCKETS, registry=self.registry
        )
        self.inter_token = Histogram(
            "tornchat_inter_token_seconds",
            "Between successive pieces of generated text of one request (one token each, but for held-back text)",
            buckets=INTER_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter("tornchat_prompt_tokens", "Prompt tokens of answered requests", registry=self.registry)
        self.completion_tokens = Counter("tornchat_completion_tokens", "Generated tokens of answered requests", registry=self.registry)
        self.options = Counter(
            "tornchat_request_options",
            "Generation requests that set a decoding option (a logits processor's, or logprobs)",
            ["option"],
            registry=self.registry,
        )
        self.registry.register(SnapshotCollector(engine, server_stats))
        GCCollector(registry=self.registry)  # python_gc_collections_total and the objects collected, by generation

    def observe_options(self, request: GenerationRequest) -> None:
        """Labels: each logits processor's name, counted where the request sets any of its fields away from neutral."""
        for processor in processors.PROCESSORS:
            if processor.values(request.sampling.options) is not None:
                self.options.labels(processor.name).inc()
        if request.logprobs is not None:
            self.options.labels("logprobs").inc()

    def observe_response(self, endpoint: str, status: int, usage: Usage | None, ttft: float | None) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.completion_tokens.inc(usage.completion_tokens)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition the scraper asked for (Prometheus text, or OpenMetrics), and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class SnapshotCollector:
    """stats.snapshot() as metrics: queue depth, KV slots and reuse, engine and server counters."""

    def __init__(self, engine, server_stats: stats.ServerStats):
        self.engine = engine
        self.server_stats = server_stats

    def describe(self):
        return []  # names depend on the counters present; collected fresh each scrape

    def collect(self):
        snap = stats.snapshot(self.engine, self.server_stats)
        yield GaugeMetricFamily("tornchat_model_loaded", "1 once the model is loaded", value=int(snap["model_loaded"]))
        yield GaugeMetricFamily("tornchat_queue_depth", "Requests waiting behind the running ones", value=snap["queue_depth"])
        yield GaugeMetricFamily("tornchat_running", "Generations decoding together (at most --parallel)", value=snap["running"])
        yield GaugeMetricFamily("tornchat_kv_slots", "KV-cache slots held (after the last generation)", value=snap["kv"]["slots"])
        yield GaugeMetricFamily("tornchat_kv_bytes", "Memory of the KV-cache slots held", value=snap["kv"]["bytes"])
        waits = list(self.engine.stats.queue_waits)  # one reading of the worker's counts
        cumulative = itertools.accumulate(waits[:-1])
        yield HistogramMetricFamily(
            "tornchat_queue_wait_seconds", "From a request's arrival in the engine's queue to its generation's start",
            buckets=[*zip(map(str, QUEUE_WAIT_BUCKETS), cumulative), ("+Inf", sum(waits))],
            sum_value=self.engine.stats.queue_wait_sum,
        )
        yield GaugeMetricFamily("tornchat_gc_frozen_objects", "Objects built at start-up that collections no longer walk",
                                value=gc.get_freeze_count())
        engine = snap["engine"]
        prompt_tokens = engine["reused_tokens"] + engine["prefill_tokens"]
        yield GaugeMetricFamily(
            "tornchat_kv_reuse_ratio",
            "Prompt tokens taken from a KV slot / all prompt tokens the engine has seen",
            value=engine["reused_tokens"] / prompt_tokens if prompt_tokens else 0.0,
        )
        for name, value in engine.items():
            yield CounterMetricFamily(f"tornchat_engine_{name}", f"Engine counter {name} (see /health)", value=value)
        for name, value in snap["server"].items():
            if name.startswith("http_"):
                continue  # tornchat_http_requests has them by endpoint and status
            yield CounterMetricFamily(f"tornchat_server_{name}", f"HTTP-layer counter {name} (see /health)", value=value)
