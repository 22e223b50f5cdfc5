"""Microbenchmark of the GGUF block kernels (tornchat/engine/blocks.py, csrc/blocks/).

For the 1B Llama's matrices (K = 2048: qkv 3072, o 2048, gate+up 16384, down 2048 x 8192, head 49152) in
Q4_K and Q6_K, Qwen3 4B's largest (qkv 6144, gate+up 19456 of K = 2560, down 2560 x 9728, head 151936), and
the 135M SmolLM2's (hidden 576: qkv 960, o 576, gate+up 3072, down 576 x 1536, head 49152) in Q4_1 and Q8_0,
on each instruction-set path, the weights in the layout that path reads them in as the model loads them
(``blocks.group``: grouped, or in panels where the path reads the type so, except a head, which never takes
panels; ``--file-layout``: as the file stores them):
  decode (1 row): microseconds, GB/s of weights read, % of this machine's read bandwidth (torch sum over
    1 GiB, measured here); the weights rotate through 1 GiB of copies so that they come from memory;
  verify (4 rows): time / the 1-row time, weights from memory (and in parentheses both from cache: the
    product's first 16 MiB of columns);
  compute: nanoseconds per 1,024 weights a thread at 1, 2, 4 and 8 rows, from cache as above: what a row
    adds to a product once memory no longer bounds it (and what the columns' unpacking costs at one row);
  prefill (512 rows): GOPS (2 * rows * N * K / s) and torch._int_mm's GOPS on int8 [512, K] x [K, N].

    python -m bench.blocks [--isa avx2,...] [--threads 2] [--quick] [--file-layout]
"""
import argparse
import time

import torch

from tornchat.engine import blocks
from tornchat.engine import ggml

SHAPES = [  # (name, N, K, types)
    ("1B qkv", 3072, 2048, ("Q4_K", "Q6_K")),
    ("1B o", 2048, 2048, ("Q4_K", "Q6_K")),
    ("1B gate+up", 16384, 2048, ("Q4_K", "Q6_K")),
    ("1B down", 2048, 8192, ("Q4_K", "Q6_K")),
    ("1B head", 49152, 2048, ("Q6_K",)),
    ("4B qkv", 6144, 2560, ("Q4_K",)),  # Qwen3 4B (issue 27's decode): K = 2560 and 9728
    ("4B gate+up", 19456, 2560, ("Q4_K",)),
    ("4B down", 2560, 9728, ("Q4_K", "Q6_K")),
    ("4B head", 151936, 2560, ("Q6_K",)),
    ("135M qkv", 960, 576, ("Q4_1",)),
    ("135M o", 576, 576, ("Q4_1",)),
    ("135M gate+up", 3072, 576, ("Q4_1",)),
    ("135M down", 576, 1536, ("Q4_1",)),
    ("135M head", 49152, 576, ("Q8_0",)),
]
POOL = 1 << 30  # bytes of weight copies the decode timing rotates through
IN_CACHE = 16 << 20  # bytes of a product's first columns the in-cache timings take: within a 32 MiB L3, and long
# enough calls (0.2-0.5 ms) that the threads' start and join stay out of the figure


def timed(fn, min_seconds=0.3, min_calls=3) -> float:
    """The fastest call's seconds: on a machine shared with other work, the least disturbed one."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bandwidth() -> float:
    """Read bandwidth in bytes/s: torch sum over 1 GiB of fp32."""
    x = torch.ones(POOL // 4)
    return POOL / timed(lambda: x.sum(), min_seconds=1.0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--isa", default=",".join(i for i in blocks.isas() if i != "generic"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="shapes whose name contains this")
    parser.add_argument("--quick", action="store_true", help="no prefill column, shorter timings")
    parser.add_argument("--file-layout", action="store_true", help="the weights as the file stores them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = args.isa.split(",")
    bw = bandwidth()  # before the pool: 1 GiB each
    print(f"read bandwidth (torch sum over 1 GiB, {args.threads} threads): {bw / 1e9:.1f} GB/s")
    pool = torch.randint(0, 256, (POOL,), dtype=torch.uint8)
    print("| shape | type | path | layout | 1 row us | GB/s | % bw | 4 rows / 1 row (in cache) | "
          "compute ns / 1,024 weights at 1, 2, 4, 8 rows | 512 rows GOPS | _int_mm GOPS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, k, types in SHAPES:
        if args.only not in name:
            continue
        int_mm = None
        for t in types:
            info = ggml.TYPES[t]
            row_bytes = k // info.values * info.bytes
            size = n * row_bytes
            copies = [pool[i * size : (i + 1) * size].view(n, row_bytes) for i in range(max(1, POOL // size))]
            hot = copies[0]
            for isa in isas:
                layout = t
                if not args.file_layout:  # random bytes either way: rearranging the pool for each path only moves them
                    for copy in copies:  # a head never in panels, as gguf_file.load lays it out (a tied embedding too)
                        layout = blocks.group(copy, t, isa, panels="head" not in name)
                x1, x4 = torch.randn(1, k), torch.randn(4, k)
                state = {"i": 0}

                def cold(x):  # the weights from memory: a different copy each call
                    state["i"] = (state["i"] + 1) % len(copies)
                    blocks.mm(x, [copies[state["i"]]], [layout], isa)

                seconds = 0.1 if args.quick else 0.3
                t1, t4 = timed(lambda: cold(x1), seconds), timed(lambda: cold(x4), seconds)
                cached = hot[:max(16, min(n, IN_CACHE // row_bytes // 16 * 16))]  # whole slabs of 16 rows (panels)
                hot_times = {rows: timed(lambda x=torch.randn(rows, k): blocks.mm(x, [cached], [layout], isa), seconds)
                             for rows in (1, 2, 4, 8)}
                weights = cached.shape[0] * k / 1024 / args.threads  # per thread
                compute = ", ".join(f"{hot_times[rows] / weights * 1e9:.1f}" for rows in hot_times)
                prefill = mm_gops = ""
                if not args.quick:
                    x512 = torch.randn(512, k)
                    tp = timed(lambda: blocks.mm(x512, [hot], [layout], isa), 0.2, 2)
                    prefill = f"{2 * 512 * n * k / tp / 1e9:.0f}"
                    if int_mm is None:
                        a = torch.randint(-127, 128, (512, k), dtype=torch.int8)
                        b = torch.randint(-127, 128, (k, n), dtype=torch.int8)
                        int_mm = 2 * 512 * n * k / timed(lambda: torch._int_mm(a, b), 0.2, 2) / 1e9
                    mm_gops = f"{int_mm:.0f}"
                print(f"| {name} {n}x{k} | {t} | {isa} | {layout} | {t1 * 1e6:.0f} | {size / t1 / 1e9:.1f} | "
                      f"{100 * size / t1 / bw:.0f} | {t4 / t1:.2f} ({hot_times[4] / hot_times[1]:.2f}) | {compute} | "
                      f"{prefill} | {mm_gops} |", flush=True)


if __name__ == "__main__":
    main()
