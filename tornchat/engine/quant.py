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

On CUDA, ``CudaInt4Weight`` holds the same group-wise asymmetric int4 for
``_weight_int4pack_mm`` (tinygemm, as gpt-fast uses), fed bf16 inputs.
"""
import functools
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tornchat.engine import cpu

INNER_K_TILES = 2  # the CPU packer accepts 2, 4 or 8; it only changes the layout


@dataclass(frozen=True)
class Int4Layout:
    """Where ``_convert_weight_to_int4pack_for_cpu`` puts each 4-bit level, which depends on the CPU's
    instruction set (AVX-512: blocks of 64 rows; AVX2 and plain C++: 32). Each block of ``rows`` rows is
    stored as [K, rows / 2] bytes; byte j holds rows j and j + rows / 2 (``halves``) or rows 2j and 2j + 1."""

    rows: int
    halves: bool

    def fits(self, n: int) -> bool:
        return n % self.rows == 0

    def pack(self, levels: torch.Tensor) -> torch.Tensor:
        """uint8 levels [N, K] -> the kernel's uint8 [N, K / 2]."""
        n, k = levels.shape
        blocks = levels.reshape(n // self.rows, self.rows, k).transpose(1, 2)  # [blocks, K, rows]
        if self.halves:
            low, high = blocks[..., : self.rows // 2], blocks[..., self.rows // 2 :]
        else:
            low, high = blocks[..., 0::2], blocks[..., 1::2]
        return (low | (high << 4)).reshape(n, k // 2).contiguous()

    def levels(self, packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's uint8 [N, K / 2] -> uint8 levels [N, K], or only the given rows' [len(rows), K]."""
        n, k = packed.shape[0], packed.shape[1] * 2
        blocks = packed.reshape(n // self.rows, k, self.rows // 2)
        if rows is None:
            pairs = torch.stack([blocks & 0xF, blocks >> 4], dim=-2 if self.halves else -1)  # [blocks, K, 2, rows/2]
            return pairs.reshape(n // self.rows, k, self.rows).transpose(1, 2).reshape(n, k)
        within = rows % self.rows
        byte = within % (self.rows // 2) if self.halves else within // 2
        shift = 4 * (within >= self.rows // 2) if self.halves else 4 * (within % 2)
        return (blocks[rows // self.rows, :, byte] >> shift[:, None].to(torch.uint8)) & 0xF


@functools.cache
def _native():
    """The C++ ops (csrc/fused.cpp) where built; imported late, since fused.py imports this module."""
    try:
        return importlib.import_module("tornchat.engine._fused")
    except ImportError:
        return None


@functools.cache
def _prefill():
    """The int8 prefill products (csrc/prefill.cpp, ``DynamicInt8Weight``) where built, else None."""
    try:
        return importlib.import_module("tornchat.engine._prefill")
    except ImportError:
        return None


@functools.cache
def int4_layout() -> Int4Layout | None:
    """This CPU's int4 layout, found by packing random levels with PyTorch's packer and comparing; None if
    no known layout matches (then weights are packed by PyTorch and prefill runs the int4 kernel)."""
    levels = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, INNER_K_TILES)
    for layout in (Int4Layout(64, True), Int4Layout(32, True), Int4Layout(32, False), Int4Layout(64, False)):
        if torch.equal(layout.pack(levels.to(torch.uint8)), packed):
            return layout
    return None


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2], the CPU kernel's layout
    scales_and_zeros: torch.Tensor  # [K / group_size, N, 2] in the dtype the kernel's inputs take (bf16 or fp32)
    group_size: int
    vnni: bool = False  # multiplied on int8 activations by csrc/gemv.cpp (``on_vnni``), fed fp32

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            return _native().vnni_int4_mm(x, self.packed, self.scales_and_zeros)
        x = x.to(self.scales_and_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None,
                   into: torch.Tensor | None = None) -> torch.Tensor | None:
        """The weights [N, K] (or only ``rows``) as the kernel computes them: (level - 8) * scale + zero.
        None where this CPU's layout is not known. The C++ path writes them as [K, N] (``into``, a buffer to
        reuse, else a new tensor) and returns its transposed view."""
        layout = int4_layout()
        if layout is None or not layout.fits(self.packed.shape[0]):
            return None
        native = _native()
        if rows is None and native is not None and dtype in (torch.float32, torch.bfloat16):
            return native.dequantize_int4(self.packed, self.scales_and_zeros, self.group_size, layout.rows,
                                          layout.halves, dtype == torch.bfloat16, into)
        return self.dequantize_reference(dtype, rows, layout)

    def dequantize_reference(self, dtype: torch.dtype, rows: torch.Tensor | None, layout: "Int4Layout") -> torch.Tensor:
        """``dequantize`` in PyTorch ops: the semantics csrc/fused.cpp's dequantize_int4 is held to."""
        levels = layout.levels(self.packed, rows)
        scales, zeros = self.scales_and_zeros.to(dtype).permute(2, 1, 0)  # [N, G] each
        if rows is not None:
            scales, zeros = scales[rows], zeros[rows]
        n, k = levels.shape
        grouped = (levels.reshape(n, -1, self.group_size).to(dtype) - 8) * scales[..., None] + zeros[..., None]
        return grouped.reshape(n, k)


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
    return pack_int4(q.reshape(n, k), scales.reshape(n, -1), low.reshape(n, -1), inputs)


def pack_int4(levels: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor, inputs: torch.dtype) -> Int4Weight:
    """Levels [N, K] in 0..15 with, per group, value = level * scale + low (scales, lows [N, K / group])."""
    n = levels.shape[0]
    layout = int4_layout()
    if layout is not None and layout.fits(n):
        packed = layout.pack(levels.to(torch.uint8))
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), INNER_K_TILES)
    return int4_weight(packed, scales, lows, inputs)


def int4_weight(packed: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor, inputs: torch.dtype) -> Int4Weight:
    """Packed levels [N, K / 2] in the kernel's layout, with per group value = level * scale + low."""
    # The kernel computes (q - 8) * scale + zero, so the zero is the value of level 8.
    scales_and_zeros = torch.stack([scales, lows + 8 * scales], dim=-1)  # [N, G, 2]
    group_size = packed.shape[1] * 2 // scales.shape[1]
    return Int4Weight(packed=packed, scales_and_zeros=scales_and_zeros.transpose(0, 1).contiguous().to(inputs),
                      group_size=group_size)


def stack_rows(weights: list["Weight"]) -> "Weight":
    """int4 or int8 weights (of one kind) stacked by rows, as if packed as one matrix: int4 blocks of rows in
    this CPU's layout (``Int4Layout``, each part a whole number of blocks) and int8 rows are independent."""
    if len(weights) == 1:
        return weights[0]
    if isinstance(weights[0], Int4Weight):
        return Int4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scales_and_zeros for w in weights], dim=1),
                          weights[0].group_size)
    return Int8Weight(torch.cat([w.values for w in weights]), torch.cat([w.scales for w in weights]))


@dataclass
class Int8Weight:
    values: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N], in the dtype the kernel's inputs take
    vnni: bool = False  # as Int4Weight's

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            return _native().vnni_int8_mm(x, self.values, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x.to(self.scales.dtype), self.values, self.scales)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        values, scales = (self.values, self.scales) if rows is None else (self.values[rows], self.scales[rows])
        return values.to(dtype) * scales.to(dtype)[:, None]


INT8_ROWS = 4096  # rows quantized at a time: the fp32 temporaries of a 49,152-row embedding stay small


def quantize_int8(weight: torch.Tensor, inputs: torch.dtype = torch.bfloat16) -> Int8Weight:
    """Symmetric int8 with one scale per output row, to be fed inputs of dtype ``inputs``."""
    values = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], INT8_ROWS):
        rows = weight[start : start + INT8_ROWS].detach().float()
        row_scales = (rows.abs().amax(dim=1) / 127).clamp(min=1e-12)
        values[start : start + INT8_ROWS] = (rows / row_scales[:, None]).round().clamp(-127, 127)
        scales[start : start + INT8_ROWS] = row_scales
    return Int8Weight(values=values, scales=scales.to(inputs))


def fake_quantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """The plain weights int8 stands for (tests, quality checks)."""
    packed = quantize_int8(weight)
    return (packed.values.float() * packed.scales.float()[:, None]).to(weight.dtype)


@dataclass
class Bf16Weight:
    packed: torch.Tensor  # bf16, reordered once into oneDNN's blocked layout for one-row inputs
    shape: tuple[int, int]  # [N, K] before reordering

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [None], "")


def to_bf16(weight: torch.Tensor) -> torch.Tensor | Bf16Weight:
    """bf16 weights, reordered for oneDNN where it runs (2.2-3.5x faster than fp32 on an AMX CPU; plain bf16
    F.linear gained nothing there), else plain bf16: on AVX2 still 1.1-2.8x faster than fp32 on large shapes."""
    weight = weight.detach().to(torch.bfloat16)
    if not cpu.packs_bf16():
        return weight
    return Bf16Weight(packed=torch.ops.mkldnn._reorder_linear_weight(weight, 1), shape=tuple(weight.shape))


@dataclass
class DynamicInt8Weight:
    """An int4 or int8 matrix as a prefill chunk multiplies it, in int8 (csrc/prefill.cpp): each row of x
    quantized to int8 with its own scale (max |x| / 127, symmetric) but for the chunk's 16 columns of largest
    magnitude, the weights with one scale per output row (int8 ones as they are; int4 ones over the largest value
    their groups' scales and zeros let the row hold, / 127); out = (acc * x_scale[row] + x[:, outliers] @
    Wq[:, outliers].T) * w_scale[column] in bf16, acc the int32 products (``torch._int_mm``), the outlier
    columns' in fp32 (without them the embedded model's greedy agreement over 1,536 tokens was 0.971, with them
    0.996).

    A prefill chunk is bound by arithmetic, and int8 products ran 1.3-1.9 TOPS where bf16 ones peaked at ~890
    GFLOP/s (Zen 5, AVX-512 VNNI and BF16, no AMX). Nothing is kept beside the packed weights: each product
    converts its int4 weights a block of columns at a time, into ``scratch``."""

    weight: Int4Weight | Int8Weight
    scratch: torch.Tensor  # uint8, grown by the C++ as a product needs and reused by the next one

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, Int8Weight):
            return _prefill().int8_linear(x, w.values, w.scales, True, self.scratch)
        layout = int4_layout()
        return _prefill().int4_linear(x, w.packed, w.scales_and_zeros, w.group_size, layout.rows, layout.halves, True,
                                      self.scratch)


def dynamic_int8(w: "Weight", scratch: torch.Tensor) -> DynamicInt8Weight | None:
    """w multiplied in int8 for a prefill chunk (``DynamicInt8Weight``), or None where it cannot be: the C++ not
    built, weights neither int4 nor int8, or int4 ones in a layout this CPU does not have."""
    if _prefill() is None:
        return None
    if isinstance(w, Int8Weight):
        return DynamicInt8Weight(w, scratch)
    layout = int4_layout()
    if isinstance(w, Int4Weight) and layout is not None and layout.fits(w.packed.shape[0]):
        return DynamicInt8Weight(w, scratch)
    return None


@dataclass
class CudaInt4Weight:
    packed: torch.Tensor  # int32, tinygemm's tiled layout of [N, K] levels
    scales_and_zeros: torch.Tensor  # bf16 [K / group_size, N, 2]: value = (level - 8) * scale + zero
    group_size: int

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), self.packed, self.group_size,
                                                  self.scales_and_zeros)


CUDA_GROUPS = (32, 64, 128, 256)  # the group sizes tinygemm takes
# What --quantize int4 packs plain weights into on CUDA: an 8B step was 1.11x faster than with group 32
# (bench/gpu.py, H100); the quality gate of auto still applies.
CUDA_GROUP = 128


def cuda_k_tiles(k: int) -> int | None:
    """tinygemm's inner K tiles for K input features (the widest of 8, 4, 2 that divides), None if none does."""
    return next((tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0), None)


def cuda_int4_weight(levels: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> CudaInt4Weight:
    """Levels [N, K] in 0..15 on a CUDA device, with per group value = level * scale + low (scales, lows
    [N, K / group]), packed for tinygemm."""
    n, k = levels.shape
    pairs = levels.to(torch.uint8).reshape(n, k // 2, 2)
    packed = torch.ops.aten._convert_weight_to_int4pack((pairs[..., 0] << 4) | pairs[..., 1], cuda_k_tiles(k))
    zeros = lows + 8 * scales  # the kernel computes (level - 8) * scale + zero, as the CPU one does
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return CudaInt4Weight(packed, scales_and_zeros, k // scales.shape[1])


def cuda_supports(weight: torch.Tensor, group_size: int) -> bool:
    n, k = weight.shape
    return group_size in CUDA_GROUPS and k % group_size == 0 and cuda_k_tiles(k) is not None and n % 8 == 0


def quantize_int4_cuda(weight: torch.Tensor, group_size: int = 32) -> CudaInt4Weight:
    """[N, K] weights on a CUDA device as tinygemm int4, levels spread over each group's range as on the CPU."""
    n, k = weight.shape
    q, scales, low = group_levels(weight, group_size)
    return cuda_int4_weight(q.reshape(n, k), scales.reshape(n, -1), low.reshape(n, -1))


Weight = torch.Tensor | Int4Weight | Int8Weight | Bf16Weight | CudaInt4Weight | DynamicInt8Weight


def shape(w: Weight) -> tuple[int, int]:
    """[N, K]: output and input features."""
    if isinstance(w, DynamicInt8Weight):
        return shape(w.weight)
    if isinstance(w, Int4Weight):
        return w.packed.shape[0], w.packed.shape[1] * 2
    if isinstance(w, CudaInt4Weight):
        return w.scales_and_zeros.shape[1], w.scales_and_zeros.shape[0] * w.group_size
    if isinstance(w, Int8Weight):
        return tuple(w.values.shape)
    return tuple(w.shape)


def input_dtype(w: Weight) -> torch.dtype:
    """The dtype ``linear`` casts its input to for this weight."""
    if isinstance(w, torch.Tensor):
        return w.dtype
    if isinstance(w, DynamicInt8Weight):  # quantized per row inside the product: fp32 keeps the most of it
        return torch.float32
    if getattr(w, "vnni", False):  # quantized to int8 from fp32 inside the kernel
        return torch.float32
    if isinstance(w, Bf16Weight | CudaInt4Weight):
        return torch.bfloat16
    return w.scales_and_zeros.dtype if isinstance(w, Int4Weight) else w.scales.dtype


def dequantize(w: Weight, dtype: torch.dtype, rows: torch.Tensor | None = None,
               into: torch.Tensor | None = None) -> torch.Tensor | None:
    """The plain weights [N, K] (or only ``rows``) in ``dtype`` that w computes with; None for layouts that
    cannot be read back here (oneDNN's packed bf16, tinygemm's int4, an int4 layout this CPU does not have).
    ``into``: a [K, N] buffer packed int4 weights may be written into (``Int4Weight.dequantize``)."""
    if isinstance(w, torch.Tensor):
        return (w if rows is None else w[rows]).to(dtype)
    if isinstance(w, Bf16Weight | CudaInt4Weight):
        return None
    if isinstance(w, Int4Weight):
        return w.dequantize(dtype, rows, into)
    return w.dequantize(dtype, rows)


def narrowed(w: Weight, inputs: torch.dtype, group_size: int = 32) -> Weight:
    """int8 weights rounded onto int4 groups (from their values: half an int8 step off at most), fed inputs of
    dtype ``inputs``; other weights as they are, fed ``inputs``."""
    if isinstance(w, Int8Weight) and supports(w.values, group_size):
        return quantize_int4(w.dequantize(torch.float32), group_size, inputs)
    return fed(w, inputs)


def fed(w: Weight, inputs: torch.dtype) -> Weight:
    """The same int4 or int8 weights fed inputs of another dtype (their scales cast); others as they are."""
    if isinstance(w, Int4Weight):
        return Int4Weight(w.packed, w.scales_and_zeros.to(inputs), w.group_size)
    if isinstance(w, Int8Weight):
        return Int8Weight(w.values, w.scales.to(inputs))
    return w


def vnni_runs() -> bool:
    """Whether csrc/gemv.cpp's kernels are built and this CPU runs them (AVX-512 VNNI and VBMI)."""
    native = _native()
    return native is not None and native.vnni_supported()


def on_vnni(w: Weight) -> Weight:
    """w multiplied by csrc/gemv.cpp's kernels on int8 activations, where they take its shape and layout (int4:
    PyTorch's AVX-512 layout, group 32, bf16 scales; int8: K a multiple of 64); else w as it is. On a Zen 5
    core pair the int4 kernel read a 1B model's matrices at 45-47 GB/s from memory (PyTorch's: 39-40, the
    memory's limit ~48) and 1.6-2x PyTorch's speed from the CPU's cache."""
    if not vnni_runs():
        return w
    if isinstance(w, Int4Weight) and w.group_size == 32 and w.scales_and_zeros.dtype == torch.bfloat16 \
            and int4_layout() == Int4Layout(64, True) and w.packed.shape[0] % 64 == 0:
        return Int4Weight(w.packed, w.scales_and_zeros, w.group_size, vnni=True)
    if isinstance(w, Int8Weight) and w.values.shape[1] % 64 == 0:
        return Int8Weight(w.values, w.scales, vnni=True)
    return w


def quantize_activations_reference(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] as csrc/gemv.cpp quantizes it: per group of 32 features, int8 levels
    round-half-even(x * 127 / max |x|) (0 where the group is all 0) and the scale max |x| / 127;
    (levels [rows, K / 32, 32] as float, scales [rows, K / 32, 1])."""
    groups = x.float().reshape(x.shape[0], -1, group)
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    return torch.round(groups * inverse).clamp(-127, 127), largest / 127


def vnni_reference(x: torch.Tensor, w: "Int4Weight | Int8Weight") -> torch.Tensor:
    """What ``on_vnni`` weights compute for x [rows, K], in float64 (the kernel's fp32 sums differ from it by
    rounding only): the levels of x (``quantize_activations_reference``) times w's, per group, then scaled.
    int4: value = level * scale + (zero - 8 * scale); int8: value = w * scale of its row."""
    levels, scales = quantize_activations_reference(x)
    levels, scales = levels.double(), scales[..., 0].double()  # [rows, G, 32], [rows, G]
    if isinstance(w, Int4Weight):
        weight_levels = int4_layout().levels(w.packed).double()
        n = weight_levels.shape[0]
        dots = torch.einsum("ngk,rgk->rng", weight_levels.reshape(n, -1, 32), levels)
        sz = w.scales_and_zeros.double()  # [G, N, 2]
        scale, zero = sz[..., 0].T, sz[..., 1].T  # [N, G]
        per_group = scale * dots + (zero - 8 * scale) * levels.sum(-1)[:, None, :]
        return (per_group * scales[:, None, :]).sum(-1)
    values = w.values.double().reshape(w.values.shape[0], -1, 32)
    dots = torch.einsum("ngk,rgk->rng", values, levels)
    return (dots * scales[:, None, :]).sum(-1) * w.scales.double()[None]


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
