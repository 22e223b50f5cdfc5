"""Operations and security against the real server process: /metrics, JSON logs, credentials, CORS.

One server with both kinds of credentials, JSON logs and the debug log
level, so that anything that would log a header or a secret does.
"""
import base64
import json
import statistics
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import servers

KEY = "sk-ops-7f3a9c"
USER, PASSWORD = "ops", "pa55-word-4b1e"
RIGHT = {"Authorization": "Bearer " + KEY}
BASIC = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
WRONG = [
    {"Authorization": "Bearer sk-ops-7f3a9d"},  # same length, last character differs
    {"Authorization": "Bearer short-9d2"},  # another length
    {"Authorization": "Basic " + base64.b64encode(f"{USER}:wrong-{PASSWORD}".encode()).decode()},
]
ASK = {"model": "m", "messages": [{"role": "user", "content": "Tell me about owls."}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    flags = ("--checkpoint-path", tiny_checkpoint, "--api-key", KEY, "--api-auth", f"{USER}:{PASSWORD}", "--log-format", "json", "--log-level", "debug")
    with servers.running(*flags) as running:
        yield running


def call(server, method, path, body=None, headers=None) -> servers.Reply:
    return servers.request(server.url, method, path, body, headers)


def metrics(server) -> dict:
    """(name, labels) -> value of every sample."""
    reply = call(server, "GET", "/metrics", headers=RIGHT)
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.body.decode())
        for s in family.samples
    }


def test_metrics_need_credentials_health_and_openapi_do_not(server):
    assert call(server, "GET", "/metrics").status == 401
    assert call(server, "GET", "/metrics", headers=WRONG[0]).status == 401
    assert call(server, "GET", "/metrics", headers=BASIC).status == 200
    assert call(server, "GET", "/health").status == 200
    document = call(server, "GET", "/openapi.json").json()
    assert document["security"] == [{"bearerAuth": []}, {"basicAuth": []}]


def test_metrics_count_requests_tokens_latency_and_kv_reuse(server):
    for _ in range(2):  # the second time, the prompt comes from a KV slot
        assert call(server, "POST", "/v1/chat/completions", ASK, RIGHT).status == 200
    conn = servers.connect(server.url)
    conn.request("POST", "/v1/chat/completions", json.dumps({**ASK, "stream": True}), RIGHT)
    assert list(servers.sse_data(conn.getresponse()))[-1] == "[DONE]"
    conn.close()
    assert call(server, "POST", "/v1/chat/completions", {"model": "m"}, RIGHT).status == 400
    assert call(server, "GET", "/v1/no/such/path/42", headers=RIGHT).status == 404

    m = metrics(server)
    chat = "/v1/chat/completions"
    assert m[("tornchat_http_requests_total", (("endpoint", chat), ("status", "200")))] == 3
    assert m[("tornchat_http_requests_total", (("endpoint", chat), ("status", "400")))] == 1
    assert m[("tornchat_http_requests_total", (("endpoint", "other"), ("status", "404")))] == 1
    assert m[("tornchat_time_to_first_token_seconds_count", ())] == 3
    assert m[("tornchat_inter_token_seconds_count", ())] >= 3
    assert m[("tornchat_completion_tokens_total", ())] == 12
    health = server.health()
    assert m[("tornchat_prompt_tokens_total", ())] == health["engine"]["prefill_tokens"] + health["engine"]["reused_tokens"]
    assert m[("tornchat_engine_requests_total", ())] == health["engine"]["requests"] == 3
    assert m[("tornchat_queue_depth", ())] == 0 and m[("tornchat_model_loaded", ())] == 1 and m[("tornchat_running", ())] == 0
    reused, prefilled = health["engine"]["reused_tokens"], health["engine"]["prefill_tokens"]
    assert reused > 0 and m[("tornchat_kv_reuse_ratio", ())] == pytest.approx(reused / (reused + prefilled))
    assert m[("tornchat_kv_slots", ())] == health["kv"]["slots"] >= 1
    assert m[("tornchat_queue_wait_seconds_count", ())] == health["queue_wait_s"]["count"] == 3  # the 400 never queued
    assert m[("tornchat_queue_wait_seconds_bucket", (("le", "+Inf"),))] == 3
    assert m[("tornchat_queue_wait_seconds_sum", ())] == pytest.approx(health["queue_wait_s"]["sum"])
    # Start-up's objects were frozen before the server listened: full collections no longer walk them.
    assert m[("tornchat_gc_frozen_objects", ())] > 50_000
    assert ("python_gc_collections_total", (("generation", "2"),)) in m

    openmetrics = call(server, "GET", "/metrics", headers={**RIGHT, "Accept": "application/openmetrics-text"})
    assert openmetrics.headers["Content-Type"].startswith("application/openmetrics-text")
    assert openmetrics.body.rstrip().endswith(b"# EOF")


def test_wrong_credentials_are_answered_as_fast_as_right_ones(server):
    # Interleaved, so both see the same machine; a penalty or an early exit would show as a ratio.
    right, wrong = [], []
    for i in range(300):
        headers = RIGHT if i % 2 else WRONG[i % 3]
        started = time.perf_counter()
        status = call(server, "GET", "/v1/models", headers=headers).status
        (right if headers is RIGHT else wrong).append(time.perf_counter() - started)
        assert status == (200 if headers is RIGHT else 401)
    ratio = statistics.median(wrong) / statistics.median(right)
    assert 0.5 < ratio < 2.0, (statistics.median(wrong), statistics.median(right))


def test_credentials_never_logged(server):
    call(server, "GET", "/v1/models", headers=RIGHT)
    call(server, "GET", "/v1/models", headers=BASIC)
    for headers in WRONG:
        call(server, "POST", "/v1/chat/completions", b"{not json", headers)
    call(server, "POST", "/v1/chat/completions", b"{not json", RIGHT)
    log = server.log()
    secrets = [KEY, PASSWORD, BASIC["Authorization"].split()[1], *(h["Authorization"].split()[1] for h in WRONG)]
    assert not [s for s in secrets if s in log]
    assert "Authorization" not in log and "authorization" not in log


def test_every_log_line_is_one_json_object(server):
    assert call(server, "POST", "/v1/chat/completions", ASK, RIGHT).status == 200
    assert call(server, "GET", "/v1/models", headers=WRONG[0]).status == 401
    assert call(server, "GET", "/health").status == 200  # the lines above are in the log once this is answered
    lines = server.log().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert len(records) >= 5
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    access = [r for r in records if r["logger"] == "tornchat.access"]
    assert all({"method", "path", "status", "prompt_tokens", "ttft_ms", "total_ms"} <= set(r) for r in access)
    assert any(r["path"] == "/v1/chat/completions" and r["status"] == 200 and r["completion_tokens"] for r in access)
    assert any(r["status"] == 401 for r in access)


def test_cors_is_off_unless_configured(server):
    preflight = call(server, "OPTIONS", "/v1/chat/completions", headers={"Origin": "https://x.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status == 405
    for reply in (preflight, call(server, "GET", "/health", headers={"Origin": "https://x.example"}), call(server, "GET", "/v1/models")):
        assert not [h for h in reply.headers if h.lower().startswith("access-control-")]
