"""Weight-only int4 and bf16 weights for CPU matmuls, with PyTorch's own kernels.

Decode reads every weight once per token, so fewer bytes per weight is
fewer milliseconds per token. ``_weight_int4pack_mm_for_cpu`` reads 4-bit
weights with one fp32 scale and zero per group of ``group_size`` input
features (asymmetric, as gpt-fast and llama.cpp's Q4_1 do). bf16 weights
go through oneDNN's prepacked linear, which uses AVX-512 BF16 or AMX where
the CPU has them. The int8 kernel is slower than fp32 on these CPUs
(PERF-NOTES.md). Which format pays depends on the CPU (bench/decode_speed.py).
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


def group_levels(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels 0..15 spread over each group's [min, max]: (q [N, G, group], scales, lows [N, G, 1])."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-6)
    q = ((groups - low) / scales).round().clamp(0, 15)
    return q, scales, low


def fake_quantize_int4(weight: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """The plain weights int4 stands for: int4 numerics with any fp32 code (tests, quality checks)."""
    q, scales, low = group_levels(weight, group_size)
    return (q * scales + low).reshape(weight.shape).to(weight.dtype)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Pack [N, K] weights for the CPU kernel."""
    n, k = weight.shape
    q, scales, low = group_levels(weight, group_size)
    # The kernel computes (q - 8) * scale + zero, so the zero is the value of level 8.
    zeros = low + 8 * scales
    scales_and_zeros = torch.stack([scales.squeeze(-1), zeros.squeeze(-1)], dim=-1)  # [N, G, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), INNER_K_TILES)
    return Int4Weight(
        packed=packed,
        scales_and_zeros=scales_and_zeros.transpose(0, 1).contiguous().to(weight.dtype),
        group_size=group_size,
        out_features=n,
    )


@dataclass
class Bf16Weight:
    packed: torch.Tensor  # bf16, reordered once into oneDNN's blocked layout for one-row inputs


def packs_bf16() -> bool:
    return torch.backends.mkldnn.is_available()


def pack_bf16(weight: torch.Tensor) -> Bf16Weight:
    """Plain bf16 F.linear gained nothing on one row; reordered once, bf16 weights read 2.2-3.5x faster than fp32 (AMX CPU)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), 1)
    return Bf16Weight(packed=packed)


def linear(x: torch.Tensor, w: torch.Tensor | Int4Weight | Bf16Weight) -> torch.Tensor:
    """F.linear for a plain weight or a packed one; packed weights are weight-only: x keeps its dtype."""
    if isinstance(w, Int4Weight):
        return int4_linear(x, w)
    if isinstance(w, Bf16Weight):
        out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), w.packed, None, "none", [None], "")
        return out.to(x.dtype)
    return F.linear(x, w)


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N], like F.linear without bias."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w.packed, w.group_size, w.scales_and_zeros)
    return out.reshape(*x.shape[:-1], w.out_features)
