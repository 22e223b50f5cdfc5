"""Weights as the matrix kernels read them.

On the CPU every matrix is a ``BlockWeight``: GGML blocks, as a GGUF file
stores them (memory-mapped, used in place) or as a float checkpoint is
quantized into at load (``to_blocks``). csrc/blocks/ multiplies them on
activations quantized per block of 32 to int8, with exact integer dot
products per block and fp32 sums in a fixed order, so a row gets the same
bits whatever other rows share the call: a decode step, a speculative
verify and a prefill chunk agree (``tornchat.engine.blocks``).

On CUDA, plain tensors (F.linear) or ``CudaInt4Weight``: group-wise
asymmetric int4 for ``_weight_int4pack_mm`` (tinygemm, as gpt-fast uses),
fed bf16 inputs.
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tornchat.engine import blocks
from tornchat.engine import ggml

# What --quantize packs float weights into on the CPU: GGML types csrc/blocks/ multiplies. The output
# projection stays at 8 bits under int4, as llama.cpp's 4-bit files keep it at 6 or 8: it is where 4 bits
# cost the most perplexity (docs/performance.md, "Figures behind the code's choices").
BLOCK_TYPES = {"none": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1"}
HEAD_TYPES = BLOCK_TYPES | {"int4": "Q8_0"}


@dataclass(frozen=True, eq=False)  # identity: comparing would compare tensors
class BlockWeight:
    """A matrix [N, K] as GGML blocks: ``parts`` stacked by rows, each uint8 [N_i, row_bytes] of type
    ``types[i]`` (Q4_K_M files store some layers' value projection as Q6_K beside 4-bit queries and keys)."""

    parts: tuple[torch.Tensor, ...]
    types: tuple[str, ...]

    def mm(self, x: torch.Tensor, isa: str = "") -> torch.Tensor:
        """x [rows, K] @ W.T in fp32 by csrc/blocks/, on instruction-set path ``isa`` (default: the best)."""
        return blocks.mm(x, list(self.parts), [blocks.TYPE_IDS[t] for t in self.types], isa)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), ggml.cols(self.parts[0], self.types[0])

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The values [N, K] the blocks hold (or only ``rows``), as llama.cpp decodes them."""
        if rows is None:
            return torch.cat([_values(p, t) for p, t in zip(self.parts, self.types)]).to(dtype)
        where = rows.cpu()
        if len(self.parts) == 1:  # an embedding's usual case: no part to find for each row (20 us a decode step)
            return _values(self.parts[0][where].contiguous(), self.types[0]).to(device=rows.device, dtype=dtype)
        starts = np.cumsum([0] + [p.shape[0] for p in self.parts])
        out = torch.empty(len(where), self.shape[1], dtype=torch.float32)
        for i, (part, type_name) in enumerate(zip(self.parts, self.types)):
            inside = (where >= int(starts[i])) & (where < int(starts[i + 1]))
            if inside.any():
                out[inside] = _values(part[where[inside] - int(starts[i])].contiguous(), type_name)
        return out.to(device=rows.device, dtype=dtype)


def _values(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """``ggml.values``, a grouped layout's from the file's (one C++ pass, not ggml.ungroup's torch operations)."""
    return ggml.values(*blocks.ungroup(raw, type_name))


def to_blocks(weight: torch.Tensor, quantize: str, head: bool = False, isa: str = "") -> BlockWeight:
    """Float weights [N, K] in the GGML type ``BLOCK_TYPES[quantize]`` (``HEAD_TYPES`` for the output
    projection), with gguf's own quantizers; a K that is not a whole number of blocks stays F32. In the layout
    path ``isa`` reads (``blocks.group``), the panel layout too except for the head, whose rows a tied embedding
    reads."""
    type_name = (HEAD_TYPES if head else BLOCK_TYPES)[quantize]
    if type_name.startswith("Q") and weight.shape[1] % 32:
        type_name = "F32"
    values = weight.detach().float().cpu()
    if type_name == "F32":
        return BlockWeight((values.contiguous().view(torch.uint8),), ("F32",))
    if type_name == "BF16":
        return BlockWeight((values.to(torch.bfloat16).contiguous().view(torch.uint8),), ("BF16",))
    from gguf import GGMLQuantizationType, quants

    raw = torch.from_numpy(np.ascontiguousarray(quants.quantize(values.numpy(), GGMLQuantizationType[type_name])))
    return BlockWeight((raw,), (blocks.group(raw, type_name, isa, panels=not head),))


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


@dataclass
class CudaInt4Weight:
    packed: torch.Tensor  # int32, tinygemm's tiled layout of [N, K] levels
    scales_and_zeros: torch.Tensor  # bf16 [K / group_size, N, 2]: value = (level - 8) * scale + zero
    group_size: int

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), self.packed, self.group_size,
                                                  self.scales_and_zeros)


CUDA_GROUPS = (32, 64, 128, 256)  # the group sizes tinygemm takes
# What --quantize int4 packs plain weights into on CUDA: larger groups read fewer scales per step, and 128
# decoded fastest (docs/performance.md); the quality gate of auto still applies.
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


Weight = torch.Tensor | BlockWeight | CudaInt4Weight


def shape(w: Weight) -> tuple[int, int]:
    """[N, K]: output and input features."""
    if isinstance(w, CudaInt4Weight):
        return w.scales_and_zeros.shape[1], w.scales_and_zeros.shape[0] * w.group_size
    return tuple(w.shape)


def input_dtype(w: Weight) -> torch.dtype:
    """The dtype ``linear`` casts its input to for this weight."""
    if isinstance(w, torch.Tensor):
        return w.dtype
    return torch.bfloat16 if isinstance(w, CudaInt4Weight) else torch.float32


def dequantize(w: Weight, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """The plain weights [N, K] (or only ``rows``) in ``dtype`` that w computes with; None for tinygemm's
    layout, which cannot be read back here."""
    if isinstance(w, torch.Tensor):
        return (w if rows is None else w[rows]).to(dtype)
    if isinstance(w, CudaInt4Weight):
        return None
    return w.dequantize(dtype, rows)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [rows, K] @ W.T -> [rows, N] like F.linear without bias, for a plain weight or a packed one.
    Plain weights take x in their dtype; block weights return fp32, tinygemm bf16."""
    if isinstance(w, torch.Tensor):
        return F.linear(x.to(w.dtype), w)
    return w.mm(x)
