"""Concurrent streams: tornchat --parallel N against llama-server -np N, same file, same threads.

For 1, 2 and 4 streams at once (each a different short chat prompt, greedy,
--tokens new tokens, streamed over raw HTTP on loopback): the aggregate
decode rate (all the streams' generated tokens over the wall time from the
first request to the last reply's end), the worst time to first token, and
whether each concurrent reply's text equals the same request sent alone.
Each server runs with as many slots as the largest count (--parallel /
-np), so a count below it is measured on the same server.

    python -m bench.parallel [--checkpoint-path FILE.gguf] [--tokens 128] [--threads 2]

Prints a markdown table; the CPU it ran on comes first.
"""
import argparse
import http.client
import json
import sys
import threading
import time

from bench import agents_apis, e2e, servers
from bench.common import free_port
from tornchat import checkpoint

PROMPTS = [
    "Write a long story about a dragon who learns to bake bread.",
    "Write a long story about a robot who learns to paint.",
    "Describe a walk through a busy market in a foreign city.",
    "Write a detailed guide to planting a vegetable garden.",
]
COUNTS = (1, 2, 4)


def stream(port: int, model: str, text: str, tokens: int) -> dict:
    """One streamed greedy chat completion: its text, token count, and times of its first and last piece."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    pieces, first, usage = [], None, None
    for _, data in agents_apis.records(response):
        if data is None:  # [DONE]
            continue
        usage = data.get("usage") or usage
        for choice in data.get("choices") or ():
            if piece := (choice.get("delta") or {}).get("content"):
                first = first or time.perf_counter()
                pieces.append(piece)
    connection.close()
    ended = time.perf_counter()
    return {"text": "".join(pieces), "tokens": usage["completion_tokens"] if usage else len(pieces),
            "started": started, "ttft": (first or ended) - started, "ended": ended}


def concurrent(port: int, model: str, count: int, tokens: int) -> list[dict]:
    results: list[dict | None] = [None] * count

    def one(i: int) -> None:
        results[i] = stream(port, model, PROMPTS[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def measure(system: e2e.System, port: int, threads: int, tokens: int) -> dict:
    server = e2e.launch(system, port, threads)
    try:
        servers.wait_ready(server, e2e.STARTUP_TIMEOUT_S)
        solo = [stream(port, system.model, text, tokens) for text in PROMPTS]  # also warms the server up
        rows = {}
        for count in COUNTS:
            replies = concurrent(port, system.model, count, tokens)
            wall = max(r["ended"] for r in replies) - min(r["started"] for r in replies)
            rows[count] = {
                "tokens_per_s": sum(r["tokens"] for r in replies) / wall,
                "worst_ttft_s": max(r["ttft"] for r in replies),
                "equal_to_solo": sum(r["text"] == s["text"] for r, s in zip(replies, solo)),
            }
        return rows
    finally:
        servers.stop(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    e2e.add_baseline_arguments(parser)
    args = parser.parse_args()
    model = args.checkpoint_path or checkpoint.default_gguf_path()
    slots = max(COUNTS)
    port = free_port()
    tornchat = e2e.tornchat_systems(args.threads, port, model)[0]
    tornchat.command += ["--parallel", str(slots)]
    # -np splits -c between the slots: give each the 4096 a single slot had.
    llama = e2e.llamacpp_system(args.threads, port, model, e2e.find_llama_server(args.llama_server), 4096 * slots)
    llama.command += ["-np", str(slots)]
    print(e2e.machine(args.threads, e2e.find_llama_server(args.llama_server)))
    results = {}
    for system in (tornchat, llama):
        if system.skip:
            print(f"{system.name}: skipped ({system.skip})")
            continue
        results[system.name] = measure(system, port, args.threads, args.tokens)
    print(f"\n{model.name}, {args.tokens} new tokens a stream, greedy, {args.threads} threads, {slots} slots\n")
    print("| system | streams | tokens/s (all) | vs 1 stream | worst TTFT | equal to alone |")
    print("|---|---|---|---|---|---|")
    for name, rows in results.items():
        for count, row in rows.items():
            print(f"| {name} | {count} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x "
                  f"| {row['worst_ttft_s']:.2f} s | {row['equal_to_solo']} of {count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
