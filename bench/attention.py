"""Time of the C++ attention (``fused.attend``, csrc/attention.cpp) on each of this CPU's paths.

A 512-row prefill chunk after 1,536, 3,584 and 7,680 positions, and a one-row step after 4,095, over a bf16
cache in the forward's layout, for the 1B Llama's shapes (32 heads over 8 KV heads, head_dim 64) and the 135M's
(9 over 3): the fastest of --calls calls, each path in turn. Paths: the default (with AVX-512 BF16, VDPBF16PS
for a bf16 cache's scores and weighted values), "avx512f" (the AVX-512 loops without it) where the CPU has
AVX-512, and the AVX2 loops ("avx2") where it has AVX2; every one gives the same bits. To compare two builds,
run it under each in turn (docs/performance.md, 2026-12-07, a fifth session).

    python -m bench.attention [--threads 2] [--calls 15]
"""
import argparse

import torch

from bench.common import fastest_ms
from tornchat.engine import blocks, fused
from tornchat.engine.cpu import describe

SHAPES = [("1B", 32, 8, 64), ("135M", 9, 3, 64)]  # name, heads, KV heads, head_dim
CASES = [(1536, 512), (3584, 512), (7680, 512), (4095, 1)]  # positions before, rows


def paths() -> list[str]:
    isas = blocks.isas()
    named = [""]
    if {"avx512vnni", "amx"} & set(isas):
        named.append("avx512f")
    if "avx2" in isas:
        named.append("avx2")
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU: {describe()}; {args.threads} threads; fastest of {args.calls} calls, ms")
    names = [path or "default" for path in paths()]
    print("| shape | rows after positions | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for name, heads, kv_heads, head_dim in SHAPES:
        for before, rows in CASES:
            capacity = (before + rows + 15) // 16 * 16
            cache = (torch.randn(2, capacity, kv_heads, head_dim) * 0.5).to(torch.bfloat16)
            keys, values = fused.forward_layout(cache).unbind(0)
            q = torch.randn(rows, heads, head_dim).to(torch.bfloat16).float()
            times = [fastest_ms(lambda: fused.attend(q, keys, values, before, head_dim**-0.5, 0, path), args.calls)
                     for path in paths()]
            print(f"| {name} | {rows} after {before:,} | " + " | ".join(f"{t:.2f}" for t in times) + " |")


if __name__ == "__main__":
    main()
