"""The decode step on a GPU: graph against eager, bf16 against int4, against transformers' compiled generate.

Random-weight Llama models of the embedded model's shape (135M), a 1B and
an 8B (Llama 3) shape are built on the device, so no file is needed. For
each shape and weight format (bf16; tinygemm int4, group 32 and 128):
greedy decode tokens/s of our eager step and of the step replayed from a
CUDA graph (a host read of the chosen token every step, as the server's
loop does), the fraction of the bandwidth limit the graph reaches (weight
bytes plus the KV bytes attention reads per token, times tokens/s, over
the device-to-device copy bandwidth measured in the same run), and the
time to the first token of a 2,000-token prompt (prefill in the engine's
512-token chunks), and how many kernels one step launches on PyTorch's
ops and on our kernels (``step_ops``). For bf16: the same step with cuBLAS's
products in place of ours; a copy-heavy reply (its own tokens as drafts)
against plain steps; the token chosen inside the step against the host's
choice, and the choice's microseconds; with ``--products``, each matrix
product of 1 and 8 rows, ours against cuBLAS, and the best of 24 launches
of ours. Then several streams' rows in shared steps against a
step per row: one stream, 2 and 4 streams stepped together, whether the 4
decode what they decode alone, and what a verify of r rows costs against
one step. Then transformers' fast path on the same weights:
``generate`` with a static cache and ``torch.compile(mode="reduce-overhead")``;
and our step on PyTorch's ops compiled the same way, and compiled by
Inductor inside our captured graph: Inductor's fusion against our kernels.

    python -m bench.gpu [--shapes 135m 1b 8b] [--steps 128] [--formats bf16 int4g32 int4g128] [--products]
                        [--no-hf] [--no-compile]
"""
import argparse
import dataclasses
import functools
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from bench.common import greedy_steps_rate, write_results
from tornchat.engine import cuda_graph, llama, quant, speculate, step_ops
from tornchat.engine.model import PREFILL_CHUNK

SHAPES = {  # hidden, FFN, layers, heads, KV heads, vocabulary, tied embedding
    "135m": (576, 1536, 30, 9, 3, 49152, True),
    "1b": (2048, 8192, 16, 32, 8, 49152, True),
    "8b": (4096, 14336, 32, 32, 8, 128256, False),
}
PROMPT_TOKENS = 2000
SHORT_PROMPT = 16


def hf_model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, ffn, layers, heads, kv_heads, vocab, tied = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tied,
                         max_position_embeddings=4096, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def copy_bandwidth() -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - started)


def storage_bytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in vars(w).values() if isinstance(t, torch.Tensor))


def weight_bytes(runner) -> int:
    """What a decode step reads of the weights: every layer matrix (of a mixture of experts, the chosen ones), the
    head."""
    return int(sum(layer.step_bytes(storage_bytes) for layer in runner.layers)) + storage_bytes(runner.head)


def decode_rate(runner, steps: int) -> tuple[float, int]:
    """Greedy tokens/s after a short prompt, and the KV positions attention read per token (on average)."""
    cache = runner.new_cache()
    logits = runner.forward(list(range(100, 100 + SHORT_PROMPT)), cache)
    _, token = greedy_steps_rate(runner, cache, int(logits.argmax()), 8)  # warm: captures, allocator
    rate, _ = greedy_steps_rate(runner, cache, token, steps)
    return rate, cache.length - steps // 2


def together(runner, streams: int, steps: int) -> tuple[float, list[list[int]]]:
    """Aggregate greedy tokens/s of ``streams`` sequences stepped together (``forward_many``, as the
    scheduler does), each token read back to the host every step; and each sequence's tokens."""
    caches = [runner.new_cache() for _ in range(streams)]
    tokens = [[int(runner.forward(list(range(100 + 50 * s, 100 + 50 * s + SHORT_PROMPT)), cache).argmax())]
              for s, cache in enumerate(caches)]

    def run(count: int) -> None:
        for _ in range(count):
            rows = runner.forward_many([([ids[-1]], cache, True) for ids, cache in zip(tokens, caches)])
            for ids, logits in zip(tokens, rows):
                ids.append(int(logits[0].argmax()))

    run(8)  # warm: the mix is run eagerly once, then captured
    started = time.perf_counter()
    run(steps)
    return streams * steps / (time.perf_counter() - started), tokens


def rows_per_step(spec, weights, steps: int, prompt_ids: list[int]) -> dict:
    """Several generations' rows in captured steps of up to STEP_ROWS rows (``rows8``) against every row a step
    of its own (``rows1``, as before): one stream's tokens/s, 2 and 4 streams stepped together, how many of the
    4 decoded the greedy tokens they decode alone, and a verify of r rows against one step (speculate.measure)."""
    out = {}
    for rows in (1, cuda_graph.STEP_ROWS):
        runner = llama.LlamaRunner(spec, weights)
        runner.graphs = cuda_graph.GraphedSteps(runner, rows=rows)
        figures = out[f"rows{rows}"] = {"one_stream": round(decode_rate(runner, steps)[0], 1)}
        for n in (2, 4):
            rate, tokens = together(runner, n, steps)
            figures[f"{n}_streams"] = round(rate, 1)
        figures["equal_to_alone_4"] = sum(ids == solo(runner, s, steps) for s, ids in enumerate(tokens))
        figures["verify_costs"] = list(speculate.measure(runner, prompt_ids[:256]).relative)
    return out


def solo(runner, stream: int, steps: int) -> list[int]:
    """``together``'s tokens of sequence ``stream``, decoded alone."""
    cache = runner.new_cache()
    ids = [int(runner.forward(list(range(100 + 50 * stream, 100 + 50 * stream + SHORT_PROMPT)), cache).argmax())]
    for _ in range(8 + steps):
        ids.append(int(runner.forward([ids[-1]], cache, decode=True).argmax()))
    return ids


def ttft(runner, prompt_ids: list[int]) -> float:
    """Seconds from an empty cache to the first token of the prompt (median of 3)."""
    times = []
    for _ in range(3):
        cache = runner.new_cache()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for start in range(0, len(prompt_ids), PREFILL_CHUNK):
            logits = runner.forward(prompt_ids[start : start + PREFILL_CHUNK], cache)
        int(logits.argmax())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def kv_bytes_per_position(runner) -> int:
    return len(runner.layers) * 2 * runner.kv_heads * runner.head_dim * torch.finfo(runner.kv_dtype).bits // 8


FORMATS = {"bf16": None, "int4g32": 32, "int4g128": 128}


def ours(shape: str, model, steps: int, bandwidth: float, compile_step: bool, formats=tuple(FORMATS),
         products_sweep: bool = False) -> list[dict]:
    spec, weights = llama.from_transformers(model)
    prompt_ids = [int(t) for t in torch.randint(100, 40000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))]
    rows = []
    for fmt in formats:
        group = FORMATS[fmt]
        packed = weights if group is None else llama.pack(weights, "int4", group_size=group, keep=True)
        row = {"shape": shape, "weights": fmt if group is None else f"int4 g{group}"}
        for graphs in (False, True):
            runner = llama.LlamaRunner(spec, packed, graphs=graphs)
            rate, positions = decode_rate(runner, steps)
            per_token = weight_bytes(runner) + positions * kv_bytes_per_position(runner)
            row["graph" if graphs else "eager"] = round(rate, 1)
            if graphs:
                row["bandwidth_fraction"] = round(per_token * rate / bandwidth, 3)
                row["weight_gb"] = round(weight_bytes(runner) / 1e9, 3)
                row["ttft_2000_ms"] = round(1000 * ttft(runner, prompt_ids), 1)
                row["captures"] = runner.graphs.captures
                row["kernels_per_step"] = {"pytorch": kernels_per_step(runner, step_ops.REFERENCE),
                                           "ours": kernels_per_step(runner, step_ops.triton_ops())}
                if group is None:
                    row["speculation"] = guarded(copy_heavy, llama.LlamaRunner(spec, packed), steps)
                    row["choice_in_step"] = guarded(choice_in_step, llama.LlamaRunner(spec, packed), steps)
                    if products_sweep:
                        row["products"] = guarded(product_times, runner)
                    row["rows_per_step"] = guarded(rows_per_step, spec, packed, steps, prompt_ids)
                    # Last: once its runner and graphs (cuBLAS products captured) were gone, the next capture of
                    # another runner failed on an H200 (2026-11-27, cause not established; the server holds one
                    # runner and captures no cuBLAS product).
                    row |= cublas_products(spec, packed, steps, bandwidth, per_token)
                if compile_step and group != 32:
                    row["torch_compile"] = compiled_rate(runner, steps)
                    row["compiled_then_captured"] = captured_compiled_rate(spec, packed, steps)
        row["graph_over_eager"] = round(row["graph"] / row["eager"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del packed
        torch.cuda.empty_cache()
    return rows


def cublas_products(spec, weights, steps: int, bandwidth: float, per_token: float) -> dict:
    """The captured step with cuBLAS's products in place of our kernel (``step_ops.linear_ref``; the step before
    it, whose rows' bits depend on the rows beside them): tokens/s, and a verify's costs on it."""
    runner = llama.LlamaRunner(spec, weights)
    ops = dataclasses.replace(step_ops.triton_ops(), linear=step_ops.linear_ref)
    runner.graphs = cuda_graph.GraphedSteps(runner, functools.partial(cuda_graph.step, ops=ops))
    rate, _ = decode_rate(runner, steps)
    return {"graph_cublas_products": round(rate, 1), "bandwidth_fraction_cublas": round(per_token * rate / bandwidth, 3)}


def product_times(runner) -> list[dict]:
    """Each matrix of a layer and the head: microseconds of one product of 1 and of 8 rows by cuBLAS and by our
    kernel (its own launch, ``linear_config``), timed as CUDA graph replays; and the best of a few other
    launches for 1 row."""
    from triton.testing import do_bench_cudagraph

    kernels = step_ops._kernels()
    layer = runner.layers[0]
    out = []
    for name, w in (("wqkv", layer.wqkv), ("wo", layer.wo), ("w13", layer.w13), ("w2", layer.w2), ("head", runner.head)):
        n, k = w.shape
        x = torch.randn(8, k, device="cuda", dtype=w.dtype)
        row = {"matrix": name, "n": n, "k": k, "config": vars(kernels.linear_config(n, k))}
        for m in (1, 8):
            row[f"cublas_{m}"] = round(1000 * do_bench_cudagraph(lambda: quant.linear(x[:m], w), rep=10), 2)
            row[f"ours_{m}"] = round(1000 * do_bench_cudagraph(lambda: kernels.linear_rows(x[:m], w), rep=10), 2)
        tried = {}
        for block_n in (16, 32, 64, 128):
            for block_k in (128, 256, 512):
                for stages in (3, 4):
                    config = kernels.LinearConfig(block_n, block_k, 4, stages)
                    try:
                        tried[config] = do_bench_cudagraph(lambda: kernels.linear_rows(x[:1], w, config), rep=10)
                    except Exception:  # noqa: BLE001 (too much shared memory for this tile and these stages)
                        continue
        best = min(tried, key=tried.get)
        row["best_1"] = {"config": vars(best), "us": round(1000 * tried[best], 2)}
        row["ours_gb_s_1"] = round(n * k * w.element_size() / row["ours_1"] / 1000, 1)
        out.append(row)
    return out


def guarded(measure, *args):
    """measure(*args), or why it failed: one failed measurement does not end the run."""
    try:
        return measure(*args)
    except Exception as exc:  # noqa: BLE001 (a failure is a result to report)
        traceback.print_exc()
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def choice_in_step(runner, steps: int) -> dict:
    """The token chosen inside the captured step and checked for a stop there (``choose_step``) against the
    step ending at its logits with the token chosen on the host as the loop does otherwise (``kernels.sample``,
    its own graph, on a copy of the logits; then a read of the token): tokens/s of each, greedy and sampled
    (temperature 0.8, top-k 50, top-p 0.95), whether they chose the same tokens, and the microseconds of the
    choice and the stop check alone (one stop string, replayed from a graph)."""
    from triton.testing import do_bench_cudagraph

    from tornchat.engine.choose import OnDevice
    from tornchat.kernels import sample, step_choice, stopcheck
    from tornchat.kernels.dispatch import triton_module

    vocab, device = runner.head.shape[0], runner.device
    spelled = tuple(bytes([97 + i % 26, 97 + i // 26 % 26]) for i in range(vocab))  # a vocabulary of byte pairs
    table = step_choice.padded_table(stopcheck.build_stop_table(spelled, ["\n\nUser:"], {0}, device))
    prompt_ids = list(range(100, 100 + SHORT_PROMPT))
    cache = runner.new_cache()
    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        params = (torch.tensor([temperature], device=device), torch.tensor([50], dtype=torch.int32, device=device),
                  torch.tensor([0.95], device=device), torch.tensor([7], dtype=torch.int64, device=device))

        def on_host(count: int) -> list[int]:
            runner.truncate(cache, 0)
            tokens = [int(sample(runner.forward(prompt_ids, cache)[None], *params, 0)[0][0])]
            for i in range(1, count):
                logits = runner.forward([tokens[-1]], cache, decode=True)
                tokens.append(int(sample(logits[None], *params, i)[0][0]))
            return tokens

        def in_step(count: int) -> list[int]:
            runner.truncate(cache, 0)
            tokens = [int(sample(runner.forward(prompt_ids, cache)[None], *params, 0)[0][0])]
            choice = OnDevice(temperature == 0.0, *params, table, tokens)
            for _ in range(1, count):
                tokens.append(runner.choose_step(tokens[-1], cache, choice).token)
            return tokens

        for decode in (on_host, in_step):
            decode(8)  # warm: captures
            started = time.perf_counter()
            tokens = decode(steps + 1)
            out[f"{name}_{decode.__name__}_tok_s"] = round(steps / (time.perf_counter() - started), 1)
            out[f"{name}_{decode.__name__}_tokens"] = tokens
        out[f"{name}_same_tokens"] = out.pop(f"{name}_on_host_tokens") == out.pop(f"{name}_in_step_tokens")
        logits = torch.randn(1, vocab, device=device)
        index = torch.zeros(1, dtype=torch.int32, device=device)
        window = torch.full((1, step_choice.WINDOW), -1, dtype=torch.int64, device=device)
        tokens, positions = torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)
        result = torch.zeros(1, 2, dtype=torch.int64, device=device)
        sampler = triton_module("sampling_triton")
        rows = (params[0], params[1].long(), params[2], params[3])  # the dtypes the sampler's kernels read

        def choose() -> None:
            ids = step_choice.greedy(logits) if temperature == 0.0 else sampler.sample_at(logits, *rows, index)
            step_choice.advance(ids, tokens, positions, index, window, table, result)

        out[f"{name}_choice_and_stop_us"] = round(1000 * do_bench_cudagraph(choose, rep=20), 2)
    return out


def copy_heavy(runner, steps: int, draft: int = speculate.MAX_DRAFT) -> dict:
    """A greedy reply decoded again with its own tokens as drafts (what ``--speculate lookup`` does with a
    ``prediction`` that is the reply): tokens/s with verifies of ``draft`` drafts against one-token steps, each
    reading its tokens on the host once, and whether the tokens are the same."""
    prompt_ids = list(range(100, 100 + SHORT_PROMPT))
    cache = runner.new_cache()  # one cache throughout, so that the warm-up's captured steps are the timed runs'

    def decode(reference: list[int] | None) -> tuple[list[int], float, int]:
        runner.truncate(cache, 0)
        tokens = [int(runner.forward(prompt_ids, cache).argmax())]
        forwards = 0
        torch.cuda.synchronize()
        started = time.perf_counter()
        while len(tokens) < steps:
            drafts = reference[len(tokens) : len(tokens) + draft] if reference else []
            chosen = runner.verify([tokens[-1], *drafts], cache).argmax(-1).tolist()
            forwards += 1
            for i, token in enumerate(chosen):
                tokens.append(token)
                if i == len(drafts) or token != drafts[i]:
                    break
            runner.truncate(cache, cache.length - (len(drafts) - i))  # the fed token and i drafts were right
        return tokens[:steps], time.perf_counter() - started, forwards

    decode(None), decode(list(range(steps)))  # warm: captures of the verify sizes
    plain, plain_s, _ = decode(None)
    drafted, drafted_s, forwards = decode(plain)
    return {"plain_tok_s": round(len(plain) / plain_s, 1), "lookup_tok_s": round(len(drafted) / drafted_s, 1),
            "speedup": round(plain_s / drafted_s, 2), "forwards": forwards, "tokens": len(drafted),
            "same_tokens": drafted == plain}


def kernels_per_step(runner, ops: step_ops.StepOps) -> int | str:
    """CUDA kernels one eager step of one row launches with ``ops`` (what its captured graph replays); or why the
    profiler could not count them."""
    try:
        return _kernels_per_step(runner, ops)
    except Exception as exc:  # noqa: BLE001 (a failed count is a result to report)
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _kernels_per_step(runner, ops: step_ops.StepOps) -> int:
    cache = runner.new_cache()
    runner.forward(list(range(100, 100 + SHORT_PROMPT)), cache)
    token, position = torch.tensor([5], device="cuda"), torch.tensor([SHORT_PROMPT], device="cuda")
    with torch.inference_mode():
        cuda_graph.step(runner, token, position, (cache.kv,), ops)  # compiles the kernels outside the count
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            cuda_graph.step(runner, token, position, (cache.kv,), ops)
            torch.cuda.synchronize()
    return sum(1 for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def compiled_rate(runner, steps: int) -> float | str:
    """Our step on PyTorch's ops (``step_ops.REFERENCE``) through torch.compile(mode="reduce-overhead") on a fixed
    cache, tokens/s; or why it failed."""
    try:
        compiled = torch.compile(functools.partial(cuda_graph.step, ops=step_ops.REFERENCE), mode="reduce-overhead",
                                 fullgraph=True)
        cache = runner.new_cache()
        runner.forward(list(range(100, 100 + SHORT_PROMPT)), cache)
        runner.reserve(cache, 1024)
        token = torch.tensor([5], device="cuda")
        position = torch.tensor([SHORT_PROMPT], device="cuda")
        started = time.perf_counter()
        with torch.inference_mode():
            for _ in range(3):  # compile and record
                compiled(runner, token, position, cache.kv)
        compile_s = time.perf_counter() - started
        started = time.perf_counter()
        with torch.inference_mode():
            for i in range(steps):
                position.fill_(SHORT_PROMPT + i)
                token.copy_(compiled(runner, token, position, cache.kv)[0].argmax()[None])
                int(token)
        return {"tokens_per_s": round(steps / (time.perf_counter() - started), 1), "compile_s": round(compile_s, 1)}
    except Exception as exc:  # noqa: BLE001 (a failed compile is a result to report)
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def captured_compiled_rate(spec, weights, steps: int) -> dict | str:
    """``step`` on PyTorch's ops compiled by Inductor (its fused kernels, no CUDA graphs of its own) inside our
    captured graph: Inductor's fusion against our kernels'."""
    try:
        runner = llama.LlamaRunner(spec, weights)
        started = time.perf_counter()
        step = functools.partial(cuda_graph.step, ops=step_ops.REFERENCE)
        runner.graphs = cuda_graph.GraphedSteps(runner, torch.compile(step, fullgraph=True, dynamic=False))
        cache = runner.new_cache()
        token = int(runner.forward(list(range(100, 100 + SHORT_PROMPT)), cache).argmax())
        token = int(runner.forward([token], cache, decode=True).argmax())
        compile_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(steps):
            token = int(runner.forward([token], cache, decode=True).argmax())
        return {"tokens_per_s": round(steps / (time.perf_counter() - started), 1), "compile_s": round(compile_s, 1)}
    except Exception as exc:  # noqa: BLE001
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def transformers_fast_path(shape: str, model, steps: int) -> dict:
    """transformers' generate with a static cache and the forward compiled (reduce-overhead), greedy."""
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    short = torch.arange(100, 100 + SHORT_PROMPT, device="cuda")[None]
    long = torch.randint(100, 40000, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)).cuda()

    def timed(ids, new_tokens):
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    started = time.perf_counter()
    for _ in range(2):
        timed(short, steps), timed(long, 1)
    warm = time.perf_counter() - started
    first = min(timed(short, 1) for _ in range(3))
    whole = min(timed(short, steps + 1) for _ in range(3))
    row = {"shape": shape, "weights": "bf16", "transformers_decode": round(steps / (whole - first), 1),
           "transformers_ttft_2000_ms": round(1000 * statistics.median(timed(long, 1) for _ in range(3)), 1),
           "transformers_compile_and_warm_s": round(warm, 1)}
    print(json.dumps(row), flush=True)
    return row


def save_checkpoint(shape: str, directory: str, tokenizer_dir: str | None) -> None:
    from transformers import AutoTokenizer

    from tornchat import checkpoint

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else checkpoint.load(None).tokenizer
    model = hf_model(shape)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' compiled generate")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of our step")
    parser.add_argument("--no-ours", action="store_true", help="only transformers' compiled generate")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--products", action="store_true", help="time each matrix product, ours against cuBLAS")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--checkpoint-out", help="also save the first shape's random model here, a HF directory "
                        "for the server (bench/http_overhead.py --checkpoint-path), with --tokenizer's tokenizer")
    parser.add_argument("--tokenizer", help="HF tokenizer directory (default: the embedded model's)")
    args = parser.parse_args()
    if args.checkpoint_out:
        save_checkpoint(args.shapes[0], args.checkpoint_out, args.tokenizer)
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for shape in args.shapes:
        model = hf_model(shape)
        if not args.no_ours:
            rows += ours(shape, model, args.steps, bandwidth, not args.no_compile, args.formats, args.products)
        if not args.no_hf:
            rows.append(transformers_fast_path(shape, model, args.steps))
        del model
        torch.cuda.empty_cache()
    if args.json:
        write_results(Path(args.json), {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
