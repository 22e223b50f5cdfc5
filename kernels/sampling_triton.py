"""Fused temperature / top-k / top-p sampling in Triton, without a sort.

Same semantics as ``sampling.sample_reference`` (read its docstring). The
vocabulary of every row is split into blocks of BLOCK tokens, one program per
(row, block), so batch 1 still fills the GPU. A fixed sequence of launches,
with no host synchronisation and no data-dependent launch count:

1. stats: row max with its lowest index (the greedy answer), row min over
   finite values.
2. top-k threshold search, SEARCH_PASSES launches. The keep sets have a
   closed form: token i survives top-k iff fewer than k tokens have a
   strictly larger z, and survives top-p iff the mass strictly above it is
   below p times the top-k mass. Both predicates are monotone in a value c,
   so the smallest kept value is found by a PIVOTS-way search over the
   order-preserving int32 keys of fp32: each pass evaluates count(z > pivot)
   at PIVOTS pivots, accumulated across blocks by integer atomics, and the
   next pass narrows the interval to the segment where the predicate turns
   true. 2^32 keys need SEARCH_PASSES passes; the result is exact, ties
   included, like the reference's sort.
3. top-p threshold search, SEARCH_PASSES launches, over [tau_k, max] with
   mass(z > pivot). Masses are exp(z - max) in 2^-40 fixed point, so the
   atomic sums are exact integers: the same inputs give the same threshold
   whatever order the blocks finish in.
4. draw: exponential race (Gumbel-max) with Philox keyed by (seed, step,
   token index): argmax over kept tokens of (z - max) - log(E), E ~ Exp(1).
   The per-block winner is packed (score key, inverted index) into an int64
   and reduced with atomic_max: the row winner, lowest index on ties.
   The same launch accumulates sum(exp(z - max)) for the log-probability.
5. finalize: one program per row writes ids and log-probabilities.

On a GPU, ``sample`` replays the sequence from a CUDA graph captured once
per shape, so a decode step pays one launch instead of fifteen.

A program only reads what earlier launches wrote (atomic totals, and the
interval each pass stores), so no program ever waits on another within a
launch. Rows that need no search (greedy, or k and p inactive) return at once
from the search launches.
"""
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tornchat.kernels.sampling import GREEDY_TEMPERATURE, LOGIT_CAP

PIVOTS = 63  # per pass; 64-way narrowing
SEARCH_PASSES = math.ceil(32 / math.log2(PIVOTS + 1))  # 2^32 int32 keys down to one
MIN_BLOCK, MAX_BLOCK = 256, 2048  # tokens per program
TARGET_PROGRAMS = 1024  # enough to fill a large GPU at batch 1; big batches get big blocks
# Fixed-point scale of masses exp(z - max) <= 1: sums over up to 2^22 tokens fit in int64.
FIXED_ONE = tl.constexpr(2.0**40)

# Workspace columns per row (int64, zero-initialised: zero is the identity of
# every atomic used on it): argmax, min, sum of exp, top-k mass; the search
# interval [lo, hi] of each pass of each phase; SEARCH_PASSES * PIVOTS counts,
# as many masses; one winner per draw.
COL_ARGMAX, COL_MIN, COL_SUMEXP, COL_TOPK_MASS = (tl.constexpr(c) for c in range(4))
COL_BOUNDS = tl.constexpr(4)  # top-k bounds at + 2 * pass, top-p bounds after them
COL_TOTALS = tl.constexpr(4 + 4 * SEARCH_PASSES)
COL_DRAWS = tl.constexpr(COL_TOTALS + 2 * SEARCH_PASSES * PIVOTS)

# Kernels name every value they unpack, never `_`: Triton's compiler (unlike
# its interpreter) rejects a name that changes type across an if or a loop.

# The interpreter runs programs one after another in numpy, and every call of
# a @triton.jit helper costs milliseconds there (it re-patches triton.language):
# helpers are few and flat, and tiles are wide when interpreting. On a GPU the
# [SUB, PIV_P2] compare tile must fit in registers.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"


@triton.jit
def _pack(key, index):
    """int64 that orders by key, then by lower index: atomic_max gives argmax, first on ties."""
    return ((key.to(tl.int64) + 2147483648) << 31) | (2147483647 - index.to(tl.int64))


@triton.jit
def _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr, vocab, GREEDY_T: tl.constexpr):
    t = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    greedy = (t < GREEDY_T) | (k == 1)
    scale = tl.where(greedy, 1.0, t)  # greedy rows work on the raw logits
    use_k = (not greedy) & (k > 1) & (k < vocab)
    use_p = (not greedy) & (p < 1.0)
    return scale, greedy, use_k, use_p, k, p


@triton.jit
def _load_z(logits_ptr, row_start, offs, vocab, scale, CAP: tl.constexpr):
    """(z, key of z): z = sanitised logits / scale, -inf outside the vocabulary."""
    x = tl.load(logits_ptr + row_start + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    x = tl.minimum(x, CAP)
    # IEEE division, as torch does it: a faster approximate one could merge or
    # split ties relative to the reference.
    z = tl.math.div_rn(x, scale)
    z = tl.where(z == 0.0, 0.0, z)  # -0.0 -> +0.0 so equal values get equal keys
    bits = z.to(tl.int32, bitcast=True)
    return z, bits ^ ((bits >> 31) & 0x7FFFFFFF)  # order-preserving int32 key


@triton.jit
def _row_extremes(ws_row):
    """The row max (value and key), its lowest index, and the key of the smallest finite value."""
    packed = tl.load(ws_row + COL_ARGMAX)
    max_key = ((packed >> 31) - 2147483648).to(tl.int32)
    argmax = 2147483647 - (packed & 2147483647)
    min_key = ((4294967295 - tl.load(ws_row + COL_MIN)) - 2147483648).to(tl.int32)
    max_bits = max_key ^ ((max_key >> 31) & 0x7FFFFFFF)
    return max_bits.to(tl.float32, bitcast=True), max_key.to(tl.int64), argmax, min_key.to(tl.int64)


@triton.jit
def _narrow(ws_row, phase, t, limit, IS_MASS: tl.constexpr, PASSES: tl.constexpr, PIVOTS: tl.constexpr, PIV_P2: tl.constexpr):
    """Interval after pass t of a search: the smallest key whose predicate holds lies in [lo, hi].

    Pass t evaluated the predicate at p_m = lo - 1 + size * m // (PIVOTS + 1),
    m = 1..PIVOTS, over its interval; the answer lies above the last pivot
    where it failed and at or below the first where it held.
    """
    bounds = ws_row + COL_BOUNDS + 2 * (phase * PASSES + t)
    lo = tl.load(bounds)
    hi = tl.load(bounds + 1)
    j = tl.arange(0, PIV_P2)
    total = tl.load(ws_row + COL_TOTALS + (phase * PASSES + t) * PIVOTS + j, mask=j < PIVOTS, other=0)
    if IS_MASS:
        holds = (total.to(tl.float64) < limit) | (total == 0)
    else:
        holds = total < limit
    first = tl.min(tl.where(holds & (j < PIVOTS), j, PIVOTS)).to(tl.int64)
    size = hi - lo + 1
    new_lo = lo + (size * first) // (PIVOTS + 1)
    return new_lo, tl.maximum(lo - 1 + (size * (first + 1)) // (PIVOTS + 1), new_lo)


@triton.jit
def _stats_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, ws_ptr, ws_stride, vocab,
    GREEDY_T: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    scale = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr, vocab, GREEDY_T)[0]
    z, keys = _load_z(logits_ptr, row * stride, offs, vocab, scale, CAP)
    ws_row = ws_ptr + row * ws_stride
    tl.atomic_max(ws_row + COL_ARGMAX, tl.max(_pack(keys, offs), axis=0))
    smallest = tl.min(tl.where(z > float("-inf"), keys, 2147483647), axis=0)
    # Stored complemented so that max, with identity zero, computes a min.
    tl.atomic_max(ws_row + COL_MIN, 4294967295 - (smallest.to(tl.int64) + 2147483648))


@triton.jit
def _search_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, ws_ptr, ws_stride, vocab, t,
    TOP_P: tl.constexpr, GREEDY_T: tl.constexpr, CAP: tl.constexpr, PASSES: tl.constexpr,
    PIVOTS: tl.constexpr, PIV_P2: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
):
    """Pass t of one search: narrow by the totals of pass t - 1, then count or weigh above new pivots.

    Every program computes the same interval; the first one stores it for the next pass.
    """
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    scale, greedy, use_k, use_p, k, p = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr, vocab, GREEDY_T)
    active = use_p if TOP_P else use_k
    if active:
        ws_row = ws_ptr + row * ws_stride
        zmax, max_key, argmax, min_key = _row_extremes(ws_row)
        if TOP_P:
            tau_k = min_key
            if use_k:
                lo_k, tau_k = _narrow(ws_row, 0, PASSES - 1, k, False, PASSES, PIVOTS, PIV_P2)
            lo, hi = tau_k, max_key
            if t > 0:
                limit = p.to(tl.float64) * tl.load(ws_row + COL_TOPK_MASS).to(tl.float64)
                lo, hi = _narrow(ws_row, 1, t - 1, limit, True, PASSES, PIVOTS, PIV_P2)
        else:
            lo, hi = min_key, max_key
            if t > 0:
                lo, hi = _narrow(ws_row, 0, t - 1, k, False, PASSES, PIVOTS, PIV_P2)
        phase_pass = TOP_P * PASSES + t
        tl.store(ws_row + COL_BOUNDS + 2 * phase_pass, lo, mask=block == 0)
        tl.store(ws_row + COL_BOUNDS + 2 * phase_pass + 1, hi, mask=block == 0)
        j = tl.arange(0, PIV_P2)
        pivots = (lo - 1 + ((hi - lo + 1) * (j + 1)) // (PIVOTS + 1)).to(tl.int32)
        masses = tl.zeros([PIV_P2], dtype=tl.int64)
        counts = tl.zeros([PIV_P2], dtype=tl.int32)  # a block's counts fit; int64 arithmetic is slow on GPUs
        top_k_mass = tl.zeros([SUB], dtype=tl.int64)
        for start in range(0, BLOCK, SUB):
            offs = block * BLOCK + start + tl.arange(0, SUB)
            z, keys = _load_z(logits_ptr, row * stride, offs, vocab, scale, CAP)
            above = keys[:, None] > pivots[None, :]
            if TOP_P:
                mass = (tl.exp(z - zmax) * FIXED_ONE).to(tl.int64)
                masses += tl.sum(tl.where(above, mass[:, None], 0), axis=0)
                top_k_mass += tl.where(keys >= tau_k, mass, 0)
            else:
                counts += tl.sum(above.to(tl.int32), axis=0)
        totals_ptr = ws_row + COL_TOTALS + phase_pass * PIVOTS + j
        if TOP_P:
            tl.atomic_add(totals_ptr, masses, mask=j < PIVOTS)
        else:
            tl.atomic_add(totals_ptr, counts.to(tl.int64), mask=j < PIVOTS)
        if TOP_P:
            if t == 0:
                tl.atomic_add(ws_row + COL_TOPK_MASS, tl.sum(top_k_mass, axis=0))


@triton.jit
def _draw_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, ws_ptr, ws_stride, vocab, step_ptr, draws,
    GREEDY_T: tl.constexpr, CAP: tl.constexpr, PASSES: tl.constexpr, PIVOTS: tl.constexpr,
    PIV_P2: tl.constexpr, BLOCK: tl.constexpr, DRAW_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    scale, greedy, use_k, use_p, k, p = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr, vocab, GREEDY_T)
    ws_row = ws_ptr + row * ws_stride
    zmax, max_key, argmax, min_key = _row_extremes(ws_row)
    if zmax > float("-inf"):
        z, keys = _load_z(logits_ptr, row * stride, offs, vocab, scale, CAP)
        tl.atomic_add(ws_row + COL_SUMEXP, tl.sum((tl.exp(z - zmax) * FIXED_ONE).to(tl.int64), axis=0))
        if not greedy:
            tau = min_key
            if use_k:
                lo_k, tau = _narrow(ws_row, 0, PASSES - 1, k, False, PASSES, PIVOTS, PIV_P2)
            if use_p:
                limit = p.to(tl.float64) * tl.load(ws_row + COL_TOPK_MASS).to(tl.float64)
                lo_p, tau = _narrow(ws_row, 1, PASSES - 1, limit, True, PASSES, PIVOTS, PIV_P2)
            # tau >= the smallest finite key, so -inf (and padding) never survives.
            kept = keys >= tau
            seed = tl.load(seed_ptr + row)
            step = tl.load(step_ptr)  # from memory, so that a captured CUDA graph serves every step
            for d0 in range(0, draws, DRAW_BLOCK):
                d = d0 + tl.arange(0, DRAW_BLOCK)
                counter = tl.broadcast_to(offs[None, :], (DRAW_BLOCK, BLOCK))
                draw_step = tl.broadcast_to((step + d)[:, None], (DRAW_BLOCK, BLOCK))
                bits = tl.random.philox(seed, counter, draw_step, 0, 0)[0]
                u = tl.random.uint_to_uniform_float(bits)  # [0, 1)
                # E = -log(1 - u) lies in [0, 16.7]: the score of a kept token is
                # never -inf (E = 0 gives +inf, and ties go to the lowest id).
                score = (z - zmax)[None, :] - tl.log(-tl.log(1.0 - u))
                score = tl.where(score == 0.0, 0.0, score)
                score_bits = score.to(tl.int32, bitcast=True)
                packed = _pack(score_bits ^ ((score_bits >> 31) & 0x7FFFFFFF), counter)
                packed = tl.where(kept[None, :], packed, 0)
                tl.atomic_max(ws_row + COL_DRAWS + d, tl.max(packed, axis=1), mask=d < draws)


@triton.jit
def _finalize_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, ws_ptr, ws_stride, vocab, draws, ids_ptr, logprobs_ptr,
    GREEDY_T: tl.constexpr, CAP: tl.constexpr, DRAW_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scale, greedy, use_k, use_p, k, p = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr, vocab, GREEDY_T)
    ws_row = ws_ptr + row * ws_stride
    zmax, max_key, argmax, min_key = _row_extremes(ws_row)
    finite = zmax > float("-inf")
    log_sum = tl.log((tl.load(ws_row + COL_SUMEXP).to(tl.float64) / FIXED_ONE).to(tl.float32))
    for d0 in range(0, draws, DRAW_BLOCK):
        d = d0 + tl.arange(0, DRAW_BLOCK)
        mask = d < draws
        winner = 2147483647 - (tl.load(ws_row + COL_DRAWS + d, mask=mask, other=0) & 2147483647)
        ids = tl.where(greedy, argmax, winner)
        ids = tl.where(finite, ids, 0)
        ids = tl.minimum(tl.maximum(ids, 0), vocab - 1)
        z, keys = _load_z(logits_ptr, row * stride, ids, vocab, scale, CAP)
        logprobs = tl.where(finite, z - zmax - log_sum, float("-inf"))
        tl.store(ids_ptr + row * draws + d, ids, mask=mask)
        tl.store(logprobs_ptr + row * draws + d, logprobs, mask=mask)


def sample_draws(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: int,
    draws: int = 1,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `draws` tokens per row, draw d keyed by step + d. Returns ([B, draws] int64, [B, draws] fp32).

    ``block`` (a power of two) overrides the tokens per program, so that the
    cross-block reductions can be tested on small vocabularies.

    Draw d is exactly what ``sample`` returns at step + d for the same
    logits, so many draws in one launch test the distribution cheaply.
    No host synchronisation: every launch is queued on the current stream.
    """
    device = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    step_tensor = torch.full((1,), step, dtype=torch.int32, device=device)
    return _launch(logits, *_row_tensors(temperature, top_k, top_p, seed, device), step_tensor, draws, block)


def _row_tensors(temperature, top_k, top_p, seed, device) -> tuple[torch.Tensor, ...]:
    """The per-row parameters in the dtypes the kernels read."""
    return (
        temperature.to(device=device, dtype=torch.float32),
        top_k.to(device=device, dtype=torch.int64),
        top_p.to(device=device, dtype=torch.float32),
        seed.to(device=device, dtype=torch.int64),
    )


def _launch(logits, temperature, top_k, top_p, seed, step, draws, block):
    """The fixed launch sequence; every tensor it reads is an argument, so it can be captured as a graph."""
    batch, vocab = logits.shape
    device = logits.device
    if block is None:
        # The interpreter pays per call, not per element: one program per row there.
        if INTERPRETING:
            block = triton.next_power_of_2(vocab)
        else:
            # Each program walks its block serially, once per search pass: small blocks at batch 1.
            wanted = triton.next_power_of_2(triton.cdiv(batch * vocab, TARGET_PROGRAMS))
            block = min(max(wanted, MIN_BLOCK), MAX_BLOCK, triton.next_power_of_2(vocab))
    if INTERPRETING:
        sub, draw_block = min(block, 4096), min(triton.next_power_of_2(draws), max(1, (1 << 18) // block))
    else:
        sub, draw_block = min(block, 32), 1
    grid = (batch, triton.cdiv(vocab, block))
    ws = torch.zeros(batch, COL_DRAWS.value + draws, dtype=torch.int64, device=device)
    common = dict(GREEDY_T=GREEDY_TEMPERATURE, CAP=LOGIT_CAP)
    search = dict(PASSES=SEARCH_PASSES, PIVOTS=PIVOTS, PIV_P2=triton.next_power_of_2(PIVOTS))
    row_args = (logits, logits.stride(0), temperature, top_k, top_p)

    _stats_kernel[grid](*row_args, ws, ws.stride(0), vocab, BLOCK=block, num_warps=8, **common)
    for top_p_phase in (False, True):
        for t in range(SEARCH_PASSES):
            _search_kernel[grid](
                *row_args, ws, ws.stride(0), vocab, t, TOP_P=top_p_phase,
                BLOCK=block, SUB=sub, num_warps=8, **common, **search,
            )
    _draw_kernel[grid](
        *row_args, seed, ws, ws.stride(0), vocab, step, draws,
        BLOCK=block, DRAW_BLOCK=draw_block, num_warps=8, **common, **search,
    )
    ids = torch.empty(batch, draws, dtype=torch.int64, device=device)
    logprobs = torch.empty(batch, draws, dtype=torch.float32, device=device)
    _finalize_kernel[(batch,)](
        *row_args, ws, ws.stride(0), vocab, draws, ids, logprobs,
        DRAW_BLOCK=min(triton.next_power_of_2(draws), 1024), num_warps=1, **common,
    )
    return ids, logprobs


def sample_at(logits, temperature, top_k, top_p, seed, step: torch.Tensor) -> torch.Tensor:
    """``sample``'s ids [B] with the step read from the device tensor ``step`` (int32 [1]) and the per-row
    parameters as given (float32, int64, float32, int64 tensors on the logits' device): every value read from
    memory, so the launches can be captured in a graph of the caller's and replayed at later steps."""
    ids, _ = _launch(logits, temperature, top_k, top_p, seed, step, 1, None)
    return ids[:, 0]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]  # logits, temperature, top_k, top_p, seed, step: copied into before replay
    outputs: tuple[torch.Tensor, torch.Tensor]


_graphs: dict[tuple, _Graph] = {}  # one per (shape, dtype, device); the engine uses one


def _graph_for(logits, rows) -> _Graph:
    """Capture the launch sequence once per shape: a replay costs one launch instead of 15 (~40 us each)."""
    key = (tuple(logits.shape), logits.dtype, logits.device)
    if key not in _graphs:
        inputs = (logits.clone(memory_format=torch.contiguous_format), *(r.clone() for r in rows),
                  torch.zeros(1, dtype=torch.int32, device=logits.device))
        side = torch.cuda.Stream(logits.device)
        side.wait_stream(torch.cuda.current_stream(logits.device))
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            _launch(*inputs, 1, None)
        torch.cuda.current_stream(logits.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = _launch(*inputs, 1, None)
        _graphs[key] = _Graph(graph, inputs, outputs)
    return _graphs[key]


def sample(logits, temperature, top_k, top_p, seed, step):
    """The Triton path of ``tornchat.kernels.sample``: same contract as the reference.

    On a GPU the launches replay from a CUDA graph captured for this shape;
    inputs are copied into its buffers on the stream, so still no host sync.
    """
    if INTERPRETING or not logits.is_cuda:
        ids, logprobs = sample_draws(logits, temperature, top_k, top_p, seed, step)
        return ids[:, 0], logprobs[:, 0]
    rows = _row_tensors(temperature, top_k, top_p, seed, logits.device)
    graphed = _graph_for(logits, rows)
    for buffer, value in zip(graphed.inputs, (logits, *rows)):
        buffer.copy_(value)
    graphed.inputs[-1].fill_(step)
    graphed.graph.replay()
    ids, logprobs = graphed.outputs
    return ids[:, 0].clone(), logprobs[:, 0].clone()
