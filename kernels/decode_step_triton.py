"""The CUDA decode step's operations, one kernel each (semantics and references: ``tornchat.engine.step_ops``):
the small ones, and the matrix products of plain weights.

A row's position is read on the device, never passed as a number, so that
one captured graph serves every step of a generation. Each kernel computes a
row by itself, in an order that depends on nothing but the row, so that a
row gets the same bits in a step of any rows (a verify's, or generations'
decoding together).
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tornchat.kernels.dispatch import interpreting

ATTEND_BLOCK = 32  # keys per iteration of attention's loop
ATTEND_QUERIES = 16  # a KV head's query heads, padded to the smallest matrix-product tile
# Positions a program of attention covers: fixed, so that a row's sums are split the same way whatever the
# cache's capacity (a verify may grow the cache before a row that a lone step would attend from the smaller one).
SPLIT_POSITIONS = tl.constexpr(256)


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, width, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * width + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded as x + delta is
        tl.store(sum_ptr + row * width + cols, x, mask=inside)
    x = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (x * scale * weight).to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty(rows, width, dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(width)
    _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, total, out, width, eps,
                                  HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(8, max(1, block // 256)))
    return total, out


@triton.jit
def _rope_store_kernel(qkv_ptr, bias_ptr, table_ptr, position_ptr, norm_ptr, q_ptr, keys_ptr, values_ptr,
                       position_stride, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       HEADS_P2: tl.constexpr, KV_P2: tl.constexpr, HALF_P2: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr):
    """Program r: row r of qkv, at positions[r] of the one cache every row writes."""
    row = tl.program_id(0).to(tl.int64)
    qkv_ptr += row * (HEADS + 2 * KV_HEADS) * 2 * HALF
    q_ptr += row * HEADS * 2 * HALF
    position = tl.load(position_ptr + row)
    head = tl.arange(0, HEADS_P2)[:, None]  # query heads, then key heads
    pair = tl.arange(0, HALF_P2)[None, :]
    inside = (head < HEADS + KV_HEADS) & (pair < HALF)
    first = head * (2 * HALF) + 2 * pair
    x1 = tl.load(qkv_ptr + first, mask=inside, other=0.0)
    x2 = tl.load(qkv_ptr + first + 1, mask=inside, other=0.0)
    if HAS_BIAS:  # added in qkv's dtype, as qkv + bias is
        x1 = (x1.to(tl.float32) + tl.load(bias_ptr + first, mask=inside, other=0.0).to(tl.float32)).to(x1.dtype)
        x2 = (x2.to(tl.float32) + tl.load(bias_ptr + first + 1, mask=inside, other=0.0).to(tl.float32)).to(x2.dtype)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:  # each head RMS-normed, weighted by row 0 of the norm (queries) or row 1 (keys)
        scale = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)[:, None]
        which = tl.where(head < HEADS, 0, 2 * HALF)
        x1 = x1 * scale * tl.load(norm_ptr + which + 2 * pair, mask=inside, other=0.0).to(tl.float32)
        x2 = x2 * scale * tl.load(norm_ptr + which + 2 * pair + 1, mask=inside, other=0.0).to(tl.float32)
    angle = table_ptr + position * (2 * HALF) + 2 * pair
    cos = tl.load(angle, mask=pair < HALF, other=0.0)
    sin = tl.load(angle + 1, mask=pair < HALF, other=0.0)
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    is_query = head < HEADS
    tl.store(q_ptr + first, y1.to(q_ptr.dtype.element_ty), mask=inside & is_query)
    tl.store(q_ptr + first + 1, y2.to(q_ptr.dtype.element_ty), mask=inside & is_query)
    key = keys_ptr + position * position_stride + (head - HEADS) * (2 * HALF) + 2 * pair
    tl.store(key, y1.to(keys_ptr.dtype.element_ty), mask=inside & ~is_query)
    tl.store(key + 1, y2.to(keys_ptr.dtype.element_ty), mask=inside & ~is_query)

    kv_head = tl.arange(0, KV_P2)[:, None]
    dim = tl.arange(0, 2 * HALF_P2)[None, :]
    inside = (kv_head < KV_HEADS) & (dim < 2 * HALF)
    at = (HEADS + KV_HEADS) * 2 * HALF + kv_head * 2 * HALF + dim
    v = tl.load(qkv_ptr + at, mask=inside, other=0.0)
    if HAS_BIAS:
        v = (v.to(tl.float32) + tl.load(bias_ptr + at, mask=inside, other=0.0).to(tl.float32)).to(v.dtype)
    tl.store(values_ptr + position * position_stride + kv_head * 2 * HALF + dim, v.to(values_ptr.dtype.element_ty),
             mask=inside)


def rope_store(qkv: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    rows, head_dim = qkv.shape[0], keys.shape[-1]
    q = torch.empty(rows, heads, head_dim, dtype=keys.dtype, device=keys.device)
    _rope_store_kernel[(rows,)](
        qkv, bias if bias is not None else qkv, table, positions, qk_norm if qk_norm is not None else table, q, keys,
        values, keys.stride(0), eps, HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
        HEADS_P2=triton.next_power_of_2(heads + kv_heads), KV_P2=triton.next_power_of_2(kv_heads),
        HALF_P2=triton.next_power_of_2(head_dim // 2), HAS_BIAS=bias is not None, HAS_NORM=qk_norm is not None,
        num_warps=4)
    return q


@triton.jit
def _attend_kernel(q_ptr, keys_ptr, values_ptr, position_ptr, acc_ptr, best_ptr, total_ptr, out_ptr,
                   position_stride, scale, splits, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, QUERIES: tl.constexpr, BLOCK: tl.constexpr,
                   SPLIT: tl.constexpr):
    """Program (KV head h, split s, row r): softmax-weighted values of positions s * SPLIT_POSITIONS .. up to row
    r's own, for h's query heads, in fp32 (bf16 keys and values widened exactly); the unnormalized sums with
    their running maximum and total where SPLIT, else the row's output."""
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    seen = tl.load(position_ptr + row) + 1
    start = split * SPLIT_POSITIONS
    if start >= seen:  # past the row's position: the combine reads no split past its own
        return
    end = tl.minimum(start + SPLIT_POSITIONS, seen)
    q_ptr += row * KV_HEADS * GROUP * HEAD_DIM
    query = tl.arange(0, QUERIES)
    dim = tl.arange(0, DIM_P2)
    dims = (dim < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (kv_head * GROUP + query)[:, None] * HEAD_DIM + dim[None, :],
                mask=(query < GROUP)[:, None] & dims, other=0.0).to(tl.float32)
    best = tl.full([QUERIES], float("-inf"), tl.float32)
    total = tl.zeros([QUERIES], tl.float32)
    acc = tl.zeros([QUERIES, DIM_P2], tl.float32)
    for first in range(start, end, BLOCK):
        at = first + tl.arange(0, BLOCK)
        valid = at < end
        where = at[:, None] * position_stride + kv_head * HEAD_DIM + dim[None, :]
        k = tl.load(keys_ptr + where, mask=valid[:, None] & dims, other=0.0).to(tl.float32)
        v = tl.load(values_ptr + where, mask=valid[:, None] & dims, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, axis=1))
        fade = tl.exp(best - new_best)
        p = tl.exp(s - new_best[:, None])
        total = total * fade + tl.sum(p, axis=1)
        acc = acc * fade[:, None] + tl.dot(p, v, input_precision="ieee")
        best = new_best
    rows = (query < GROUP)[:, None] & dims
    if SPLIT:
        part = ((row * KV_HEADS + kv_head) * splits + split) * QUERIES + query
        tl.store(best_ptr + part, best, mask=query < GROUP)
        tl.store(total_ptr + part, total, mask=query < GROUP)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dim[None, :], acc, mask=rows)
    else:
        out = acc / total[:, None]
        tl.store(out_ptr + (row * KV_HEADS * GROUP + kv_head * GROUP + query)[:, None] * HEAD_DIM + dim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows)


@triton.jit
def _attend_combine_kernel(acc_ptr, best_ptr, total_ptr, position_ptr, out_ptr, splits, KV_HEADS: tl.constexpr,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                           QUERIES: tl.constexpr):
    """Program (query head, row): the row's splits up to its position, in order, each rescaled to the largest
    maximum so far, over their totals. One split alone gives what the unsplit kernel gives (its sums times
    exp(0) = 1), and a split's sums do not depend on how many splits the cache holds: the row's bits depend on
    its position, not on the cache's capacity."""
    head = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    used = tl.cdiv(tl.load(position_ptr + row) + 1, SPLIT_POSITIONS)
    part = ((row * KV_HEADS + head // GROUP) * splits) * QUERIES + head % GROUP
    dim = tl.arange(0, DIM_P2)
    inside = dim < HEAD_DIM
    best = tl.load(best_ptr + part)
    total = tl.load(total_ptr + part)
    acc = tl.load(acc_ptr + part * HEAD_DIM + dim, mask=inside, other=0.0)
    for split in range(1, used):
        at = part + split * QUERIES
        theirs_best = tl.load(best_ptr + at)
        top = tl.maximum(best, theirs_best)
        mine, theirs = tl.exp(best - top), tl.exp(theirs_best - top)
        total = total * mine + tl.load(total_ptr + at) * theirs
        acc = acc * mine + tl.load(acc_ptr + at * HEAD_DIM + dim, mask=inside, other=0.0) * theirs
        best = top
    tl.store(out_ptr + (row * KV_HEADS * GROUP + head) * HEAD_DIM + dim, (acc / total).to(out_ptr.dtype.element_ty),
             mask=inside)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
           scale: float) -> torch.Tensor:
    rows, heads, head_dim = q.shape
    capacity, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    queries = max(ATTEND_QUERIES, triton.next_power_of_2(group))
    splits = triton.cdiv(capacity, SPLIT_POSITIONS.value)
    out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        acc = torch.empty(rows * kv_heads * splits * queries, head_dim, dtype=torch.float32, device=q.device)
        best = torch.empty(rows * kv_heads * splits * queries, dtype=torch.float32, device=q.device)
        total = torch.empty_like(best)
    else:
        acc = best = total = out
    shape = dict(KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, DIM_P2=triton.next_power_of_2(head_dim),
                 QUERIES=queries)
    _attend_kernel[(kv_heads, splits, rows)](q, keys, values, positions, acc, best, total, out, keys.stride(0), scale,
                                             splits, BLOCK=ATTEND_BLOCK, SPLIT=splits > 1, num_warps=4, **shape)
    if splits > 1:
        _attend_combine_kernel[(heads, rows)](acc, best, total, positions, out, splits, num_warps=1, **shape)
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block, num_warps=4)
    return out


ROWS_TILE = tl.constexpr(16)  # rows a product takes: the smallest matrix-product tile, whatever number of them is used


@triton.jit(do_not_specialize=["rows"])
def _linear_rows_kernel(x_ptr, w_ptr, out_ptr, rows, n, k, x_stride, w_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        WIDEN: tl.constexpr, ROWWISE: tl.constexpr):
    """Program (block of BLOCK_N outputs): x [rows, k] times those rows of w [n, k], over k in order, in fp32.
    ``rows`` is not specialized: one compiled kernel serves every row count, so a row's bits cannot depend on it.
    ROWWISE (the interpreter): each row's products summed by itself, as numpy sums an axis, where numpy's matrix
    product (BLAS) may sum a row at one place of the tile otherwise than at another."""
    col = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, ROWS_TILE)
    step = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS_TILE, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        at = start + step
        xs = tl.load(x_ptr + row[:, None] * x_stride + at[None, :], mask=(row < rows)[:, None] & (at < k)[None, :],
                     other=0.0)
        ws = tl.load(w_ptr + col[:, None] * w_stride + at[None, :], mask=(col < n)[:, None] & (at < k)[None, :], other=0.0)
        if ROWWISE:
            acc += tl.sum(xs.to(tl.float32)[:, None, :] * ws.to(tl.float32)[None, :, :], axis=2)
        elif WIDEN:  # fp32 products in fp32, not TF32
            acc = tl.dot(xs.to(tl.float32), tl.trans(ws.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xs, tl.trans(ws), acc)
    tl.store(out_ptr + row[:, None] * n + col[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(row < rows)[:, None] & (col < n)[None, :])


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    warps: int
    stages: int


def linear_config(n: int, k: int) -> LinearConfig:
    """The launch for a product of shape [n, k], whatever its row count: about one program per multiprocessor
    (at least 16 outputs each, the tile; at most 64), each reading a tile of 8-32 KiB a step along k. Read off
    24 launches timed per matrix of the 135M, 1B and 8B shapes on an H200 (docs/performance.md): within 2% of
    cuBLAS's one-row product or faster for each matrix but the 8B's wqkv and the 135M's and 1B's heads.
    k is not split among programs: a split would need a second pass to sum in a fixed order."""
    block_n = min(64, max(16, triton.next_power_of_2(triton.cdiv(n, _multiprocessors()))))
    block_k = 512 if block_n <= 32 and k >= 1024 else 128 if block_n >= 64 or k < 1024 else 256
    return LinearConfig(block_n, block_k, 4, 4 if block_n * block_k >= 16384 else 3)


@functools.cache
def _multiprocessors() -> int:
    return torch.cuda.get_device_properties().multi_processor_count if torch.cuda.is_available() else 132


def linear_rows(x: torch.Tensor, w: torch.Tensor, config: LinearConfig | None = None) -> torch.Tensor:
    """x [rows <= ROWS_TILE, k] @ w [n, k].T in w's dtype (x cast to it first, as ``F.linear`` takes it), summed in
    fp32 and rounded once. A row's result is the same bits whatever rows are beside it: every call runs the
    same compiled kernel on a tile of ROWS_TILE rows (the unused ones zeros), and a matrix-product instruction
    computes each output row from its own input row only. ``config``: a launch other than ``linear_config``'s
    (bench/gpu.py tries them)."""
    rows, k = x.shape
    n = w.shape[0]
    if rows > ROWS_TILE.value:
        raise ValueError(f"{rows} rows: a step's product takes at most {ROWS_TILE.value}")
    x = x.to(w.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        raise ValueError("the weights' rows must be contiguous")
    out = torch.empty(rows, n, dtype=w.dtype, device=w.device)
    c = config or linear_config(n, k)
    _linear_rows_kernel[(triton.cdiv(n, c.block_n),)](
        x, w, out, rows, n, k, x.stride(0), w.stride(0), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        WIDEN=w.dtype == torch.float32, ROWWISE=interpreting(), num_warps=c.warps, num_stages=c.stages)
    return out
