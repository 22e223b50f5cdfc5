"""Weight-only int4 for CPU matmuls, with PyTorch's own packed kernel.

Decode reads every weight once per token, so fewer bytes per weight is
fewer milliseconds per token. ``_weight_int4pack_mm_for_cpu`` reads 4-bit
weights with one fp32 scale and zero per group of ``group_size`` input
features (asymmetric, as gpt-fast and llama.cpp's Q4_1 do). The int8
kernel is slower than fp32 on these CPUs (PERF-NOTES.md), so only int4.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

INNER_K_TILES = 2  # the CPU packer accepts 2, 4 or 8; it only changes the layout


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2], the CPU kernel's layout
    scales_and_zeros: torch.Tensor  # [K / group_size, N, 2] in the activation dtype
    group_size: int
    out_features: int


def supports(weight: torch.Tensor, group_size: int) -> bool:
    """The CPU kernel wants K a multiple of the group and of its tile width, N even."""
    n, k = weight.shape
    return k % group_size == 0 and k % (16 * INNER_K_TILES) == 0 and n % 2 == 0


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Round [N, K] weights to 16 levels spread over each group's [min, max]."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-6)
    q = ((groups - low) / scales).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    # The kernel computes (q - 8) * scale + zero, so the zero is the value of level 8.
    zeros = low + 8 * scales
    scales_and_zeros = torch.stack([scales.squeeze(-1), zeros.squeeze(-1)], dim=-1)  # [N, G, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    return Int4Weight(
        packed=packed,
        scales_and_zeros=scales_and_zeros.transpose(0, 1).contiguous().to(weight.dtype),
        group_size=group_size,
        out_features=n,
    )


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The [N, K] weights the kernel effectively multiplies by (for tests and error checks)."""
    k = w.packed.shape[1] * 2
    eye = torch.eye(k, dtype=w.scales_and_zeros.dtype)
    return int4_linear(eye, w).t().contiguous()


def linear(x: torch.Tensor, w: torch.Tensor | Int4Weight) -> torch.Tensor:
    """F.linear for either a plain weight or a packed one."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else int4_linear(x, w)


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N], like F.linear without bias."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w.packed, w.group_size, w.scales_and_zeros)
    return out.reshape(*x.shape[:-1], w.out_features)
