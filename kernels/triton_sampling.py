"""Triton sampling: split-vocabulary radix select of the keep threshold, then an exponential race.

Same semantics as ``sampling.sample_reference``. No sort: top-k and top-p
both keep exactly the tokens whose z is >= some threshold (ties included),
and that threshold is found by an exact radix select over the 32-bit
order-preserving key of z, 8 bits per pass, most significant first
(RADIX_BITS; fewer bits would mean more launches, which cost the most):

    stats   (rows x vocab blocks)  per-block max, argmax and sum exp(z - max)
    top-k:  4 x [hist (rows x blocks): per-block 256-bin count histogram of
                 the next digit among keys that match the prefix so far;
                 select (rows): sum the blocks, pick the digit that holds
                 the k-th largest]                      -> key of k-th largest
    top-p:  4 x the same with probability mass instead of counts, over the
                 top-k survivors, target p * their mass -> key of the last kept
    draw    (rows x blocks)  per block, argmax over kept tokens of
             (z - max) - log(E), E = -log(U), U from Philox keyed by
             (seed, step, token index): Gumbel-max, an exact draw
    finish  (rows)           reduce the blocks: id, log_softmax(z)[id]

Every pass splits the vocabulary across programs, so batch 1 still fills
the GPU. Launch count and shapes depend only on (B, V), never on the row
parameters, so there is no host sync and the sequence can be captured in a
CUDA graph; a pass whose rows do not use top-k (or top-p) does no work.
Block reductions are summed in a fixed order: results are deterministic.
"""
import torch
import triton
import triton.language as tl

from tornchat.kernels.dispatch import interpreting
from tornchat.kernels.sampling import GREEDY_TEMPERATURE, LOGIT_CAP

GREEDY_T = tl.constexpr(GREEDY_TEMPERATURE)
CAP = tl.constexpr(LOGIT_CAP)
RADIX_BITS = 8

# Vocabulary per program. 4096 gives 12 programs per row for SmolLM2's
# 49,152 and 64 for a 262k vocabulary.
MAX_SPAN = 4096
# Elements per program for small vocabularies (several rows per program).
# The interpreter pays per operation, not per element, hence bigger tiles.
TILE = 1 << 16 if interpreting() else 4096
HIST_TILE = 1 << 20 if interpreting() else 8192  # elements of the one-hot [rows, chunk, bins] in registers
SELECT_TILE = 1 << 20 if interpreting() else 16384  # elements of [rows, blocks, bins] summed by select


@triton.jit
def _row_flags(t_ptr, k_ptr, p_ptr, rows, row_ok, V):
    t = tl.load(t_ptr + rows, mask=row_ok, other=1.0).to(tl.float32)
    k = tl.load(k_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    p = tl.load(p_ptr + rows, mask=row_ok, other=1.0).to(tl.float32)
    greedy = (t < GREEDY_T) | (k == 1)
    use_k = row_ok & ~greedy & (k > 1) & (k < V)
    use_p = row_ok & ~greedy & (p < 1.0)
    return t, k, p, greedy, use_k, use_p


@triton.jit
def _sanitize_scale(x, t, greedy):
    # NaN -> -inf and everything above LOGIT_CAP -> LOGIT_CAP, as sanitize_logits.
    # div_rn: IEEE division, so z matches torch's x / t bit for bit.
    x = x.to(tl.float32)
    x = tl.minimum(tl.where(x != x, float("-inf"), x), CAP)
    return tl.where(greedy, x, tl.math.div_rn(x, tl.where(greedy, 1.0, t)))


@triton.jit
def _load_z(logits_ptr, stride, rows, cols, mask, t, greedy):
    offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=mask, other=float("-inf"))
    return _sanitize_scale(x, t[:, None], greedy[:, None])


@triton.jit
def _order_key(z):
    """Key in [0, 2^32) with the order of z (-0.0 and 0.0 share a key, as they compare equal)."""
    z = tl.where(z == 0.0, 0.0, z)
    bits = z.to(tl.int32, bitcast=True)
    signed = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return signed.to(tl.int64) + 2147483648


@triton.jit
def _row_max(bmax_ptr, rows, row_ok, NB, NB_P2: tl.constexpr):
    blocks = tl.arange(0, NB_P2)
    offs = rows.to(tl.int64)[:, None] * NB + blocks[None, :]
    bmax = tl.load(bmax_ptr + offs, mask=row_ok[:, None] & (blocks < NB)[None, :], other=float("-inf"))
    m = tl.max(bmax, axis=1)
    return tl.where(m == float("-inf"), 0.0, m)  # all -inf rows: keep exp(z - m) at 0, not NaN


@triton.jit
def _stats_kernel(
    logits_ptr, stride, t_ptr, k_ptr, p_ptr, B, V, NB, bmax_ptr, barg_ptr, bsum_ptr,
    ROWS: tl.constexpr, SPAN: tl.constexpr,
):
    pid_v = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    cols = pid_v * SPAN + tl.arange(0, SPAN)
    t, k, p, greedy, use_k, use_p = _row_flags(t_ptr, k_ptr, p_ptr, rows, row_ok, V)
    z = _load_z(logits_ptr, stride, rows, cols, row_ok[:, None] & (cols < V)[None, :], t, greedy)
    m = tl.max(z, axis=1)
    arg = tl.argmax(z, axis=1, tie_break_left=True).to(tl.int64) + pid_v * SPAN
    safe_m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(z - safe_m[:, None]), axis=1)
    out = rows.to(tl.int64) * NB + pid_v
    tl.store(bmax_ptr + out, m, mask=row_ok)
    tl.store(barg_ptr + out, arg, mask=row_ok)
    tl.store(bsum_ptr + out, s, mask=row_ok)


@triton.jit
def _hist_kernel(
    logits_ptr, stride, t_ptr, k_ptr, p_ptr, B, V, NB, bmax_ptr, kth_ptr, prefix_ptr, hist_ptr,
    SHIFT: tl.constexpr, BITS: tl.constexpr, MASS: tl.constexpr, ROWS: tl.constexpr, SPAN: tl.constexpr,
    CHUNK: tl.constexpr, NB_P2: tl.constexpr,
):
    BINS: tl.constexpr = 1 << BITS
    pid_v = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    t, k, p, greedy, use_k, use_p = _row_flags(t_ptr, k_ptr, p_ptr, rows, row_ok, V)
    active = use_p if MASS else use_k
    if tl.max(active.to(tl.int32), axis=0) > 0:
        if SHIFT + BITS == 32:  # first pass: every key matches the empty prefix
            prefix = tl.zeros([ROWS], dtype=tl.int64)
        else:
            prefix = tl.load(prefix_ptr + rows, mask=row_ok, other=0)
        m = _row_max(bmax_ptr, rows, row_ok, NB, NB_P2)
        kth = tl.load(kth_ptr + rows, mask=row_ok, other=0)
        bins = tl.arange(0, BINS)
        hist = tl.zeros([ROWS, BINS], dtype=tl.float32)
        for start in tl.range(0, SPAN, CHUNK):
            cols = pid_v * SPAN + start + tl.arange(0, CHUNK)
            mask = row_ok[:, None] & (cols < V)[None, :]
            z = _load_z(logits_ptr, stride, rows, cols, mask, t, greedy)
            key = _order_key(z)
            sel = mask & active[:, None] & ((key >> (SHIFT + BITS)) == prefix[:, None])
            if MASS:
                sel = sel & (key >= kth[:, None])
                w = tl.where(sel, tl.exp(z - m[:, None]), 0.0)
            else:
                w = tl.where(sel, 1.0, 0.0)
            # Bin 0 holds the largest digit, so a prefix sum over bins runs from the top.
            rdigit = (BINS - 1 - ((key >> SHIFT) & (BINS - 1))).to(tl.int32)
            onehot = rdigit[:, :, None] == bins[None, None, :]
            hist += tl.sum(tl.where(onehot, w[:, :, None], 0.0), axis=1)
        offs = (rows.to(tl.int64)[:, None] * NB + pid_v) * BINS + bins[None, :]
        tl.store(hist_ptr + offs, hist, mask=row_ok[:, None])


@triton.jit
def _select_kernel(
    t_ptr, k_ptr, p_ptr, B, V, NB, hist_ptr, prefix_ptr, above_ptr, target_ptr,
    FIRST: tl.constexpr, BITS: tl.constexpr, MASS: tl.constexpr, ROWS: tl.constexpr, NB_P2: tl.constexpr,
):
    BINS: tl.constexpr = 1 << BITS
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    t, k, p, greedy, use_k, use_p = _row_flags(t_ptr, k_ptr, p_ptr, rows, row_ok, V)
    active = use_p if MASS else use_k
    bins = tl.arange(0, BINS)
    blocks = tl.arange(0, NB_P2)
    offs = (rows.to(tl.int64)[:, None, None] * NB + blocks[None, :, None]) * BINS + bins[None, None, :]
    ok = (active[:, None, None] & (blocks < NB)[None, :, None]) & (bins < BINS)[None, None, :]
    h = tl.sum(tl.load(hist_ptr + offs, mask=ok, other=0.0), axis=1)  # [ROWS, BINS]
    if FIRST:
        prefix = tl.zeros([ROWS], dtype=tl.int64)
        above = tl.zeros([ROWS], dtype=tl.float32)
        # The first pass sees every candidate: its total is the mass (or count) to cut.
        target = p * tl.sum(h, axis=1) if MASS else k.to(tl.float32)
        tl.store(target_ptr + rows, target, mask=row_ok)
    else:
        prefix = tl.load(prefix_ptr + rows, mask=row_ok, other=0)
        above = tl.load(above_ptr + rows, mask=row_ok, other=0.0)
        target = tl.load(target_ptr + rows, mask=row_ok, other=0.0)
    cum = tl.cumsum(h, axis=1)
    # First bin (from the top) where the running total reaches the target and
    # holds a token (top_p == 0 has target 0: the max survives). If float
    # round-off leaves the total short, the last bin: keep all of this prefix.
    reached = ((above[:, None] + cum) >= target[:, None]) & (cum > 0.0)
    j = tl.min(tl.where(reached, bins[None, :], BINS - 1), axis=1)
    above = above + tl.sum(tl.where(bins[None, :] < j[:, None], h, 0.0), axis=1)
    prefix = (prefix << BITS) + (BINS - 1 - j).to(tl.int64)
    # Rows without this truncation end with key 0: keep everything.
    tl.store(prefix_ptr + rows, tl.where(active, prefix, 0), mask=row_ok)
    tl.store(above_ptr + rows, above, mask=row_ok)


@triton.jit(do_not_specialize=["step"])
def _draw_kernel(
    logits_ptr, stride, t_ptr, k_ptr, p_ptr, seed_ptr, step, B, V, NB, bmax_ptr, kth_ptr, pth_ptr,
    bscore_ptr, bidx_ptr, ROWS: tl.constexpr, SPAN: tl.constexpr, NB_P2: tl.constexpr,
):
    pid_v = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    cols = pid_v * SPAN + tl.arange(0, SPAN)
    mask = row_ok[:, None] & (cols < V)[None, :]
    t, k, p, greedy, use_k, use_p = _row_flags(t_ptr, k_ptr, p_ptr, rows, row_ok, V)
    z = _load_z(logits_ptr, stride, rows, cols, mask, t, greedy)
    m = _row_max(bmax_ptr, rows, row_ok, NB, NB_P2)
    threshold = tl.maximum(tl.load(kth_ptr + rows, mask=row_ok, other=0), tl.load(pth_ptr + rows, mask=row_ok, other=0))
    keep = mask & (z > float("-inf")) & (_order_key(z) >= threshold[:, None])
    seed = tl.load(seed_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    counter = cols[None, :].to(tl.uint32) + tl.zeros([ROWS, SPAN], dtype=tl.uint32)
    zero = tl.zeros([ROWS, SPAN], dtype=tl.uint32)
    bits, _, _, _ = tl.philox(seed[:, None], counter, zero + step, zero, zero)
    # 23 random bits centred in their cell: U in (0, 1) exactly representable
    # (24 bits would round the top cell to 1.0), so E = -log(U) is finite and > 0.
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    # (z - m) rather than z: capped logits (1e30 / T) would swallow the noise.
    score = tl.where(keep, (z - m[:, None]) - tl.log(-tl.log(u)), float("-inf"))
    best = tl.max(score, axis=1)
    idx = tl.argmax(score, axis=1, tie_break_left=True).to(tl.int64) + pid_v * SPAN
    out = rows.to(tl.int64) * NB + pid_v
    tl.store(bscore_ptr + out, best, mask=row_ok)
    tl.store(bidx_ptr + out, idx, mask=row_ok)


@triton.jit
def _finish_kernel(
    logits_ptr, stride, t_ptr, k_ptr, p_ptr, B, V, NB, bmax_ptr, barg_ptr, bsum_ptr, bscore_ptr, bidx_ptr,
    ids_ptr, logprobs_ptr, ROWS: tl.constexpr, NB_P2: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    t, k, p, greedy, use_k, use_p = _row_flags(t_ptr, k_ptr, p_ptr, rows, row_ok, V)
    blocks = tl.arange(0, NB_P2)
    offs = rows.to(tl.int64)[:, None] * NB + blocks[None, :]
    ok = row_ok[:, None] & (blocks < NB)[None, :]
    bmax = tl.load(bmax_ptr + offs, mask=ok, other=float("-inf"))
    barg = tl.load(barg_ptr + offs, mask=ok, other=0)
    bsum = tl.load(bsum_ptr + offs, mask=ok, other=0.0)
    bscore = tl.load(bscore_ptr + offs, mask=ok, other=float("-inf"))
    bidx = tl.load(bidx_ptr + offs, mask=ok, other=0)

    m = tl.max(bmax, axis=1)
    no_finite = m == float("-inf")
    safe_m = tl.where(no_finite, 0.0, m)
    # The max term contributes exp(0) = 1, so only rows without a finite logit sum below 1.
    log_total = tl.log(tl.maximum(tl.sum(bsum * tl.exp(bmax - safe_m[:, None]), axis=1), 1.0))
    # Lowest block holding the max, then its lowest id: argmax with the lowest id on ties.
    top_block = tl.argmax(bmax, axis=1, tie_break_left=True)
    argmax_id = tl.sum(tl.where(blocks[None, :] == top_block[:, None], barg, 0), axis=1)
    draw_block = tl.argmax(bscore, axis=1, tie_break_left=True)
    drawn_id = tl.sum(tl.where(blocks[None, :] == draw_block[:, None], bidx, 0), axis=1)
    drawn = tl.max(bscore, axis=1) > float("-inf")
    token = tl.where(greedy | ~drawn, argmax_id, drawn_id)
    token = tl.where(no_finite, 0, token)

    x = tl.load(logits_ptr + rows.to(tl.int64) * stride + token, mask=row_ok, other=0.0)
    # (z - max) first, as log_softmax does: capped logits would swallow log_total.
    z = _sanitize_scale(x, t, greedy)
    tl.store(ids_ptr + rows, token, mask=row_ok)
    tl.store(logprobs_ptr + rows, tl.where(no_finite, float("-inf"), (z - safe_m) - log_total), mask=row_ok)


def _num_warps(elements: int) -> int:
    return max(1, min(8, elements // 512))


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_reference``'s contract, with Philox randomness keyed by (seed, step, token id).

    The row parameters must already be on the logits' device; nothing here
    reads a value back to the host.
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    span = min(MAX_SPAN, triton.next_power_of_2(vocab))
    nb = triton.cdiv(vocab, span)
    nb_p2 = triton.next_power_of_2(nb)
    rows = min(triton.next_power_of_2(batch), max(1, TILE // span))
    bins = 1 << RADIX_BITS
    chunk = max(1, min(span, HIST_TILE // (rows * bins)))
    select_rows = max(1, min(rows, SELECT_TILE // (nb_p2 * bins)))
    grid = (triton.cdiv(batch, rows), nb)
    select_grid = (triton.cdiv(batch, select_rows),)
    tile_warps = _num_warps(rows * span)

    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    bmax, bsum, bscore = (torch.empty(batch, nb, **f32) for _ in range(3))
    barg, bidx = (torch.empty(batch, nb, **i64) for _ in range(2))
    hist = torch.empty(batch, nb, bins, **f32)
    above, target = torch.empty(batch, **f32), torch.empty(batch, **f32)
    kth, pth = torch.empty(batch, **i64), torch.empty(batch, **i64)
    ids, logprobs = torch.empty(batch, **i64), torch.empty(batch, **f32)
    row_args = (temperature, top_k, top_p)

    _stats_kernel[grid](
        logits, logits.stride(0), *row_args, batch, vocab, nb, bmax, barg, bsum,
        ROWS=rows, SPAN=span, num_warps=tile_warps,
    )
    for mass, prefix in ((False, kth), (True, pth)):
        for i, shift in enumerate(range(32 - RADIX_BITS, -1, -RADIX_BITS)):
            _hist_kernel[grid](
                logits, logits.stride(0), *row_args, batch, vocab, nb, bmax, kth, prefix, hist,
                SHIFT=shift, BITS=RADIX_BITS, MASS=mass, ROWS=rows, SPAN=span, CHUNK=chunk, NB_P2=nb_p2,
                num_warps=_num_warps(rows * chunk * bins),
            )
            _select_kernel[select_grid](
                *row_args, batch, vocab, nb, hist, prefix, above, target,
                FIRST=i == 0, BITS=RADIX_BITS, MASS=mass, ROWS=select_rows, NB_P2=nb_p2,
                num_warps=_num_warps(select_rows * nb_p2 * bins),
            )
    _draw_kernel[grid](
        logits, logits.stride(0), *row_args, seed, step, batch, vocab, nb, bmax, kth, pth, bscore, bidx,
        ROWS=rows, SPAN=span, NB_P2=nb_p2, num_warps=tile_warps,
    )
    _finish_kernel[(triton.cdiv(batch, rows),)](
        logits, logits.stride(0), *row_args, batch, vocab, nb, bmax, barg, bsum, bscore, bidx, ids, logprobs,
        ROWS=rows, NB_P2=nb_p2, num_warps=_num_warps(rows * nb_p2),
    )
    return ids, logprobs
