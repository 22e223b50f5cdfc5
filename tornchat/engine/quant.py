"""Weight-only int4, int8 and bf16 weights for CPU matmuls, with PyTorch's own kernels.

Decode reads every weight once per token, so fewer bytes per weight is
fewer milliseconds per token. ``_weight_int4pack_mm_for_cpu`` reads 4-bit
weights with one scale and zero per group of ``group_size`` input features
(asymmetric, as gpt-fast and llama.cpp's Q4_1 do); ``_weight_int8pack_mm``
reads int8 weights with one scale per output row. bf16 weights go through
oneDNN's prepacked linear where it runs (``cpu.packs_bf16``), else through
plain ``F.linear``.

The int4 and int8 kernels are fast only for some input dtypes, and which
depends on the CPU: on AVX2 and AVX-512 BF16 machines 10-28x faster with
bf16 inputs than fp32 ones (their fp32 path is a scalar loop), while on one
AVX-512 machine without bf16 the fp32 int4 path was the fast one
(PERF-NOTES.md). So the input dtype is a parameter, and packed weights
store their scales in it; ``engine/autotune.py`` picks it by timing.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tornchat.engine import cpu

INNER_K_TILES = 2  # the CPU packer accepts 2, 4 or 8; it only changes the layout


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2], the CPU kernel's layout
    scales_and_zeros: torch.Tensor  # [K / group_size, N, 2] in the dtype the kernel's inputs take (bf16 or fp32)
    group_size: int

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.scales_and_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


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


def quantize_int4(weight: torch.Tensor, group_size: int = 32, inputs: torch.dtype = torch.bfloat16) -> Int4Weight:
    """Pack [N, K] weights for the CPU kernel, to be fed inputs of dtype ``inputs``."""
    n, k = weight.shape
    q, scales, low = group_levels(weight, group_size)
    # The kernel computes (q - 8) * scale + zero, so the zero is the value of level 8.
    zeros = low + 8 * scales
    scales_and_zeros = torch.stack([scales.squeeze(-1), zeros.squeeze(-1)], dim=-1)  # [N, G, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), INNER_K_TILES)
    return Int4Weight(
        packed=packed,
        scales_and_zeros=scales_and_zeros.transpose(0, 1).contiguous().to(inputs),
        group_size=group_size,
    )


@dataclass
class Int8Weight:
    values: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N], in the dtype the kernel's inputs take

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(self.scales.dtype), self.values, self.scales)


def quantize_int8(weight: torch.Tensor, inputs: torch.dtype = torch.bfloat16) -> Int8Weight:
    """Symmetric int8 with one scale per output row, to be fed inputs of dtype ``inputs``."""
    scales = (weight.detach().float().abs().amax(dim=1) / 127).clamp(min=1e-12)
    values = (weight.detach().float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(values=values, scales=scales.to(inputs))


def fake_quantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """The plain weights int8 stands for (tests, quality checks)."""
    packed = quantize_int8(weight)
    return (packed.values.float() * packed.scales.float()[:, None]).to(weight.dtype)


@dataclass
class Bf16Weight:
    packed: torch.Tensor  # bf16, reordered once into oneDNN's blocked layout for one-row inputs

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [None], "")


def to_bf16(weight: torch.Tensor) -> torch.Tensor | Bf16Weight:
    """bf16 weights, reordered for oneDNN where it runs (2.2-3.5x faster than fp32 on an AMX CPU; plain bf16
    F.linear gained nothing there), else plain bf16: on AVX2 still 1.1-2.8x faster than fp32 on large shapes."""
    weight = weight.detach().to(torch.bfloat16)
    if not cpu.packs_bf16():
        return weight
    return Bf16Weight(packed=torch.ops.mkldnn._reorder_linear_weight(weight, 1))


Weight = torch.Tensor | Int4Weight | Int8Weight | Bf16Weight


def input_dtype(w: Weight) -> torch.dtype:
    """The dtype ``linear`` casts its input to for this weight."""
    if isinstance(w, torch.Tensor):
        return w.dtype
    if isinstance(w, Bf16Weight):
        return torch.bfloat16
    return w.scales_and_zeros.dtype if isinstance(w, Int4Weight) else w.scales.dtype


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [rows, K] @ W.T -> [rows, N] like F.linear without bias, for a plain weight or a packed one.

    The weight decides the dtype: x is cast to what its kernel takes, and
    the result comes back in that dtype (bf16 from bf16-fed weights), so
    that consecutive projections do not cast back and forth; the residual
    stream's additions promote to its dtype.
    """
    if isinstance(w, torch.Tensor):
        return F.linear(x.to(w.dtype), w)
    return w.mm(x)
