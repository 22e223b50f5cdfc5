"""Decode and prefill speed of a GGUF's own blocks, side by side in one process, and their quality.

Rows: the file dequantized to fp32 and run by PyTorch (the reference;
--no-reference skips it for large models); the file's blocks through the
C++ forward on each instruction-set path this CPU has (csrc/blocks/:
AVX-512 VNNI, AVX-VNNI, AVX2, generic); the same blocks from the Python
layer loop (the C++ forward's lever); with --formats, each --quantize
format packed from the fp32 values; and llama.cpp on the same file in
process when llama-cpp-python is installed (bench/e2e.py compares whole
servers against llama-server). For each: greedy decode tokens/s after a
short chat prompt and after a ~2,000-token one, with the read bandwidth
that implies (weights and KV cache bytes per token x tokens/s) against the
machine's (a torch sum over 1 GiB), and prefill tokens/s of that prompt
(in the engine's 512-token chunks). Runners take turns round by round, so
load from other processes hits all of them alike; the table gives the
median and the best round. Then where a decode step goes (matmuls,
attention, the rest). Then the quality of each: per-position greedy
agreement with fp32 (both fed fp32's choice) over fixed prompts, and
perplexity on a fixed text, against the dequantized file.

    python -m bench.decode_speed [--checkpoint-path FILE.gguf] [--threads 2] [--steps 64] [--rounds 3] [--isa avx2,...]
"""
import argparse
import importlib.util
import math
import statistics
import time
from pathlib import Path

import torch

from bench.common import greedy_steps_rate
from tornchat import checkpoint, prompt
from tornchat.engine import blocks, llama, quant
from tornchat.engine.cpu import describe
from tornchat.engine.model import PREFILL_CHUNK
from tornchat.weights import gguf_file

MATMULS = ("aten::mm", "aten::addmm", "tornchat::block_mm")
ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math", "tornchat::attend")

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "List three uses of a paperclip.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    return prompt.encode(tokenizer, prompt.render(tokenizer, [{"role": "user", "content": text}]))


def decode_rate(runner, prompt: list[int], steps: int) -> float:
    cache = runner.new_cache()
    return greedy_steps_rate(runner, cache, int(runner.forward(prompt, cache).argmax()), steps)[0]


def prefill_rate(runner, tokens: list[int]) -> float:
    cache = runner.new_cache()
    started = time.perf_counter()
    for start in range(0, len(tokens), PREFILL_CHUNK):
        runner.forward(tokens[start : start + PREFILL_CHUNK], cache)
    return len(tokens) / (time.perf_counter() - started)


class LlamaCpp:
    """llama.cpp through llama-cpp-python, with the calls decode_rate and prefill_rate make."""

    def __init__(self, path: Path, threads: int):
        import numpy as np
        from llama_cpp import Llama

        self.np = np
        self.llm = Llama(model_path=str(path), n_ctx=4096, n_batch=PREFILL_CHUNK,
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
    """Perplexity of ids from one pass (``score``): with the block kernels every row is what a step gives."""
    logits = runner.score(ids)
    nll = -float(torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).sum())
    return math.exp(nll / (len(ids) - 1))


def read_bandwidth() -> float:
    """Bytes per second a torch sum over 1 GiB reads, best of 5."""
    data = torch.ones(1 << 28)
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def bytes_per_token(runner, context: int) -> int:
    """What a decode step reads at this context: every layer matrix (of a mixture of experts, the chosen ones)
    and the head once, and the KV cache."""
    def nbytes(w) -> int:
        if isinstance(w, quant.BlockWeight):
            return sum(p.numel() for p in w.parts)
        return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0
    weights = int(sum(layer.step_bytes(nbytes) for layer in runner.layers)) + nbytes(runner.head)
    kv = len(runner.layers) * 2 * context * runner.kv_heads * runner.head_dim * runner.kv_dtype.itemsize
    return weights + kv


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
    parser.add_argument("--checkpoint-path", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=256, help="tokens of the perplexity text")
    parser.add_argument("--no-reference", action="store_true", help="skip the fp32 reference (4 bytes per weight)")
    parser.add_argument("--formats", action="store_true", help="also each --quantize format packed from fp32")
    parser.add_argument("--isa", help="comma-separated instruction-set paths to run (default: every one this CPU has; "
                                      "the generic path's prefill of a 1B model takes many minutes)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = Path(args.checkpoint_path) if args.checkpoint_path else checkpoint.default_gguf_path()
    print(f"CPU: {describe()}\nmodel: {path.name}")
    loaded = checkpoint.load(str(path), model_impl="lean")
    tokenizer, (config, weights) = loaded.tokenizer, loaded.lean
    print(f"the file's blocks: {llama.weights_label(weights)}; kernel paths here: {', '.join(blocks.isas())}")
    runners = {}
    if not args.no_reference or args.formats:
        runners["fp32 (the file dequantized)"] = llama.LlamaRunner(*gguf_file.load(path, plain=torch.float32))
    isas = args.isa.split(",") if args.isa else blocks.isas()
    for isa in isas:  # each path on the layouts it reads (the panel layout is avx512vnni's alone)
        runners[f"the file's blocks, {isa}"] = llama.LlamaRunner(
            *(gguf_file.load(path, isa=isa) if isa != blocks.isa() else (config, weights)), isa=isa)
    loop = llama.LlamaRunner(config, weights)
    loop.step = None  # the block kernels called from the Python layer loop, SDPA attention
    runners["the file's blocks, Python loop"] = loop
    if args.formats:
        for mode in ("bf16", "int8", "int4"):
            config_, plain = gguf_file.load(path, plain=torch.float32)
            runners[f"{mode} ({quant.BLOCK_TYPES[mode]}) from fp32"] = llama.LlamaRunner(config_, llama.pack(plain, mode))
    if importlib.util.find_spec("llama_cpp"):
        runners[f"llama.cpp in process ({path.name})"] = LlamaCpp(path, args.threads)
    else:
        print("llama.cpp in process: not installed, skipped (pip install --no-build-isolation -e '.[llamacpp]')")
    bandwidth = read_bandwidth()
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

    llama_cpp = max(decode.get(f"llama.cpp in process ({path.name})", [0]))
    llama_cpp_prefill = max(prefill.get(f"llama.cpp in process ({path.name})", [0]))
    print(f"\nCPU: {describe()}; {torch.get_num_threads()} threads; {path.name}; median and best of {args.rounds} rounds; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| forward | decode tok/s, median (best) | read GB/s (share of the machine's) | best vs llama.cpp's best "
          "| decode tok/s at 2,000 tokens | prefill tok/s (2,000 tokens), median (best) | best vs llama.cpp's best |")
    print("|---|---|---|---|---|---|---|")
    for name, runner in runners.items():
        d, dl, p = (statistics.median(rates[name]) for rates in (decode, decode_long, prefill))
        read = f"{bytes_per_token(runner, len(prompt)) * max(decode[name]) / 1e9:.1f} " \
               f"({bytes_per_token(runner, len(prompt)) * max(decode[name]) / bandwidth:.0%})" if hasattr(runner, "layers") else "-"
        versus = f"{max(decode[name]) / llama_cpp:.2f}x" if llama_cpp else "-"
        versus_prefill = f"{max(prefill[name]) / llama_cpp_prefill:.2f}x" if llama_cpp_prefill else "-"
        print(f"| {name} | {d:.1f} ({max(decode[name]):.1f}) | {read} | {versus} | {dl:.1f} "
              f"| {p:.0f} ({max(prefill[name]):.0f}) | {versus_prefill} |")

    print("\nWhere a decode step goes, ms (short prompt; kernel times from torch.profiler; the C++ forward's kernels "
          "run inside one call, so only the Python loop splits):")
    print("| forward | step | matmuls | attention | rest: per-op overhead | overhead share |")
    print("|---|---|---|---|---|---|")
    stepped = blocks.isa() if blocks.isa() in isas else isas[0]
    for name, runner in (("C++ forward", runners[f"the file's blocks, {stepped}"]), ("Python loop", loop)):
        parts = step_breakdown(runner, prompt, args.steps)
        print(f"| {name} | {parts['wall']:.2f} | {parts['matmul']:.2f} | {parts['attention']:.2f} | {parts['other']:.2f} "
              f"| {parts['other'] / parts['wall']:.0%} |")

    reference = runners.get("fp32 (the file dequantized)")
    if reference is None:
        return
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS]
    text_ids = tokenizer(open(__file__).read())["input_ids"][: args.ppl_tokens]
    ppl_fp32 = decode_perplexity(reference, text_ids)
    print(f"\nquality vs the file dequantized to fp32 (greedy agreement over {len(prompts)} prompts x 32 positions, both "
          f"fed fp32's choice; perplexity of {len(text_ids)} tokens of this file: fp32 {ppl_fp32:.3f})")
    for name in [n for n in runners if n != "fp32 (the file dequantized)" and not n.startswith("llama.cpp")]:
        agreement = greedy_agreement(reference, runners[name], prompts, 32)
        ppl = decode_perplexity(runners[name], text_ids)
        print(f"| {name} | agreement {agreement:.1%} | perplexity {ppl:.3f} ({ppl / ppl_fp32 - 1:+.2%}) |")


if __name__ == "__main__":
    main()
