"""Load: a short soak of the real server process (``python -m bench.soak`` runs the long one).

Streamed, non-streamed and abandoned requests from four client threads,
against a queue of one so that some meet a full queue; on the tiny model,
whose decode steps cost little, so the HTTP layer and the engine's
bookkeeping are what is under load.
"""
import pytest

from bench import servers, soak

KV_SLOTS, KV_MEMORY_MB = 3, 64


@pytest.fixture(scope="module")
def report(tiny_checkpoint):
    flags = ("--checkpoint-path", tiny_checkpoint, "--max-queue", "1", "--kv-slots", str(KV_SLOTS), "--kv-memory-mb", str(KV_MEMORY_MB))
    with servers.running(*flags) as server:
        result = soak.soak(server, requests=300, clients=4, max_tokens=(4, 8), timeout=60)
        result.health = server.health()
        result.log = server.log()
    print(result.summary())
    return result


def test_every_request_is_answered_or_refused_clearly(report):
    assert report.sent == 300
    assert not report.failures, report.examples
    assert report.outcomes["busy"] > 0, "a queue of one must turn some of four clients away with 503"
    assert min(report.outcomes[k] for k in ("stream", "plain", "abandon")) >= 10, report.outcomes


def test_no_request_is_lost(report):
    # Each accepted request ends as exactly one completed or cancelled generation.
    engine = report.summary()["engine"]
    assert engine["failed"] == 0
    assert engine["completed"] + engine["cancelled"] == report.accepted, engine
    assert engine["completed"] >= report.outcomes["stream"] + report.outcomes["plain"]
    assert report.health["queue_depth"] == 0


def test_memory_stays_bounded(report):
    # Once warm (a third of the way in), RSS does not keep climbing.
    assert report.rss_mib(1) - report.rss_mib(1 / 3) < 48, report.summary()["rss_mib"]
    kv = report.health["kv"]
    assert 0 < kv["slots"] <= KV_SLOTS and kv["bytes"] <= KV_MEMORY_MB * 2**20


def test_server_logged_no_errors(report):
    assert "Traceback" not in report.log and " ERROR " not in report.log
