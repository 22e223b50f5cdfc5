"""Soak: many short requests from several client threads against the real server on loopback.

A mix of streamed, non-streamed and abandoned (the client leaves mid-stream)
requests over a few dozen conversations; half the time a client goes on with
its last conversation, resending it with the real reply and a new question,
so that KV slots are extended in place, forked and evicted. The queue is kept small so that some
requests are refused with 503. Nothing may fail otherwise, every request the
server accepted must end as exactly one completed or cancelled generation,
and the resident memory of the server process must stop growing once warm.

    python -m bench.soak                             # 3000 requests, 4 clients, the embedded model
    python -m bench.soak --requests 10000 --clients 8 --checkpoint-path DIR

tests/test_reliability_soak.py runs the same soak() for a few hundred requests.
"""
import argparse
import itertools
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import psutil

from bench import servers

TOPICS = ["rivers", "bread", "stars", "chess", "tea", "bridges", "owls", "glass", "maps", "bees", "clocks", "salt"]
KINDS = ("stream", "plain", "abandon")
WEIGHTS = (0.4, 0.4, 0.2)


@dataclass
class Report:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # stream, plain, abandon, busy (503)
    failures: Counter = field(default_factory=Counter)  # anything else, by kind
    examples: list[str] = field(default_factory=list)  # the first few failures, for the log
    rss: list[tuple[int, int]] = field(default_factory=list)  # (requests finished, bytes)
    engine_before: dict = field(default_factory=dict)
    engine_after: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def accepted(self) -> int:
        """Requests the engine took on: every reply, and every stream abandoned after it started."""
        return self.outcomes["stream"] + self.outcomes["plain"] + self.outcomes["abandon"]

    def settled(self, engine: dict) -> int:
        return sum(engine[k] - self.engine_before[k] for k in ("completed", "cancelled", "failed"))

    def rss_mib(self, fraction: float) -> float:
        """RSS at about this fraction of the run (0: start, 1: end)."""
        index = min(int(fraction * (len(self.rss) - 1)), len(self.rss) - 1)
        return self.rss[index][1] / 2**20

    def summary(self) -> dict:
        engine = {k: self.engine_after[k] - self.engine_before[k] for k in self.engine_before}
        return {
            "requests_sent": self.sent,
            "seconds": round(self.seconds, 1),
            "outcomes": dict(self.outcomes),
            "failures": dict(self.failures),
            "failure_examples": self.examples,
            "engine": engine,
            "unaccounted": self.accepted - self.settled(self.engine_after),
            "rss_mib": {
                "start": round(self.rss_mib(0), 1),
                "warm": round(self.rss_mib(1 / 3), 1),
                "end": round(self.rss_mib(1), 1),
                "peak": round(max(b for _, b in self.rss) / 2**20, 1),
            },
        }


FOLLOW_UPS = ["Another one.", "Shorter, please.", "Why?", "Say it differently."]
MAX_TURNS = 6


def conversation(rng: random.Random, history: list[dict] | None) -> list[dict]:
    """Go on with history (the last conversation and its reply) half the time; else a new one."""
    if history and rng.random() < 0.5:
        return history + [{"role": "user", "content": rng.choice(FOLLOW_UPS)}]
    return [{"role": "user", "content": f"Tell me one fact about {rng.choice(TOPICS)}."}]


def one_request(url: str, messages: list[dict], rng: random.Random, max_tokens: tuple[int, int], timeout: float) -> tuple[str, str | None]:
    """Send one request: the outcome's name and the reply's text, if complete.

    Raises AssertionError for a reply that breaks the contract.
    """
    kind = rng.choices(KINDS, WEIGHTS)[0]
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": rng.randint(*max_tokens),
        "temperature": rng.choice([0, 0, 0, 0.8]),  # mostly greedy: its sampler step is the cheap one
        "stream": kind != "plain",
    }
    conn = servers.connect(url, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status == 503:
            assert response.headers["Retry-After"] and json.loads(response.read())["detail"].startswith("Server busy")
            return "busy", None
        assert response.status == 200, f"HTTP {response.status}: {response.read()[:200]!r}"
        if kind == "plain":
            reply = json.loads(response.read())
            assert reply["choices"][0]["finish_reason"] in ("stop", "length"), reply
            assert reply["usage"]["completion_tokens"] <= body["max_tokens"], reply
            return "plain", reply["choices"][0]["message"]["content"]
        records = servers.sse_data(response)
        assert json.loads(next(records))["choices"][0]["delta"] == {"role": "assistant"}
        if kind == "abandon":
            for _ in range(rng.randrange(3)):  # leave at a random point
                if next(records) == "[DONE]":
                    break
            return "abandon", None
        data = list(records)
        assert data[-1] == "[DONE]", f"stream without [DONE]: {data[-3:]}"
        chunks = [json.loads(d) for d in data[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]
        return "stream", "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    finally:
        conn.close()


def soak(
    server: servers.Server,
    requests: int,
    clients: int,
    max_tokens: tuple[int, int] = (4, 8),
    seed: int = 0,
    timeout: float = 120.0,
    progress=None,
) -> Report:
    report = Report(engine_before=server.health()["engine"])
    process = psutil.Process(server.process.pid)
    numbers = itertools.count()
    lock = threading.Lock()
    finished = 0
    report.rss.append((0, process.memory_info().rss))

    def client() -> None:
        nonlocal finished
        history = None
        while (i := next(numbers)) < requests:
            rng = random.Random(seed * 1_000_003 + i)
            messages = conversation(rng, history)
            text = None
            try:
                (outcome, text), failure = one_request(server.url, messages, rng, max_tokens, timeout), None
            except Exception as exc:  # every failure is counted by kind, never raised past the soak
                kind = "bad_reply" if isinstance(exc, AssertionError) else type(exc).__name__
                outcome, failure = None, (kind, f"{kind}: {exc}")
            if text is not None and len(messages) < 2 * MAX_TURNS:
                history = messages + [{"role": "assistant", "content": text}]
            elif outcome != "busy":
                history = None
            with lock:
                report.sent += 1
                finished += 1
                if failure:
                    report.failures[failure[0]] += 1
                    if len(report.examples) < 5:
                        report.examples.append(failure[1])
                else:
                    report.outcomes[outcome] += 1
            if outcome == "busy":
                time.sleep(rng.uniform(0.3, 1.0))  # about the Retry-After of 1 s

    def sample_memory(done: threading.Event) -> None:
        while not done.wait(0.25):
            report.rss.append((finished, process.memory_info().rss))
            if progress:
                progress(finished, report)

    started = time.perf_counter()
    done = threading.Event()
    sampler = threading.Thread(target=sample_memory, args=(done,), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    report.seconds = time.perf_counter() - started
    report.engine_after = settle(server, report, timeout)
    report.rss.append((finished, process.memory_info().rss))
    return report


def settle(server: servers.Server, report: Report, timeout: float) -> dict:
    """Engine counters once every accepted request has ended (the last cancels land a step late)."""
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        if health["queue_depth"] == 0 and report.settled(health["engine"]) >= report.accepted:
            return health["engine"]
        if time.monotonic() > deadline:
            return health["engine"]
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=1, help="small, so that some requests meet a full queue")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(4, 8), metavar=("LOW", "HIGH"))
    parser.add_argument("--checkpoint-path", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    flags = ["--max-queue", str(args.max_queue)]
    if args.checkpoint_path:
        flags += ["--checkpoint-path", args.checkpoint_path]

    printed = [time.monotonic()]

    def progress(done: int, report: Report) -> None:
        if time.monotonic() - printed[0] >= 15:
            printed[0] = time.monotonic()
            rss = report.rss[-1][1] / 2**20
            print(f"  {done} requests, {sum(report.failures.values())} failures, RSS {rss:.0f} MiB", file=sys.stderr)

    with servers.running(*flags) as server:
        report = soak(server, args.requests, args.clients, tuple(args.max_tokens), args.seed, progress=progress)
        health = server.health()
    summary = report.summary()
    summary["kv"] = health["kv"]
    print(json.dumps(summary, indent=2))
    sys.exit(1 if report.failures or summary["unaccounted"] else 0)


if __name__ == "__main__":
    main()
