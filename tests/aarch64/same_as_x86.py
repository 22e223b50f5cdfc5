"""run.sh's comparison of attention on aarch64 with x86: harness.cpp's exact_attention outputs (a file written under
qemu) against the same cases computed here, natively, on every attention path this x86 CPU runs. Exits 1 where
any value's bits differ.

    python same_as_x86.py ARM_OUTPUTS   (a Python with this checkout's extensions built)
"""
import os
import sys

import torch

from tornchat.engine import blocks, fused


def exact_values(n: int, seed: int) -> torch.Tensor:
    """harness.cpp's exact_values: a multiplicative hash of each index, on a grid of 2^-11 in [-1, 1)."""
    i = torch.arange(n, dtype=torch.int64) + seed * 1000003
    return ((i * 2654435761).remainder(4294967296) // 1048576).float() / 2048.0 - 1.0


def exact_attention(isa: str) -> torch.Tensor:
    """harness.cpp's exact_attention, on the attention path beside the block kernels' isa."""
    heads, kv_heads, d, capacity, start, count = 8, 2, 64, 1216, 1100, 20
    outs, seed = [], 0
    for dtype in (torch.bfloat16, torch.float32):
        for window in (0, 500, -1):  # -1: denormal products
            tiny = 2.0**-66 if window < 0 else 1.0
            keys = (exact_values(capacity * kv_heads * d, seed + 1) * 4 * tiny).view(capacity, kv_heads, d).to(dtype)
            values = (exact_values(capacity * kv_heads * d, seed + 2) * 4).view(capacity, kv_heads, d).to(dtype)
            q = (exact_values(count * heads * d, seed + 3) * 4 * tiny).view(count, heads, d)
            seed += 3
            scale = 2.0**120 if window < 0 else 0.125
            outs.append(fused._native.attend(q, keys, values, start, scale, max(window, 0), isa).flatten())
    return torch.cat(outs)


arm = torch.from_file(sys.argv[1], size=os.path.getsize(sys.argv[1]) // 4, dtype=torch.float32)
paths = blocks.isas() + (["avx512f"] if {"avx512vnni", "amx"} & set(blocks.isas()) else [])
status = 0
for isa in paths:
    x86 = exact_attention(isa)
    differ = int((x86.view(torch.int32) != arm.view(torch.int32)).sum()) if x86.shape == arm.shape else x86.numel()
    print(f"attention over exact inputs, x86 {isa} against aarch64: {differ} of {x86.numel()} values differ")
    status |= differ > 0
sys.exit(status)
