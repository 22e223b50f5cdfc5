"""The CUDA decode step's small operations, one kernel each (semantics and references:
``tornchat.engine.step_ops``).

A row's position is read on the device, never passed as a number, so that
one captured graph serves every step of a generation.
"""
import torch
import triton
import triton.language as tl

ATTEND_BLOCK = 32  # keys per iteration of attention's loop
ATTEND_QUERIES = 16  # a KV head's query heads, padded to the smallest matrix-product tile
SPLIT_POSITIONS = 256  # positions a program of attention covers at least, before its cache is split among more
MOST_SPLITS = 64


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
    position = tl.load(position_ptr)
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


def rope_store(qkv: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor, position: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    head_dim = keys.shape[-1]
    q = torch.empty(1, heads, head_dim, dtype=keys.dtype, device=keys.device)
    _rope_store_kernel[(1,)](
        qkv, bias if bias is not None else qkv, table, position, qk_norm if qk_norm is not None else table, q, keys,
        values, keys.stride(0), eps, HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
        HEADS_P2=triton.next_power_of_2(heads + kv_heads), KV_P2=triton.next_power_of_2(kv_heads),
        HALF_P2=triton.next_power_of_2(head_dim // 2), HAS_BIAS=bias is not None, HAS_NORM=qk_norm is not None,
        num_warps=4)
    return q


@triton.jit
def _attend_kernel(q_ptr, keys_ptr, values_ptr, position_ptr, acc_ptr, best_ptr, total_ptr, out_ptr,
                   position_stride, scale, split_positions, splits, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DIM_P2: tl.constexpr, QUERIES: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Program (KV head h, split s): softmax-weighted values of positions s * split_positions .. up to the row's
    own, for h's query heads, in fp32 (bf16 keys and values widened exactly); the unnormalized sums with their
    running maximum and total where SPLIT, else the row's output."""
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seen = tl.load(position_ptr) + 1
    start = split * split_positions
    end = tl.minimum(start + split_positions, seen)
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
        part = (kv_head * splits + split) * QUERIES + query
        tl.store(best_ptr + part, best, mask=query < GROUP)
        tl.store(total_ptr + part, total, mask=query < GROUP)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dim[None, :], acc, mask=rows)
    else:
        out = acc / total[:, None]
        tl.store(out_ptr + (kv_head * GROUP + query)[:, None] * HEAD_DIM + dim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows)


@triton.jit
def _attend_combine_kernel(acc_ptr, best_ptr, total_ptr, out_ptr, splits, GROUP: tl.constexpr,
                           HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, QUERIES: tl.constexpr,
                           SPLITS_P2: tl.constexpr):
    """Program (query head): its splits' sums, each rescaled to the largest maximum, over their totals."""
    head = tl.program_id(0)
    kv_head = head // GROUP
    split = tl.arange(0, SPLITS_P2)
    part = (kv_head * splits + split) * QUERIES + head % GROUP
    best = tl.load(best_ptr + part, mask=split < splits, other=float("-inf"))
    top = tl.max(best, axis=0)
    weight = tl.where(best > float("-inf"), tl.exp(best - top), 0.0)  # a split past the row's position: none
    total = tl.sum(weight * tl.load(total_ptr + part, mask=split < splits, other=0.0), axis=0)
    dim = tl.arange(0, DIM_P2)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dim[None, :],
                  mask=(split < splits)[:, None] & (dim < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(weight[:, None] * acc, axis=0) / total
    tl.store(out_ptr + head * HEAD_DIM + dim, out.to(out_ptr.dtype.element_ty), mask=dim < HEAD_DIM)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
           scale: float) -> torch.Tensor:
    _, heads, head_dim = q.shape
    capacity, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    queries = max(ATTEND_QUERIES, triton.next_power_of_2(group))
    splits = min(MOST_SPLITS, triton.cdiv(capacity, SPLIT_POSITIONS))
    split_positions = triton.cdiv(triton.cdiv(capacity, splits), ATTEND_BLOCK) * ATTEND_BLOCK
    out = torch.empty(1, heads * head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        acc = torch.empty(kv_heads * splits * queries, head_dim, dtype=torch.float32, device=q.device)
        best = torch.empty(kv_heads * splits * queries, dtype=torch.float32, device=q.device)
        total = torch.empty_like(best)
    else:
        acc = best = total = out
    _attend_kernel[(kv_heads, splits)](
        q, keys, values, position, acc, best, total, out, keys.stride(0), scale, split_positions, splits,
        GROUP=group, HEAD_DIM=head_dim, DIM_P2=triton.next_power_of_2(head_dim), QUERIES=queries,
        BLOCK=ATTEND_BLOCK, SPLIT=splits > 1, num_warps=4)
    if splits > 1:
        _attend_combine_kernel[(heads,)](acc, best, total, out, splits, GROUP=group, HEAD_DIM=head_dim,
                                         DIM_P2=triton.next_power_of_2(head_dim), QUERIES=queries, SPLITS_P2=triton.next_power_of_2(splits), num_warps=4)
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
