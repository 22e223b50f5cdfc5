"""The GGUF block kernels (tornchat/engine/blocks.py over csrc/blocks/): every type on every path this CPU
runs against the float64 reference, bit-identical rows whatever the batch, thread count or split into parts,
the int16 saturation worst cases of the AVX2 path, TORNCHAT_ISA, and the error against fp32 matmul."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tornchat.engine import blocks
from tornchat.engine import ggml



def test_the_kernels_are_built():
    # The README's install builds them; every test below needs them, and none may pass without them.
    assert blocks.available(), "tornchat/engine/_fused is not built: pip install --no-build-isolation -e ."

QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
FLOATS = ["F32", "F16", "BF16"]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
SIMPLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf's own quantizers make these


def isas() -> list[str]:
    return blocks.isas() if blocks.available() else ["generic"]


def half_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.half().contiguous().view(torch.uint8).reshape(*values.shape, 2)


def make_part(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes] of type_name: gguf's quantizers on random normal values where it has them, random
    bytes with sane fp16 scales for the K-quants, random values for the float types."""
    gen = torch.Generator().manual_seed(seed)
    if type_name in FLOATS:
        return torch.randn(n, k, generator=gen).to(ggml.FLOATS[type_name]).contiguous().view(torch.uint8)
    if type_name in SIMPLE:
        from gguf import GGMLQuantizationType, quants

        values = torch.randn(n, k, generator=gen).numpy()
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(values, GGMLQuantizationType[type_name])))
    block = ggml.TYPES[type_name]
    raw = torch.randint(0, 256, (n, k // 256, block.bytes), dtype=torch.uint8, generator=gen)
    d = half_bytes(torch.rand(n, k // 256, generator=gen) * 0.01 + 0.001)
    if type_name == "Q6_K":
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        raw[..., 2:4] = half_bytes(torch.rand(n, k // 256, generator=gen) * 0.01)
    return raw.reshape(n, -1).contiguous()


def k_for(type_name: str) -> int:
    return 512 if type_name in K_QUANTS else 288  # 288: 9 blocks of 32, a short last group of 8


def check_close(x, parts, types, got):
    want = blocks.reference_mm(x, parts, types)
    scale = blocks.reference_terms(x, parts, types)
    err = (got.double() - want).abs()
    assert (err <= 1e-5 * scale + 1e-30).all(), f"max relative error {(err / scale.clamp_min(1e-30)).max():.3g}"


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_matches_reference(type_name, isa):
    k = k_for(type_name)
    part = make_part(type_name, 37, k, seed=1)  # 37: a last tile of 4 columns with one
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    got = blocks.mm(x, [part], [type_name], isa)
    assert got.dtype == torch.float32 and got.shape == (5, 37)
    check_close(x, [part], [type_name], got)


@pytest.mark.parametrize("type_name", QUANTIZED + FLOATS)
def test_paths_agree(type_name):
    """Every path does the same fp32 operations on the same exact integers: the same bits."""
    k = k_for(type_name)
    part = make_part(type_name, 21, k, seed=3)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    outs = {isa: blocks.mm(x, [part], [type_name], isa) for isa in isas()}
    for isa, out in outs.items():
        assert torch.equal(out, outs["generic"]), isa


def emulate_fp32(x: torch.Tensor, raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """The kernels' fixed fp32 order (csrc/blocks.h's semantics) in numpy, for Q8_0, Q4_1 and Q4_K: block
    8g + j into lane j, lane = fma(float(dot), a * d, lane), then fma(m, d * s, lane); the lanes summed as
    ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Each fma is a float64 multiply-add (the product of two
    fp32 is exact there) rounded to fp32."""
    q, d, s = blocks.quantize_activations_reference(x)
    rows, k = x.shape
    n, nb = raw.shape[0], k // 32
    if type_name == "Q8_0":
        blocks_ = raw.reshape(n, nb, 34)
        levels = blocks_[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        a, m = blocks_[..., 0:2].contiguous().view(torch.float16).float()[..., 0], None
    else:
        levels, a, m = ggml.int4_levels(raw, type_name)
    dots = (levels.long().reshape(1, n, nb, 32) * q.long().reshape(rows, 1, nb, 32)).sum(-1).numpy()  # [rows, n, nb]
    f32 = np.float32
    a, d = a.numpy().astype(f32), d.numpy().astype(f32)
    ds = d * s.numpy().astype(f32)  # fp32 products
    acc = np.zeros((rows, n, 8), dtype=f32)
    for b in range(nb):
        j = b % 8
        scale = a[None, :, b] * d[:, None, b]  # fp32 [rows, n]
        acc[..., j] = (dots[..., b].astype(np.float64) * scale + acc[..., j]).astype(f32)
        if m is not None:
            acc[..., j] = (m.numpy()[None, :, b].astype(np.float64) * ds[:, None, b] + acc[..., j]).astype(f32)
    out = ((acc[..., 0] + acc[..., 4]) + (acc[..., 2] + acc[..., 6])) + ((acc[..., 1] + acc[..., 5]) + (acc[..., 3] + acc[..., 7]))
    return torch.from_numpy(out)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q4_K"])
def test_fixed_fp32_order(type_name):
    """Bit for bit the fp32 operations the semantics name, on every path."""
    k = k_for(type_name)
    part = make_part(type_name, 9, k, seed=17)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(18))
    want = emulate_fp32(x, part, type_name)
    for isa in isas():
        assert torch.equal(blocks.mm(x, [part], [type_name], isa), want), isa


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_paths_agree_on_many_rows(type_name):
    """70 rows: the amx path's tiles of 16 rows and its 6 rows left over, the avx512vnni and avx2 paths' panels
    (64 rows) and their 6 left over, and the vector paths' row tiles."""
    k = k_for(type_name)
    part = make_part(type_name, 37, k, seed=19)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(20))
    outs = {isa: blocks.mm(x, [part], [type_name], isa) for isa in isas()}
    for isa, out in outs.items():
        assert torch.equal(out, outs["generic"]), isa
    check_close(x[:3], [part], [type_name], outs["generic"][:3])


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_one_row_is_its_row_of_many(type_name):
    """A decode step's lone row (AVX-512: its blocks folded in their own order) gives what the same row gets
    among 5 and among 70 (the tiles, the panels): on every path, every type, a short last group of 8 too."""
    k = k_for(type_name)
    part = make_part(type_name, 37, k, seed=23)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(24))
    want = blocks.mm(x, [part], [type_name], "generic")
    for isa in isas():
        assert torch.equal(blocks.mm(x, [part], [type_name], isa), want), isa
        assert torch.equal(blocks.mm(x[:5], [part], [type_name], isa), want[:5]), isa
        for r in (0, 4, 69):
            assert torch.equal(blocks.mm(x[r : r + 1], [part], [type_name], isa), want[r : r + 1]), (isa, r)


@pytest.mark.parametrize("type_name", SIMPLE)
def test_every_short_group(type_name):
    """Rows whose last group of 8 blocks holds 1 to 7 (the tiles dot them plainly and sum them into their
    lanes: csrc/blocks/x86_steps.inc block_lanes) give every path the generic path's bits, alone and among 3 rows."""
    for tail in range(1, 8):
        k = 32 * (8 + tail)
        part = make_part(type_name, 9, k, seed=40 + tail)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(50 + tail))
        want = blocks.mm(x, [part], [type_name], "generic")
        check_close(x, [part], [type_name], want)
        for isa in isas():
            assert torch.equal(blocks.mm(x, [part], [type_name], isa), want), (isa, tail)
            assert torch.equal(blocks.mm(x[1:2], [part], [type_name], isa), want[1:2]), (isa, tail)


GROUPABLE = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


@pytest.mark.parametrize("type_name", GROUPABLE)
def test_grouped_layout(type_name):
    """csrc/blocks.h's grouped layout: the C++ rearrangement is ggml.group's, ungrouping gives the file's bytes
    back, and the values are the file's; a whole group's block 1 keeps its d in bytes 2-3 and its first 4 levels
    at bytes 4-7 of the first step, a short group's block 1 its d in bytes 2-3 and its levels after the group's
    scales; a Q4_K super-block keeps its scales and puts its sub-blocks' levels in the same steps."""
    for k in (256, 768) if type_name in K_QUANTS else (64, 256, 288, 576):
        part = make_part(type_name, 5, k, seed=k)
        grouped = part.clone()
        blocks._native().group_blocks(grouped, blocks.TYPE_IDS[type_name])
        name = type_name + "_G8"
        assert torch.equal(grouped, ggml.group(part, type_name)) and not torch.equal(grouped, part), k
        back, back_type = blocks.ungroup(grouped, name)
        assert torch.equal(ggml.ungroup(grouped, name), part) and torch.equal(back, part) and back_type == type_name, k
        assert torch.equal(ggml.values(grouped, name), ggml.dequantize(part, type_name)), k
    if type_name == "Q6_K":  # block 5's features 0-3 (half 1, nibble 0, part 1: bytes 96-99's low nibbles, qh
        # bytes 160-163 at bit 2), and its scales and d where they were
        original = make_part(type_name, 1, 256)[0]
        row = ggml.group(original[None], type_name)[0]
        assert torch.equal(row[192:], original[192:]) and torch.equal(row[20:24] & 0xF, original[96:100] & 0xF)
        assert torch.equal(row[128 + 20 : 128 + 24] & 3, (original[160:164] >> 2) & 3)
        return
    if type_name == "Q4_K":  # sub-block 3's features 0-3 and 16-19: the high nibbles of bytes 32-35 and 48-51
        original = make_part(type_name, 1, 256)[0]
        row = ggml.group(original[None], type_name)[0]
        assert torch.equal(row[:16], original[:16])
        assert torch.equal(row[16 + 12 : 16 + 16], (original[16 + 32 : 16 + 36] >> 4) | (original[16 + 48 : 16 + 52] & 0xF0))
        return
    block = ggml.TYPES[type_name].bytes
    head = 4 if type_name == "Q4_1" else 2
    original = make_part(type_name, 1, 256 + 96)[0]  # a whole group and a short one of 3 blocks
    row = ggml.group(original[None], type_name)[0]
    assert torch.equal(row[2:4], original[block : block + 2])
    assert torch.equal(row[8 * head + 4 : 8 * head + 8], original[block + head : block + head + 4])
    short, first = row[8 * block :], original[8 * block :]
    assert torch.equal(short[2:4], first[block : block + 2])
    assert torch.equal(short[3 * head + (block - head) : 3 * head + 2 * (block - head)], first[block + head : 2 * block])


@pytest.mark.parametrize("type_name", GROUPABLE)
def test_grouped_rows_give_the_files_bits(type_name):
    """A grouped part's products are the file's, bit for bit, on every path (each in its own kernels: the AVX-512
    tiles and panels read grouped rows too) and at any number of rows (the tiles, and the panels of every path
    from their PANEL_ROWS), in a call with parts of other types too, with and without a short last group (of 1
    and 2 blocks: csrc/blocks/x86_tiles.inc short_tail, a tile's 4 columns in one transposed group; of 5 and 7: pair_lanes'
    halves, a lone block at the end)."""
    for k in (256, 512, 768) if type_name in K_QUANTS else (256, 288, 576, 416, 480):
        part = make_part(type_name, 37, k, seed=k + 1)
        other = make_part("Q4_K" if k % 256 == 0 else "Q5_0", 11, k, seed=k + 2)
        other_type = "Q4_K" if k % 256 == 0 else "Q5_0"
        grouped = ggml.group(part, type_name)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(k))
        want = blocks.mm(x, [part, other], [type_name, other_type], "generic")
        for isa in isas():
            for rows in (1, 2, 4, 5, 8, 16, 70):
                got = blocks.mm(x[:rows], [grouped, other], [type_name + "_G8", other_type], isa)
                assert torch.equal(got, want[:rows]), (isa, k, rows)


PANELABLE = ("Q4_0", "Q4_1", "Q8_0")


@pytest.mark.parametrize("type_name", PANELABLE)
def test_panel_layout(type_name):
    """csrc/blocks.h's panel layout: the C++ rearrangement is ggml.panel's, unpaneling gives the file's bytes
    back, and the values are the file's; 16 rows' block b in one slot, the slots in lane order (b = 0, 8, .., 1,
    9, ..), each holding the rows' d, Q4_1's minimums, then their levels' 4-byte words side by side."""
    name = type_name + "_P16"
    for k in (64, 288, 576, 1536):
        part = make_part(type_name, 32, k, seed=k)
        paneled = ggml.panel(part, type_name)
        assert not torch.equal(paneled, part) and torch.equal(ggml.ungroup(paneled, name), part), k
        assert torch.equal(ggml.values(paneled, name), ggml.dequantize(part, type_name)), k
        if blocks.available():
            native = part.clone()
            blocks._native().panel_blocks(native, blocks.TYPE_IDS[type_name])
            back, back_type = blocks.ungroup(native, name)
            assert torch.equal(native, paneled) and torch.equal(back, part) and back_type == type_name, k
    nb, block = 9, ggml.TYPES[type_name].bytes  # K = 288: slots hold blocks 0, 8, 1, 2, .., 7 of rows 0-15, then 16-31
    head = 4 if type_name == "Q4_1" else 2
    part = make_part(type_name, 32, 32 * nb, seed=1)
    paneled = ggml.panel(part, type_name).reshape(-1)
    file_block = part.reshape(32, nb, block)
    slot = paneled[16 * block : 2 * 16 * block]  # block 8 of rows 0-15
    assert torch.equal(slot[2 * 5 : 2 * 5 + 2], file_block[5, 8, 0:2])  # row 5's d
    if type_name == "Q4_1":
        assert torch.equal(slot[32 + 2 * 5 : 32 + 2 * 5 + 2], file_block[5, 8, 2:4])  # its minimum
    word = slot[16 * head + 64 * 2 + 4 * 5 : 16 * head + 64 * 2 + 4 * 5 + 4]  # its levels' word 2
    assert torch.equal(word, file_block[5, 8, head + 8 : head + 12])
    second_slab = paneled[16 * nb * block :]
    assert torch.equal(second_slab[2 * 16 * block + 2 * 3 : 2 * 16 * block + 2 * 3 + 2], file_block[19, 1, 0:2])
    with pytest.raises(ValueError, match="panel layout"):
        ggml.panel(make_part("Q5_0", 16, 64), "Q5_0")
    with pytest.raises(ValueError, match="slabs of 16"):
        ggml.panel(make_part(type_name, 24, 64), type_name)


@pytest.mark.skipif("avx512vnni" not in isas(), reason="the panel layout is the avx512vnni path's")
@pytest.mark.parametrize("type_name", PANELABLE)
def test_paneled_rows_give_the_files_bits(type_name):
    """A paneled part's products are the file's, bit for bit, at any number of rows (its tiles of up to 8 rows,
    and from PANEL_ROWS the panels), beside parts in other layouts, at K with and without a short last group."""
    for k in (256, 288, 576, 416, 1536):
        part = make_part(type_name, 48, k, seed=k + 1)
        other = make_part("Q4_1", 20, k, seed=k + 2)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(k))
        want = blocks.mm(x, [part, other], [type_name, "Q4_1"], "generic")
        paneled, grouped = ggml.panel(part, type_name), ggml.group(other, "Q4_1")
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 70):
            got = blocks.mm(x[:rows], [paneled, grouped], [type_name + "_P16", "Q4_1_G8"], "avx512vnni")
            assert torch.equal(got, want[:rows]), (k, rows)
    with pytest.raises(RuntimeError, match="rows of 16"):
        blocks.mm(x[:1], [ggml.panel(part, type_name)[:40]], [type_name + "_P16"], "avx512vnni")


@pytest.mark.skipif(not blocks.available(), reason="needs the compiled block kernels")
@pytest.mark.parametrize("type_name", PANELABLE)
def test_other_paths_refuse_the_panel_layout(type_name):
    """Every path but avx512vnni (on any CPU: generic and avx2 at least) refuses a paneled part, clearly."""
    paneled, x = ggml.panel(make_part(type_name, 16, 64), type_name), torch.randn(1, 64)
    for isa in set(isas()) - {"avx512vnni"}:
        with pytest.raises(RuntimeError, match="panel layout"):
            blocks.mm(x, [paneled], [type_name + "_P16"], isa)


def test_grouping_follows_the_path():
    """blocks.group rearranges a part only for the paths that read the grouped layout faster."""
    part = make_part("Q4_1", 3, 256)
    assert blocks.grouped_type("Q4_1", "generic") == "Q4_1" and blocks.grouped_type("Q4_K", "generic") == "Q4_K"
    kept = part.clone()
    assert blocks.group(kept, "Q4_1", "generic") == "Q4_1" and torch.equal(kept, part)
    for isa in set(isas()) - {"generic"}:
        grouped = part.clone()
        assert blocks.group(grouped, "Q4_1", isa) == "Q4_1_G8" and torch.equal(grouped, ggml.group(part, "Q4_1"))
        assert blocks.group(part.clone(), "Q5_0", isa) == "Q5_0"
        # AVX-512 reads Q8_0 in the file's layout, the AVX2 paths grouped; every path Q6_K grouped
        q8 = make_part("Q8_0", 3, 256)
        wanted = "Q8_0" if isa in ("avx512vnni", "amx") else "Q8_0_G8"
        assert blocks.group(q8, "Q8_0", isa) == wanted == blocks.grouped_type("Q8_0", isa)
        assert blocks.group(make_part("Q6_K", 3, 256), "Q6_K", isa) == "Q6_K_G8"
        # the panel layout: where asked for, on the path that reads it, for whole slabs of 16 rows
        for type_name in PANELABLE:
            rows16 = make_part(type_name, 32, 256)
            for panels, n in ((True, 32), (True, 24), (False, 32)):
                p = rows16[:n].clone()
                grouped = type_name if type_name == "Q8_0" and isa in ("avx512vnni", "amx") else type_name + "_G8"
                wanted = type_name + "_P16" if panels and n == 32 and isa == "avx512vnni" else grouped
                assert blocks.group(p, type_name, isa, panels=panels) == wanted, (isa, type_name, panels, n)
                assert torch.equal(blocks.ungroup(p, wanted)[0], rows16[:n]), (isa, type_name, panels, n)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_quantization_edge_cases_agree(type_name):
    """The activations' quantization (AVX-512 and AVX2: in vectors) on every path: zero blocks, NaNs (passed over
    by the largest |x|, then clamped to -127), exact ties of the rounding to even, subnormals; 1, 4 and 70 rows."""
    k = k_for(type_name)
    part = make_part(type_name, 37, k, seed=29)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(30))
    x[1, 32:64] = 0.0
    x[2, 5] = x[3, 40] = float("nan")
    x[4, :32] = torch.arange(32) - 15.5
    x[5, :32] = torch.arange(32) * 4.0 + 0.5 * (torch.arange(32) % 2)
    x[6, 64:96] = (torch.arange(32) - 16) * 0.5
    x[6, 95] = 127.0  # inverse exactly 1: 0.5, 1.5, ... ties, rounded to even
    x[7, :] = torch.randn(k, generator=torch.Generator().manual_seed(31)) * 1e-40  # subnormal
    for rows in (x[:1], x[2:3], x[6:7], x[:4], x[4:8], x):
        outs = {isa: blocks.mm(rows, [part], [type_name], isa) for isa in isas()}
        for isa, out in outs.items():
            assert torch.equal(out.view(torch.int32), outs["generic"].view(torch.int32)), (isa, len(rows))


def stacked_parts():
    """Q4_K_M's qkv: Q4_K q and k, Q6_K v; with a Q8_0 part for good measure."""
    return [make_part("Q4_K", 24, 512, 5), make_part("Q4_K", 8, 512, 6), make_part("Q6_K", 9, 512, 7),
            make_part("Q8_0", 6, 512, 8)], ["Q4_K", "Q4_K", "Q6_K", "Q8_0"]


@pytest.mark.parametrize("isa", isas())
def test_batch_invariance(isa):
    parts, types = stacked_parts()
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(512, 512, generator=gen) * torch.rand(512, 1, generator=gen) * 4
    full = blocks.mm(x, parts, types, isa)
    other = torch.randn(512, 512, generator=gen)
    for count in (1, 2, 5, 8, 64):
        for start in (0, 3, 512 - count):
            got = blocks.mm(x[start : start + count], parts, types, isa)
            assert torch.equal(got, full[start : start + count]), (count, start)
            # the same row among other rows, at another place
            mixed = other[:count].clone()
            mixed[count // 2] = x[start]
            assert torch.equal(blocks.mm(mixed, parts, types, isa)[count // 2], full[start]), (count, start)
    check_close(x[:4], parts, types, full[:4])


@pytest.mark.parametrize("isa", isas())
def test_parts_and_threads(isa):
    part = make_part("Q4_K", 200, 512, 10)  # several chunks of columns for the threads
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(11))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = blocks.mm(x, [part], ["Q4_K"], isa)
        torch.set_num_threads(2)
        two = blocks.mm(x, [part], ["Q4_K"], isa)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    split = blocks.mm(x, [part[:13], part[13:101], part[101:]], ["Q4_K"] * 3, isa)
    assert torch.equal(split, one)


def extreme_part(type_name: str, n: int, k: int, level_byte: int) -> torch.Tensor:
    """Blocks whose level bytes are all level_byte (0x00 lowest, 0xFF highest, 0x80 Q8_0's -128), scales
    0.5 (Q4_K, Q5_K: scale and minimum fields 63)."""
    block = ggml.TYPES[type_name]
    raw = torch.full((n, k // block.values, block.bytes), level_byte, dtype=torch.uint8)
    half = half_bytes(torch.full((n, k // block.values), 0.5))
    if type_name == "Q6_K":
        raw[..., 192:208] = 127  # int8 scales
        raw[..., 208:210] = half
    elif type_name in ("Q4_K", "Q5_K"):
        raw[..., 0:2] = half
        raw[..., 2:4] = half
        raw[..., 4:16] = 0xFF  # 6-bit scales and minimums 63
    else:
        raw[..., 0:2] = half
        if type_name in ("Q4_1", "Q5_1"):
            raw[..., 2:4] = half
    return raw.reshape(n, -1).contiguous()


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("type_name", QUANTIZED)
def test_saturation_worst_cases(type_name, isa):
    """Activations all +-127 against the extreme levels: VPMADDUBSW's int16 pair sums, and the avx2 path's int16
    sums of several steps, must not saturate: 36 rows, so that the avx2 path's panels take 32 and its tiles 4."""
    k = 512
    signs = torch.ones(4, k)
    signs[1] = -1
    signs[2, ::2] = -1
    signs[3, 1::2] = -1
    signs = signs.repeat(9, 1)
    for level_byte in (0x00, 0xFF, 0x80, 0x7F):
        part = extreme_part(type_name, 8, k, level_byte)
        got = blocks.mm(signs, [part], [type_name], isa)
        check_close(signs, [part], [type_name], got)


def test_bf16_activations():
    part = make_part("Q4_K", 16, 512, 12)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(13)).bfloat16()
    assert torch.equal(blocks.mm(x, [part], ["Q4_K"]), blocks.mm(x.float(), [part], ["Q4_K"]))


def test_zero_activations():
    part = make_part("Q4_1", 8, 288, 14)
    x = torch.zeros(2, 288)
    assert torch.equal(blocks.mm(x, [part], ["Q4_1"]), torch.zeros(2, 8))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_error_against_fp32_matmul(type_name):
    """The activations' 8-bit rounding is small: outputs within ~1% of x @ dequantized W^T."""
    part = make_part(type_name, 64, 512, 15)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(16))
    exact = x @ ggml.dequantize(part, type_name).T
    got = blocks.mm(x, [part], [type_name])
    relative = (got - exact).norm() / exact.norm()
    assert relative < 0.01, relative
    assert ((got - exact).abs() / exact.abs().mean()).quantile(0.99) < 0.03


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_isa_choice():
    assert blocks.isas()[-1] == "generic"
    assert blocks.isa() == (os.environ.get("TORNCHAT_ISA") or blocks.isas()[0])
    code = "from tornchat.engine import blocks; print(blocks.isa())"
    if "avx2" in blocks.isas():
        forced = run_python(code, TORNCHAT_ISA="avx2")
        assert forced.returncode == 0 and forced.stdout.strip() == "avx2", forced.stderr
    generic = run_python(code, TORNCHAT_ISA="generic")
    assert generic.returncode == 0 and generic.stdout.strip() == "generic", generic.stderr
    bogus = run_python(code, TORNCHAT_ISA="sse9")
    assert bogus.returncode != 0 and "TORNCHAT_ISA='sse9'" in bogus.stderr and "generic" in bogus.stderr
    with pytest.raises(RuntimeError, match="choices"):
        blocks.mm(torch.randn(1, 288), [make_part("Q4_0", 4, 288)], ["Q4_0"], "sse9")


def test_bad_shapes():
    part = make_part("Q4_K", 4, 512)
    with pytest.raises(RuntimeError, match="bytes"):
        blocks.mm(torch.randn(1, 256), [part], ["Q4_K"])
    with pytest.raises(RuntimeError, match="type"):
        blocks.mm(torch.randn(1, 512), [part], [99])
