"""Engine numbers, all in one process and one run (2 threads).

1. Decode tokens/s: our loop vs transformers `generate`, greedy, same model.
2. Time to first token for each turn of a chat growing to ~2,000 tokens, then
   of a short follow-up: with KV reuse vs the same engine with its slots
   emptied before each turn.
3. Start-up time of `tornchat serve`: first start (GGUF conversion into an
   empty cache) and second start (from the cache).

    python -m bench.engine [--quick] [--skip-startup]
"""
import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench import servers, workloads
from bench.common import RESULTS, rate_after_first, stamp, write_results
from tornchat import checkpoint, prompt
from tornchat.build import build_engine
from tornchat.config import Config
from tornchat.engine import GenerationRequest, SamplingParams
from tornchat.engine.cpu import describe
from tornchat.engine.slots import SlotPool

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=7)  # what chat front ends send
FOLLOW_UP = "Thanks. Can you sum that up in one sentence?"


def timed_generation(engine, ids, max_tokens, sampling=GREEDY):
    """(seconds to first text, decode tokens/s after it, reply text)."""
    start = time.perf_counter()
    first, text, last = None, [], None
    for event in engine.generate(GenerationRequest(ids, sampling, max_tokens=max_tokens)):
        if first is None and event.text:
            first = time.perf_counter()
        text.append(event.text)
        last = event
    end = time.perf_counter()
    tokens = last.usage.completion_tokens
    return first - start, rate_after_first(tokens, first, end), "".join(text)


def generate_rate(model, ids, max_tokens):
    """transformers generate's decode tokens/s: (N-1 tokens) / (time for N - time for 1)."""
    input_ids = torch.tensor([ids])

    def run(n):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    run(2)  # warm-up
    return (max_tokens - 1) / (run(max_tokens) - run(1))


def short_prompt(tokenizer) -> list[int]:
    return prompt.encode(tokenizer, prompt.render(tokenizer, workloads.short_messages(0)))


def generate_rate_on_own_thread(max_tokens: int) -> float:
    """transformers generate's rate, on a thread that loads its own model and then exits.

    Each thread that runs torch ops gets an OpenMP team, and two teams slow
    each other down (Engine.start); the thread's team leaves with it, so the
    engine measured afterwards runs as it does in the server.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(load_and_time_generate, max_tokens).result()


def load_and_time_generate(max_tokens: int) -> float:
    loaded = checkpoint.load(None)
    return generate_rate(loaded.model, short_prompt(loaded.tokenizer), max_tokens)


def decode_speed(engine, tokenizer, max_tokens, theirs):
    ids = short_prompt(tokenizer)
    timed_generation(engine, ids, 4)  # warm-up
    _, ours, _ = timed_generation(engine, ids, max_tokens)
    _, sampled, _ = timed_generation(engine, ids, max_tokens, SAMPLED)
    print(f"decode: tornchat {ours:.1f} tok/s greedy, {sampled:.1f} tok/s sampled (temperature 0.8, top_p 0.95); "
          f"transformers generate {theirs:.1f} tok/s greedy", flush=True)
    return {"tornchat_tokens_per_s": ours, "tornchat_sampled_tokens_per_s": sampled,
            "generate_tokens_per_s": theirs, "ratio": ours / theirs}


def chat_ttft(engine, tokenizer, workload):
    """TTFT per turn: the engine as configured vs the same engine with an empty slot pool.

    The last turn is a short follow-up, so its new tokens are few and the history is long.
    """
    messages = [{"role": "system", "content": workloads.SYSTEM}]
    rows = []
    # The growing chat, then a short follow-up to the ~2,000-token history: what a user types most.
    users = workloads.chat_user_messages(workload, tokenizer) + [FOLLOW_UP]
    for turn, user in enumerate(users, start=1):
        messages.append({"role": "user", "content": user})
        ids = prompt.encode(tokenizer, prompt.render(tokenizer, messages))
        no_reuse = ttft_without_reuse(engine, ids)
        reuse, _, reply = timed_generation(engine, ids, workload.turn_max_tokens)
        reused = engine.stats.last_reused_tokens
        messages.append({"role": "assistant", "content": reply})
        rows.append({"turn": turn, "prompt_tokens": len(ids), "reused_tokens": reused, "ttft_reuse_s": reuse,
                     "ttft_no_reuse_s": no_reuse, "speedup": no_reuse / reuse})
        print(f"turn {turn}: {len(ids)} prompt tokens, {reused} reused, TTFT {reuse:.3f} s with reuse vs "
              f"{no_reuse:.3f} s without ({no_reuse / reuse:.1f}x)", flush=True)
    return rows


def ttft_without_reuse(engine, ids) -> float:
    """TTFT on the same engine, thread and weights, with an empty pool in place of its slots (the engine is idle)."""
    kept = engine.slots
    engine.slots = SlotPool(engine.runner, 1, kept.max_bytes)
    try:
        return timed_generation(engine, ids, 1)[0]
    finally:
        engine.slots = kept


def startup_seconds(cache_dir: str) -> float:
    with servers.running("--threads", "2", env={"TORNCHAT_CACHE": cache_dir}) as server:
        return server.ready_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter chat and fewer tokens")
    parser.add_argument("--skip-startup", action="store_true", help="do not time server start-up")
    args = parser.parse_args()
    print(f"CPU: {describe()}", flush=True)
    workload = workloads.QUICK if args.quick else workloads.FULL
    torch.set_num_threads(2)  # read by both the generate thread and the engine
    theirs = generate_rate_on_own_thread(workload.short_max_tokens)
    engine = build_engine(Config(threads=2, kv_slots=4))
    tokenizer = engine.tokenizer
    result = {
        "machine": {"cpu": describe(), "cores": os.cpu_count(), "threads": torch.get_num_threads()},
        "decode": decode_speed(engine, tokenizer, workload.short_max_tokens, theirs),
        "chat": chat_ttft(engine, tokenizer, workload),
    }
    engine.close()
    if not args.skip_startup:
        with tempfile.TemporaryDirectory() as cache:
            first = startup_seconds(cache)
            (Path(cache) / "decode-formats.json").unlink()
            measuring = startup_seconds(cache)
            later = startup_seconds(cache)
        result["startup"] = {"first_s": first, "measuring_s": measuring, "later_s": later}
        print(f"start-up: first {first:.1f} s (converts the GGUF's tokenizer, times the decode formats), {measuring:.1f} s "
              f"timing the decode formats only, later starts {later:.1f} s (decision cached)", flush=True)
    out = write_results(RESULTS / f"engine-{stamp()}.json", result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
