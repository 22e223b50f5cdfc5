"""Sampling time per call: Triton kernel vs the sort-based PyTorch reference vs torch.multinomial.

Columns (milliseconds per call of one [B, V] batch, temperature 0.8,
top_k 50, top_p 0.9 unless ``--top-k``/``--top-p`` say otherwise; ``--top-k 0``
is what an OpenAI client sends, top-p alone):

- triton: ``tornchat.kernels.sampling_triton.sample`` (CUDA only), the
  engine's path: its launches replayed from a CUDA graph;
- triton-eager: the same kernels launched one by one (``sample_draws``);
- reference: ``sample_reference``, the sort-based definition of the
  semantics (a Python loop over rows);
- torch-sort: the usual batched framework sampler: one full sort per row,
  top-k and top-p masks on the sorted values, torch.multinomial;
- multinomial: softmax(logits / T) then torch.multinomial, no top-k/top-p:
  the floor of what a framework sampler costs.

On CUDA each is timed with triton.testing.do_bench; on a CPU-only machine
the triton column is null (the interpreter's speed says nothing about a GPU)
and the CPU paths are timed with a wall clock. Writes JSON and a PNG to
bench/results/.

    python -m bench.kernels [--quick] [--top-k K] [--top-p P] [--batches B ...]
"""
import argparse
import json
from pathlib import Path

import torch

from bench.common import RESULTS, fastest_ms, write_results
from tornchat.engine.cpu import describe
from tornchat.kernels.sampling import sample_reference

BATCHES = (1, 8, 64)
VOCABS = (32_000, 49_152, 152_064, 262_144)


def multinomial(logits, temperature, top_k, top_p, seed, step):
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    return torch.multinomial(probs, 1)[:, 0]


def torch_sort(logits, temperature, top_k, top_p, seed, step):
    z = logits.float() / temperature[:, None]
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, z.shape[-1]).clamp(1, z.shape[-1])  # top_k <= 0: no top-k
    kth = sorted_z.gather(1, (k - 1)[:, None])
    sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))
    probs = sorted_z.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_z = sorted_z.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    choice = torch.multinomial(sorted_z.softmax(dim=-1), 1)
    return order.gather(1, choice)[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B in {1, 8}, V in {32k, 49k}, fewer repeats")
    parser.add_argument("--top-k", type=int, default=50, help="0: no top-k (an OpenAI client's request)")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--batches", type=int, nargs="+", help=f"instead of {BATCHES}")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    print(f"device: {torch.cuda.get_device_name() if cuda else describe()}", flush=True)
    device = "cuda" if cuda else "cpu"
    batches, vocabs = (BATCHES[:2], VOCABS[:2]) if args.quick else (BATCHES, VOCABS)
    batches = args.batches or batches
    methods = {"reference": sample_reference, "torch-sort": torch_sort, "multinomial": multinomial}
    if cuda:
        from triton.testing import do_bench

        from tornchat.kernels import sampling_triton

        methods = {"triton": sampling_triton.sample, "triton-eager": sampling_triton.sample_draws, **methods}
    rows = []
    for batch in batches:
        for vocab in vocabs:
            logits = torch.randn(batch, vocab, device=device) * 3
            args_ = (
                torch.full((batch,), 0.8, device=device),
                torch.full((batch,), args.top_k, device=device, dtype=torch.int64),
                torch.full((batch,), args.top_p, device=device),
                torch.arange(batch, device=device),
                0,
            )
            row = {"batch": batch, "vocab": vocab, "triton": None, "triton-eager": None}
            for name, fn in methods.items():
                call = lambda fn=fn: fn(logits, *args_)  # noqa: E731
                row[name] = do_bench(call) if cuda else fastest_ms(call, 3 if args.quick else 10)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "device": torch.cuda.get_device_name() if cuda else describe(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "temperature": 0.8, "top_k": args.top_k, "top_p": args.top_p,
        "note": None if cuda else "no GPU: the triton column needs CUDA",
    }
    settings = "" if (args.top_k, args.top_p) == (50, 0.9) else f"-k{args.top_k}-p{args.top_p}"
    stem = RESULTS / f"kernels-{'cuda' if cuda else 'cpu'}{settings}{'-quick' if args.quick else ''}"
    write_results(stem.with_suffix(".json"), {"meta": meta, "rows": rows})
    plot(rows, meta, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


def plot(rows, meta, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        subset = [r for r in rows if r["batch"] == batch]
        for name in ("triton", "triton-eager", "reference", "torch-sort", "multinomial"):
            points = [(r["vocab"], r[name]) for r in subset if r.get(name) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set(title=f"B = {batch}", xlabel="vocabulary", ylabel="ms per call", xscale="log", yscale="log")
        ax.legend()
    fig.suptitle(f"sampling, {meta['device']}" + (f" ({meta['note']})" if meta["note"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
