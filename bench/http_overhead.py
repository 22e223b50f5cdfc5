"""What the HTTP layer costs: one greedy reply streamed through the server vs the engine alone.

The same request (greedy, up to 200 new tokens, the prompt already in a KV
slot on both sides) runs alternately through an in-process Engine.generate
and through the real server process (``python -m tornchat serve``) read as
raw SSE over loopback. For each: time to first token, total time, tokens/s,
and the p50 / p99 gap between tokens as the caller sees them. The two sides
never run at the same time; ratios, not absolute figures, are the result on
a shared machine.

    python -m bench.http_overhead [--tokens 200] [--rounds 3]
"""
import argparse
import json
import statistics
import time

import torch

from bench import servers
from bench.common import percentile
from tornchat import functions, prompt
from tornchat.build import build_engine
from tornchat.config import Config
from tornchat.engine.cpu import describe
from tornchat.engine.types import GenerationRequest, SamplingParams

MESSAGES = [{"role": "user", "content": "Write a long, detailed story about a dragon who learns to bake bread."}]


def summarize(start: float, arrivals: list[float], tokens: int) -> dict:
    """arrivals: when each piece of text reached the caller."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    total = arrivals[-1] - start
    return {
        "ttft_ms": (arrivals[0] - start) * 1000,
        "total_s": total,
        "tokens": tokens,
        "tokens_per_s": tokens / total,
        "gap_p50_ms": percentile(gaps, 0.5) * 1000,
        "gap_p99_ms": percentile(gaps, 0.99) * 1000,
    }


def run_engine(engine, tokens: int) -> dict:
    ids = prompt.encode(engine.tokenizer, functions.plan(engine.tokenizer, MESSAGES, []).prompt)
    request = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=tokens)
    start, arrivals, generated = time.perf_counter(), [], 0
    for event in engine.generate(request):
        if event.text:
            arrivals.append(time.perf_counter())
        if event.usage:
            generated = event.usage.completion_tokens
    return summarize(start, arrivals, generated)


def run_server(server, tokens: int) -> dict:
    body = {"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = servers.connect(server.url)
    start, arrivals, generated = time.perf_counter(), [], 0
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    for data in servers.sse_data(conn.getresponse()):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            arrivals.append(time.perf_counter())
        if chunk.get("usage"):
            generated = chunk["usage"]["completion_tokens"]
    conn.close()
    return summarize(start, arrivals, generated)


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint-path", help="default: the embedded model")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--quantize", default="auto")
    args = parser.parse_args()
    print(f"CPU: {describe()}; GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}", flush=True)

    engine = build_engine(Config(checkpoint_path=args.checkpoint_path, device=args.device, quantize=args.quantize))
    flags = ["--device", args.device, "--quantize", args.quantize]
    if args.checkpoint_path:
        flags += ["--checkpoint-path", args.checkpoint_path]
    results = {"engine": [], "server": []}
    with servers.running(*flags) as server:
        run_engine(engine, 4), run_server(server, 4)  # fill each side's KV slot with the prompt
        for _ in range(args.rounds):
            results["engine"].append(run_engine(engine, args.tokens))
            results["server"].append(run_server(server, args.tokens))
    engine.close()

    rows = {side: median_of(runs) for side, runs in results.items()}
    print(f"median of {args.rounds} alternating rounds, greedy, up to {args.tokens} new tokens, prompt cached")
    print(f"{'':8} {'tokens':>6} {'TTFT ms':>8} {'total s':>8} {'tok/s':>7} {'gap p50 ms':>10} {'gap p99 ms':>10}")
    for side, row in rows.items():
        print(
            f"{side:8} {row['tokens']:6.0f} {row['ttft_ms']:8.1f} {row['total_s']:8.2f} {row['tokens_per_s']:7.2f}"
            f" {row['gap_p50_ms']:10.1f} {row['gap_p99_ms']:10.1f}"
        )
    engine_row, server_row = rows["engine"], rows["server"]
    print(
        f"server/engine: total x{server_row['total_s'] / engine_row['total_s']:.3f}, "
        f"TTFT {server_row['ttft_ms'] - engine_row['ttft_ms']:+.1f} ms, "
        f"gap p50 {server_row['gap_p50_ms'] - engine_row['gap_p50_ms']:+.2f} ms, "
        f"gap p99 {server_row['gap_p99_ms'] - engine_row['gap_p99_ms']:+.2f} ms"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
