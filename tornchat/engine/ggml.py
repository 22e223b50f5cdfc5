"""What each GGML block type holds, decoded with torch into fp32 values.

Layouts as llama.cpp's ggml-common.h defines them (read there, written
here). A quantized tensor of N rows and K columns is N * K / block_size
blocks, row after row; ``raw`` is its bytes as a uint8 tensor [N, row_bytes].
The matrix kernels compute on these bytes as they are (csrc/blocks/);
decoded values are for the rows of an embedding a prompt looks up, the
kernels' reference, and float copies where one is asked for.

These functions are the references. ``csrc/ggml.cpp`` does the same in
one pass over the bytes (``values`` uses it where it is built); the tests
hold it to these, bit for bit.
"""
import importlib
from dataclasses import dataclass

import torch


def _load():
    try:
        return importlib.import_module("tornchat.engine._ggml")
    except ImportError:
        return None


_native = _load()  # the compiled module, or None


@dataclass(frozen=True)
class BlockType:
    name: str
    values: int  # per block
    bytes: int  # per block


TYPES = {t.name: t for t in [
    BlockType("F32", 1, 4), BlockType("F16", 1, 2), BlockType("BF16", 1, 2),
    BlockType("Q4_0", 32, 18), BlockType("Q4_1", 32, 20), BlockType("Q5_0", 32, 22), BlockType("Q5_1", 32, 24),
    BlockType("Q8_0", 32, 34), BlockType("Q4_K", 256, 144), BlockType("Q5_K", 256, 176), BlockType("Q6_K", 256, 210),
    BlockType("Q4_0_G8", 32, 18), BlockType("Q4_1_G8", 32, 20), BlockType("Q8_0_G8", 32, 34),
    BlockType("Q4_K_G8", 256, 144), BlockType("Q6_K_G8", 256, 210),
    BlockType("Q4_0_P16", 32, 18), BlockType("Q4_1_P16", 32, 20), BlockType("Q8_0_P16", 32, 34),
]}
# Our grouped layouts (``group``) and panel layouts (``panel``), and the file's types they rearrange.
GROUPED = {"Q4_0_G8": "Q4_0", "Q4_1_G8": "Q4_1", "Q8_0_G8": "Q8_0", "Q4_K_G8": "Q4_K", "Q6_K_G8": "Q6_K",
           "Q4_0_P16": "Q4_0", "Q4_1_P16": "Q4_1", "Q8_0_P16": "Q8_0"}
PANELED = ("Q4_0_P16", "Q4_1_P16", "Q8_0_P16")
INT4 = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit levels with, per group of 32 values, value = level * scale + low
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 number at byte offset ``at`` of every block, as fp32 [..., 1]."""
    return raw[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] levels: low nibbles are values 0-15, high nibbles 16-31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bits 0..count-1 of little-endian bytes [..., count / 8] -> [..., count] of 0 or 1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], count)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per 256-value block."""
    low, high = scales[..., 0:4], scales[..., 4:8]
    extra = scales[..., 8:12]
    sc = torch.cat([low & 63, (extra & 0xF) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([high & 63, (extra >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: 128 bytes -> 256 levels; each 32 bytes hold two sub-blocks (low nibbles, then high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([chunks & 0xF, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], 256)


def _blocks(raw: torch.Tensor, block: BlockType) -> torch.Tensor:
    return raw.reshape(raw.shape[0], -1, block.bytes)


def int4_levels(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0, Q4_1, Q4_K -> (levels uint8 [N, K] in 0..15, scales [N, K / 32], lows [N, K / 32]), fp32,
    with value = level * scale + low exactly as llama.cpp computes it."""
    blocks = _blocks(raw, TYPES[type_name])
    n = raw.shape[0]
    if type_name == "Q4_K":
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mins = _k_scales(blocks[..., 4:16])
        levels = _k_nibbles(blocks[..., 16:144])
        return levels.reshape(n, -1), (d * sc).reshape(n, -1), (-dmin * mins).reshape(n, -1)
    d = _f16(blocks, 0)[..., 0]
    if type_name == "Q4_0":
        return _nibbles(blocks[..., 2:18]).reshape(n, -1), d, -8 * d
    if type_name == "Q4_1":
        return _nibbles(blocks[..., 4:20]).reshape(n, -1), d, _f16(blocks, 2)[..., 0]
    raise ValueError(f"{type_name} is not a 4-bit group-32 type")


def group(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """Q4_0, Q4_1, Q8_0, Q4_K or Q6_K rows [N, row_bytes] in our grouped layout (type ``type_name + "_G8"``): the
    same bytes per row and the same values, each whole group of 8 blocks rearranged as the 8 blocks' fp16 d, then (Q4_1)
    their fp16 minimums, then the levels by step of 4 features (Q4: 4 steps of the nibble bytes 4t..4t+3, each
    byte holding features 4t.. and 16 + 4t..; Q8_0: 8 steps of bytes 4t..4t+3), block j's 4 bytes at 4j: the
    layout the avx2 kernels take their steps in (csrc/blocks.h). A row's short last group of nj blocks: their nj
    fp16 d, (Q4_1) their minimums, then each block's levels as the file has them. Q4_K: each super-block's 16
    bytes of scales as they are, then its 8 sub-blocks' levels in the Q4 types' 4 steps. Q6_K: the low 4 bits of
    its 8 blocks' levels in those steps, then per block j a dword of the high 2 bits of features 4t.. at 128 + 4j
    and one of 16 + 4t.. at 160 + 4j (step t's at bit 2t of each byte), then its scales and d as they are."""
    return _regroup(raw, type_name, to_grouped=True)


def ungroup(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """A grouped or paneled type's rows (``group``, ``panel``) as the file stores them, in its type
    ``GROUPED[type_name]``."""
    if type_name in PANELED:
        return _repanel(raw, GROUPED[type_name], to_panels=False)
    return _regroup(raw, GROUPED[type_name], to_grouped=False)


def panel(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """Q4_0, Q4_1 or Q8_0 rows [N, row_bytes], N a multiple of 16, in our panel layout (type ``type_name +
    "_P16"``, csrc/blocks.h): the same bytes and values, every 16 rows' blocks together, a slot of 16 blocks'
    bytes per block index b, in the order b = 0, 8, 16, .., 1, 9, .. (lane j's blocks j, j + 8, ..): the 16 rows'
    fp16 d, (Q4_1) their fp16 minimums, then per 4-byte word w of a block's levels (Q4: 4, Q8_0: 8) the 16 rows'
    words, row i's at 4i."""
    if type_name not in ("Q4_0", "Q4_1", "Q8_0"):
        raise ValueError(f"the panel layout is Q4_0's, Q4_1's and Q8_0's, not {type_name}'s")
    if raw.shape[0] % 16:
        raise ValueError(f"the panel layout takes rows in slabs of 16, not {raw.shape[0]}")
    return _repanel(raw, type_name, to_panels=True)


def _repanel(raw: torch.Tensor, type_name: str, to_panels: bool) -> torch.Tensor:
    block = TYPES[type_name].bytes
    head = 4 if type_name == "Q4_1" else 2
    words = (block - head) // 4
    n, row_bytes = raw.shape
    slabs, nb = n // 16, row_bytes // block
    order = torch.tensor([b for j in range(8) for b in range(j, nb, 8)])
    if to_panels:
        by_slot = raw.reshape(slabs, 16, nb, block)[:, :, order]  # [slab, row, slot, bytes]
        fields = [by_slot[..., 2 * f : 2 * f + 2].transpose(1, 2).reshape(slabs, nb, 32) for f in range(head // 2)]
        levels = by_slot[..., head:].reshape(slabs, 16, nb, words, 4).permute(0, 2, 3, 1, 4)
        return torch.cat([*fields, levels.reshape(slabs, nb, 64 * words)], dim=-1).reshape(n, row_bytes)
    slots = raw.reshape(slabs, nb, 16 * block)
    fields = [slots[..., 32 * f : 32 * f + 32].reshape(slabs, nb, 16, 2).transpose(1, 2) for f in range(head // 2)]
    levels = slots[..., 16 * head :].reshape(slabs, nb, words, 16, 4).permute(0, 3, 1, 2, 4)
    by_slot = torch.cat([*fields, levels.reshape(slabs, 16, nb, 4 * words)], dim=-1)
    return by_slot[:, :, torch.argsort(order)].reshape(n, row_bytes)


def _regroup(raw: torch.Tensor, type_name: str, to_grouped: bool) -> torch.Tensor:
    if type_name == "Q4_K":
        return _regroup_q4k(raw, to_grouped)
    if type_name == "Q6_K":
        return _regroup_q6k(raw, to_grouped)
    block = TYPES[type_name]
    head, levels = (4 if type_name == "Q4_1" else 2), block.bytes - (4 if type_name == "Q4_1" else 2)
    n, blocks = raw.shape[0], raw.shape[1] // block.bytes
    whole = blocks // 8 * 8 * block.bytes
    groups, tail = raw[:, :whole].reshape(n, -1, 8 * block.bytes), raw[:, whole:].reshape(n, blocks % 8, block.bytes)
    nj = blocks % 8
    if to_grouped:  # per group: [field][block][2 bytes], then [step][block][4 bytes] (a short group: [block][levels])
        by_block = groups.reshape(n, -1, 8, block.bytes)
        scales = by_block[..., :head].reshape(n, -1, 8, head // 2, 2).transpose(2, 3)
        steps = by_block[..., head:].reshape(n, -1, 8, levels // 4, 4).transpose(2, 3)
        grouped = torch.cat([scales.reshape(n, -1, 8 * head), steps.reshape(n, -1, 8 * levels)], dim=-1)
        short = torch.cat([tail[..., :head].reshape(n, nj, head // 2, 2).transpose(1, 2).reshape(n, -1),
                           tail[..., head:].reshape(n, -1)], dim=-1)
    else:  # per block: [field][2 bytes], then its levels
        scales = groups[..., : 8 * head].reshape(n, -1, head // 2, 8, 2).transpose(2, 3)
        steps = groups[..., 8 * head :].reshape(n, -1, levels // 4, 8, 4).transpose(2, 3)
        grouped = torch.cat([scales.reshape(n, -1, 8, head), steps.reshape(n, -1, 8, levels)], dim=-1)
        flat = tail.reshape(n, -1)
        short = torch.cat([flat[:, : nj * head].reshape(n, head // 2, nj, 2).transpose(1, 2).reshape(n, nj, head),
                           flat[:, nj * head :].reshape(n, nj, levels)], dim=-1)
    return torch.cat([grouped.reshape(n, whole), short.reshape(n, -1)], dim=1)


def _regroup_q4k(raw: torch.Tensor, to_grouped: bool) -> torch.Tensor:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 144)
    scales, qs = blocks[..., :16], blocks[..., 16:]
    if to_grouped:  # levels [sub-block j][half h][step t][byte b] -> bytes [t][j][b], half h in nibble h
        levels = _k_nibbles(qs).reshape(n, -1, 8, 2, 4, 4).permute(0, 1, 4, 2, 3, 5)  # [n, sb, t, j, h, b]
        packed = levels[..., 0, :] | (levels[..., 1, :] << 4)
    else:  # bytes [t][j][b] -> levels of sub-block j, feature 16h + 4t + b -> the file's 32-byte chunks
        steps = qs.reshape(n, -1, 4, 8, 4)
        halves = torch.stack([steps & 0xF, steps >> 4], dim=-2)  # [n, sb, t, j, h, b]
        levels = halves.permute(0, 1, 3, 4, 2, 5).reshape(n, -1, 4, 2, 32)  # [n, sb, chunk, j % 2, feature]
        packed = levels[..., 0, :] | (levels[..., 1, :] << 4)
    return torch.cat([scales, packed.reshape(n, -1, 128)], dim=-1).reshape(n, -1)


def _regroup_q6k(raw: torch.Tensor, to_grouped: bool) -> torch.Tensor:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 210)
    if to_grouped:  # levels [j][u][t][b] (block j = 4 half + 2 nibble + part, feature 16u + 4t + b)
        ql = blocks[..., 0:128].reshape(n, -1, 2, 2, 32)  # [half, part, l]
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
        shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8, device=raw.device)[..., None]  # [nibble, part, 1]
        levels = torch.stack([ql & 0xF, ql >> 4], dim=-3) | (((qh[..., None, :, :] >> shifts) & 3) << 4)
        levels = levels.reshape(n, -1, 8, 2, 4, 4)
        low = (levels & 0xF).permute(0, 1, 4, 2, 5, 3)  # [n, sb, t, j, b, u]
        steps = low[..., 0] | (low[..., 1] << 4)
        high = (levels >> 4).permute(0, 1, 3, 2, 5, 4)  # [n, sb, u, j, b, t]
        bits = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
        return torch.cat([steps.reshape(n, -1, 128), bits.reshape(n, -1, 64), blocks[..., 192:]], dim=-1).reshape(n, -1)
    steps = blocks[..., 0:128].reshape(n, -1, 4, 8, 4)  # [t, j, b]
    bits = blocks[..., 128:192].reshape(n, -1, 2, 8, 4)  # [u, j, b]
    low = torch.stack([steps & 0xF, steps >> 4], dim=-1)  # [n, sb, t, j, b, u]
    high = torch.stack([(bits >> 2 * t) & 3 for t in range(4)], dim=-1)  # [n, sb, u, j, b, t]
    levels = low.permute(0, 1, 3, 5, 2, 4) | (high.permute(0, 1, 3, 2, 5, 4) << 4)  # [n, sb, j, u, t, b]
    levels = levels.reshape(n, -1, 2, 2, 2, 32)  # [half, nibble, part, l]
    ql = (levels[:, :, :, 0] & 0xF) | ((levels[:, :, :, 1] & 0xF) << 4)  # [half, part, l]
    high2 = (levels >> 4).reshape(n, -1, 2, 4, 32)  # [half, k = 2 nibble + part, l]
    qh = high2[:, :, :, 0] | (high2[:, :, :, 1] << 2) | (high2[:, :, :, 2] << 4) | (high2[:, :, :, 3] << 6)
    return torch.cat([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), blocks[..., 192:]], dim=-1).reshape(n, -1)


def dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """Any supported type's bytes [N, row_bytes] -> fp32 values [N, K]."""
    if type_name in GROUPED:
        return dequantize(ungroup(raw, type_name), GROUPED[type_name])
    if type_name in FLOATS:
        return raw.contiguous().view(FLOATS[type_name]).float()
    if type_name in INT4:
        levels, scales, lows = int4_levels(raw, type_name)
        n = levels.shape[0]
        grouped = levels.reshape(n, -1, 32).float() * scales[..., None] + lows[..., None]
        return grouped.reshape(n, -1)
    block = TYPES[type_name]
    blocks = _blocks(raw, block)
    n = raw.shape[0]
    if type_name == "Q8_0":
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)).reshape(n, -1)
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        q = _nibbles(blocks[..., at + 4 : at + 20]) | (_high_bits(blocks[..., at : at + 4], 32) << 4)
        if type_name == "Q5_0":
            return ((q.float() - 16) * _f16(blocks, 0)).reshape(n, -1)
        return (q.float() * _f16(blocks, 0) + _f16(blocks, 2)).reshape(n, -1)
    if type_name == "Q5_K":
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mins = _k_scales(blocks[..., 4:16])
        # qh bit j of byte l is the fifth bit of value 32 * j + l.
        high = _high_bits(blocks[..., 16:48], 256).reshape(*blocks.shape[:-1], 32, 8).transpose(-1, -2)
        q = _k_nibbles(blocks[..., 48:176]) | (high.reshape(*blocks.shape[:-1], 256) << 4)
        values = q.float().reshape(*blocks.shape[:-1], 8, 32) * (d * sc)[..., None] - (dmin * mins)[..., None]
        return values.reshape(n, -1)
    if type_name == "Q6_K":
        ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 2, 32)  # [half, first/second 32 bytes, l]
        qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # one per 16 values
        d = _f16(blocks, 208)
        low = torch.stack([ql & 0xF, ql >> 4], dim=-3)  # [half, nibble, 32-byte part, l]
        shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8, device=raw.device)[..., None]  # [nibble, part, 1]
        high = (qh[..., None, :, :] >> shifts) & 3
        q = (low | (high << 4)).float() - 32  # [half, nibble, part, l]: value 128 * half + 64 * nibble + 32 * part + l
        values = q.reshape(*blocks.shape[:-1], 16, 16) * scales[..., None] * d[..., None]
        return values.reshape(n, -1)
    raise ValueError(f"unsupported GGML type {type_name}")


def values(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """``dequantize``, in C++ where built."""
    if _native is None or type_name in FLOATS:
        return dequantize(raw, type_name)
    if type_name in GROUPED:
        raw, type_name = ungroup(raw, type_name), GROUPED[type_name]
    return _native.dequantize(raw.contiguous(), type_name, cols(raw, type_name))


def cols(raw: torch.Tensor, type_name: str) -> int:
    block = TYPES[type_name]
    return raw.shape[1] // block.bytes * block.values
