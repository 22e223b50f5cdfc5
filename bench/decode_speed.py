"""Decode and prefill speed of a GGUF's packed blocks, side by side in one process, against llama.cpp.

Rows: the file dequantized to fp32 (the reference; --no-reference skips it
for large models); what `--quantize auto` makes of the file on this machine
(its quantized blocks as int4 and int8, timed afresh); that with the PyTorch
reference ops instead of the C++ fused ones (the fused-ops lever), and with
the C++ ops called from the Python layer loop instead of the C++ decode
step; with --formats, each --quantize format packed from the fp32 values;
and llama.cpp on the same file when llama-cpp-python is installed. For each: greedy decode tokens/s after a short chat prompt and
after a ~2,000-token one, and prefill tokens/s of that prompt (in the
engine's 512-token chunks). Runners take turns round by round, so load from
other processes hits all of them alike; the table gives the median and the
best round. Then where a decode step of the auto format goes (matmuls,
attention, and the rest: eager-op overhead), with each set of ops. Then the
quality of each format: per-position greedy agreement with fp32 (both fed
fp32's choice) over fixed prompts, and perplexity on a fixed text, both
through the decode weights, against the dequantized file.

    python bench/decode_speed.py [--checkpoint-path FILE.gguf] [--threads 2] [--steps 64] [--rounds 3]
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
from tornchat.engine.model import PREFILL_CHUNK
from tornchat.weights import gguf_file

MATMULS = ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
           "tornchat::vnni_int4_mm", "tornchat::vnni_int8_mm")
ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math", "tornchat::attend")

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
    parser.add_argument("--checkpoint-path", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=256, help="tokens of the perplexity text")
    parser.add_argument("--no-reference", action="store_true", help="skip the fp32 reference (4 bytes per weight)")
    parser.add_argument("--formats", action="store_true", help="also each --quantize format packed from fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = Path(args.checkpoint_path) if args.checkpoint_path else checkpoint.default_gguf_path()
    print(f"CPU: {describe()}\nmodel: {path.name}")
    loaded = checkpoint.load(str(path), model_impl="lean")
    tokenizer, (config, weights) = loaded.tokenizer, loaded.lean
    with tempfile.TemporaryDirectory() as fresh:  # time the formats afresh, whatever an earlier start cached
        auto, choice = autotune.choose(config, weights, "packed", build.quality_ids(tokenizer), Path(fresh) / "d.json",
                                       "bench", gate=True)
    print(f"auto picks {choice.format.label()} over {llama.weights_label(auto.weights)}; whole decode steps, ms: "
          f"{choice.step_ms}; quality {choice.quality}")
    auto_loop = choice.format.runner(config, weights)
    auto_loop.decode_step = None  # the C++ ops, called from the Python loop
    auto_reference_ops = llama.LlamaRunner(config, auto.weights, auto.kv_dtype, auto.prefill_dtype, auto.prefill_from,
                                           ops=fused.REFERENCE)
    runners = {}
    if not args.no_reference or args.formats:
        runners["fp32 (the file dequantized)"] = llama.LlamaRunner(*gguf_file.load(path, plain=torch.float32))
    runners |= {
        f"auto: {choice.format.label()}": auto,
        "auto, C++ ops from the Python loop": auto_loop,
        "auto, PyTorch reference ops": auto_reference_ops,
    }
    if args.formats:
        for mode in ("bf16", "int8", "int4"):
            config_, plain = gguf_file.load(path, plain=torch.float32)
            runners[f"{mode} from fp32 (bf16 inputs)"] = llama.LlamaRunner(config_, llama.pack(plain, mode))
    if importlib.util.find_spec("llama_cpp"):
        runners[f"llama.cpp ({path.name})"] = LlamaCpp(path, args.threads)
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

    llama_cpp = max(decode.get(f"llama.cpp ({path.name})", [0]))
    llama_cpp_prefill = max(prefill.get(f"llama.cpp ({path.name})", [0]))
    print(f"\nCPU: {describe()}; {torch.get_num_threads()} threads; {path.name}; median and best of {args.rounds} rounds")
    print("| forward | decode tok/s, median (best) | best vs llama.cpp's best | decode tok/s at 2,000 tokens "
          "| prefill tok/s (2,000 tokens), median (best) | best vs llama.cpp's best |")
    print("|---|---|---|---|---|---|")
    for name in runners:
        d, dl, p = (statistics.median(rates[name]) for rates in (decode, decode_long, prefill))
        versus = f"{max(decode[name]) / llama_cpp:.2f}x" if llama_cpp else "-"
        versus_prefill = f"{max(prefill[name]) / llama_cpp_prefill:.2f}x" if llama_cpp_prefill else "-"
        print(f"| {name} | {d:.1f} ({max(decode[name]):.1f}) | {versus} | {dl:.1f} | {p:.0f} ({max(prefill[name]):.0f}) "
              f"| {versus_prefill} |")

    print("\nWhere a decode step of the auto format goes, ms (short prompt; kernel times from torch.profiler):")
    print("| ops | step | matmuls | attention | rest: per-op overhead | overhead share |")
    print("|---|---|---|---|---|---|")
    for name, runner in (("C++ decode step", auto), ("C++ ops, Python loop", auto_loop),
                         ("PyTorch reference ops", auto_reference_ops)):
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
          f"fed fp32's choice; perplexity of {len(text_ids)} tokens of this file fed as decode steps: fp32 {ppl_fp32:.3f})")
    for name in [n for n in runners if n != "fp32 (the file dequantized)" and not n.startswith(("llama.cpp", "auto,"))]:
        agreement = greedy_agreement(reference, runners[name], prompts, 32)
        ppl = decode_perplexity(runners[name], text_ids)
        print(f"| {name} | agreement {agreement:.1%} | perplexity {ppl:.3f} ({ppl / ppl_fp32 - 1:+.2%}) |")


if __name__ == "__main__":
    main()
