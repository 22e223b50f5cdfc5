"""Decode and prefill speed of each decode format, side by side in one process, against llama.cpp.

Rows: transformers' modules; the lean forward on the model's own weights;
each --quantize format (int4 and int8 fed bf16 inputs; the fp32-input paths
are 10-30x slower on every CPU measured so far, and autotune's log shows
them); the format `--quantize auto` picks on this machine (timed afresh);
that format with the PyTorch reference ops instead of the C++ fused ones
(the fused-ops lever), and with the C++ ops called from the Python layer
loop instead of the C++ decode step; and llama.cpp on the same GGUF when llama-cpp-python
is installed. For each: greedy decode tokens/s after a short chat prompt and
after a ~2,000-token one, and prefill tokens/s of that prompt (in the
engine's 512-token chunks). Runners take turns round by round, so load from
other processes hits all of them alike; the table gives the median and the
best round. Then where a decode step of the auto format goes (matmuls,
attention, and the rest: eager-op overhead), with each set of ops. Then the
quality of each format: per-position greedy agreement with fp32 (both fed
fp32's choice) over fixed prompts, and perplexity on a fixed text, both
through the decode weights.

    python bench/decode_speed.py [--threads 2] [--steps 64] [--rounds 3]
"""
import argparse
import importlib.util
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tornchat import checkpoint
from tornchat.engine import autotune, build, fused, llama
from tornchat.engine.cpu import describe
from tornchat.engine.model import PREFILL_CHUNK, HFRunner

MATMULS = ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")
ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "List three uses of a paperclip.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def decode_rate(runner, prompt: list[int], steps: int) -> float:
    cache = runner.new_cache()
    logits = runner.forward(prompt, cache)
    started = time.perf_counter()
    for _ in range(steps):
        logits = runner.forward([int(logits.argmax())], cache, decode=True)
    return steps / (time.perf_counter() - started)


def prefill_rate(runner, tokens: list[int]) -> float:
    cache = runner.new_cache()
    started = time.perf_counter()
    for start in range(0, len(tokens), PREFILL_CHUNK):
        runner.forward(tokens[start : start + PREFILL_CHUNK], cache)
    return len(tokens) / (time.perf_counter() - started)


class LlamaCpp:
    """llama.cpp through llama-cpp-python, with the calls decode_rate and prefill_rate make."""

    def __init__(self, threads: int):
        import numpy as np
        from llama_cpp import Llama

        self.np = np
        self.llm = Llama(model_path=str(checkpoint.default_gguf_path()), n_ctx=4096, n_batch=PREFILL_CHUNK,
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    def new_cache(self):
        self.llm.reset()  # one context: a new cache empties it

    def forward(self, token_ids: list[int], cache, decode: bool = False):
        self.llm.eval(token_ids)
        return self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))


def greedy_agreement(reference, candidate, prompts: list[list[int]], steps: int) -> float:
    """Share of positions where candidate's greedy choice equals reference's, both fed reference's choice."""
    agree = total = 0
    for ids in prompts:
        ref_cache, cand_cache = reference.new_cache(), candidate.new_cache()
        expected, got = reference.forward(ids, ref_cache), candidate.forward(ids, cand_cache)
        for _ in range(steps):
            token = int(expected.argmax())
            agree += int(got.argmax()) == token
            total += 1
            expected, got = reference.forward([token], ref_cache), candidate.forward([token], cand_cache, decode=True)
    return agree / total


def decode_perplexity(runner, ids: list[int]) -> float:
    """Perplexity of ids with every token fed as a decode step: the weights decode really reads."""
    cache, nll = runner.new_cache(), 0.0
    for position, token in enumerate(ids[:-1]):
        logits = runner.forward([token], cache, decode=True)
        nll -= float(torch.log_softmax(logits, dim=-1)[ids[position + 1]])
    return math.exp(nll / (len(ids) - 1))


def step_breakdown(runner, prompt: list[int], steps: int) -> dict[str, float]:
    """ms per decode step: wall time, then matmul and attention kernels' time from the profiler; the rest of
    the step (small ops, dispatch, Python) is the per-op overhead the fused ops cut."""
    cache = runner.new_cache()
    logits = runner.forward(prompt, cache)
    started = time.perf_counter()
    for _ in range(steps):
        logits = runner.forward([int(logits.argmax())], cache, decode=True)
    wall = (time.perf_counter() - started) / steps * 1000
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            logits = runner.forward([int(logits.argmax())], cache, decode=True)
    events = profile.key_averages()
    matmul = sum(e.self_cpu_time_total for e in events if e.key.endswith(MATMULS)) / 1000 / steps
    attention = sum(e.self_cpu_time_total for e in events if e.key.endswith(ATTENTION)) / 1000 / steps
    return {"wall": wall, "matmul": matmul, "attention": attention, "other": max(wall - matmul - attention, 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=256, help="tokens of the perplexity text")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"CPU: {describe()}")
    loaded = checkpoint.load(None)
    tokenizer, model = loaded.tokenizer, loaded.model
    with tempfile.TemporaryDirectory() as fresh:  # time the formats afresh, whatever an earlier start cached
        auto, choice = autotune.choose(model, "auto", build.quality_ids(tokenizer), Path(fresh) / "d.json", "bench")
    print(f"auto picks {choice.format.label()}; whole decode steps, ms: {choice.step_ms}; one-layer estimates, "
          f"ms: {choice.estimate_ms}; quality {choice.quality}")
    auto_loop = choice.format.runner(model)
    auto_loop.decode_step = None  # the C++ ops, called from the Python loop
    auto_reference_ops = choice.format.runner(model, ops=fused.REFERENCE)
    runners = {
        "hf fp32": HFRunner(model),
        "lean fp32": llama.LlamaRunner(model),
        "lean bf16": llama.LlamaRunner(model, quantize="bf16"),
        "lean int8 (bf16 inputs)": llama.LlamaRunner(model, quantize="int8"),
        "lean int4, int8 head (bf16 inputs)": llama.LlamaRunner(model, quantize="int4"),
        f"auto: {choice.format.label()}": auto,
        "auto, C++ ops from the Python loop": auto_loop,
        "auto, PyTorch reference ops": auto_reference_ops,
    }
    if importlib.util.find_spec("llama_cpp"):
        runners["llama.cpp (Q4_1 GGUF)"] = LlamaCpp(args.threads)
    else:
        print("llama.cpp: not installed, skipped (pip install --no-build-isolation -e '.[llamacpp]')")
    prompt = chat_ids(tokenizer, PROMPTS[1])
    long_text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box on shelf {i % 17}." for i in range(400))
    long_prompt = tokenizer(long_text)["input_ids"][:2000]

    decode = {name: [] for name in runners}
    decode_long = {name: [] for name in runners}
    prefill = {name: [] for name in runners}
    for name, runner in runners.items():  # warm-up: first-call allocations and lazy inits
        decode_rate(runner, prompt, 2)
    for _ in range(args.rounds):
        for name, runner in runners.items():
            decode[name].append(decode_rate(runner, prompt, args.steps))
            decode_long[name].append(decode_rate(runner, long_prompt, args.steps))
            prefill[name].append(prefill_rate(runner, long_prompt))

    base_decode, base_prefill = statistics.median(decode["hf fp32"]), statistics.median(prefill["hf fp32"])
    llama_cpp = max(decode.get("llama.cpp (Q4_1 GGUF)", [0]))
    print(f"\nCPU: {describe()}; {torch.get_num_threads()} threads; median and best of {args.rounds} rounds")
    print("| forward | decode tok/s, median (best) | vs hf | best vs llama.cpp's best | decode tok/s at 2,000 tokens "
          "| prefill tok/s (2,000 tokens) | vs hf |")
    print("|---|---|---|---|---|---|---|")
    for name in runners:
        d, dl, p = (statistics.median(rates[name]) for rates in (decode, decode_long, prefill))
        versus = f"{max(decode[name]) / llama_cpp:.2f}x" if llama_cpp else "-"
        print(f"| {name} | {d:.1f} ({max(decode[name]):.1f}) | {d / base_decode:.2f}x | {versus} | {dl:.1f} | {p:.0f} "
              f"| {p / base_prefill:.2f}x |")

    print(f"\nWhere a decode step of the auto format goes, ms (short prompt; kernel times from torch.profiler):")
    print("| ops | step | matmuls | attention | rest: per-op overhead | overhead share |")
    print("|---|---|---|---|---|---|")
    for name, runner in (("C++ decode step", auto), ("C++ ops, Python loop", auto_loop),
                         ("PyTorch reference ops", auto_reference_ops)):
        parts = step_breakdown(runner, prompt, args.steps)
        print(f"| {name} | {parts['wall']:.2f} | {parts['matmul']:.2f} | {parts['attention']:.2f} | {parts['other']:.2f} "
              f"| {parts['other'] / parts['wall']:.0%} |")

    prompts = [chat_ids(tokenizer, text) for text in PROMPTS]
    text_ids = tokenizer(open(__file__).read())["input_ids"][: args.ppl_tokens]
    reference = runners["lean fp32"]
    ppl_fp32 = decode_perplexity(reference, text_ids)
    print(f"quality vs lean fp32 (greedy agreement over {len(prompts)} prompts x 32 positions, both fed fp32's "
          f"choice; perplexity of {len(text_ids)} tokens of this file fed as decode steps: fp32 {ppl_fp32:.3f})")
    for name in ("lean bf16", "lean int8 (bf16 inputs)", "lean int4, int8 head (bf16 inputs)"):
        agreement = greedy_agreement(reference, runners[name], prompts, 32)
        ppl = decode_perplexity(runners[name], text_ids)
        print(f"| {name} | agreement {agreement:.1%} | perplexity {ppl:.3f} ({ppl / ppl_fp32 - 1:+.2%}) |")


if __name__ == "__main__":
    main()
