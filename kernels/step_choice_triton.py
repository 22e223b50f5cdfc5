"""The end-of-step kernels (semantics and references: ``step_choice``).

greedy: programs (row, block of BLOCK ids) each store their block's largest
sanitized logit and the lowest id holding it; one program per row then takes
the largest of those, the lowest id on ties. Two launches, one where a row
fits in one block. At batch 1 the row is split so that a large vocabulary is
read by many programs at once: 262,144 logits take about 2.6 us for both
launches replayed in a CUDA graph on an H200 (torch.argmax: 8.6 us), about
what two launches cost there.

advance: one program per row, one launch; its stop check is
``stopcheck_triton.stop_hit``, the stop-check kernel's own.

Every value that changes between replays of a captured graph is read from a
tensor; the Python numbers passed (shapes, strides, block sizes) are fixed
by the shapes captured.
"""
import torch
import triton
import triton.language as tl

from tornchat.kernels.dispatch import interpreting
from tornchat.kernels.sampling import LOGIT_CAP
from tornchat.kernels.stopcheck_triton import stop_hit

MIN_BLOCK, MAX_BLOCK = 1024, 8192  # ids per program of greedy
TARGET_BLOCKS = 128  # per row: enough programs to draw on most of a large GPU's bandwidth at batch 1


@triton.jit
def _greedy_block_kernel(logits_ptr, stride, vocab, best_ptr, at_ptr, ids_ptr,
                         CAP: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """Program (row, block): the block's largest sanitized logit and its lowest id; where WHOLE_ROW (one block
    per row), that id is the row's."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    ids = block * BLOCK + tl.arange(0, BLOCK)
    inside = ids < vocab
    x = tl.load(logits_ptr + row * stride + ids, mask=inside, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), tl.minimum(x, CAP))
    best = tl.max(x, axis=0)
    # -0.0 == 0.0 here, as in torch's argmax: the lower id wins whichever sign the maximum kept.
    at = tl.min(tl.where(inside & (x == best), ids, vocab), axis=0)
    if WHOLE_ROW:
        tl.store(ids_ptr + row, at.to(tl.int64))
    else:
        blocks = tl.num_programs(1)
        tl.store(best_ptr + row * blocks + block, best)
        tl.store(at_ptr + row * blocks + block, at)


@triton.jit
def _greedy_combine_kernel(best_ptr, at_ptr, ids_ptr, blocks, BLOCKS_P2: tl.constexpr):
    """Program (row): the id of the largest of its blocks' maxima, the lowest on ties (blocks ascend by id, and
    an all -inf row ties every block at -inf, giving block 0's id 0)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.arange(0, BLOCKS_P2)
    real = part < blocks
    best = tl.load(best_ptr + row * blocks + part, mask=real, other=float("-inf"))
    at = tl.load(at_ptr + row * blocks + part, mask=real, other=0)
    top = tl.max(best, axis=0)
    tl.store(ids_ptr + row, tl.min(tl.where(real & (best == top), at, 2147483647), axis=0).to(tl.int64))


def greedy_block(vocab: int) -> int:
    """Ids per program of ``greedy`` for a row of ``vocab`` logits."""
    if interpreting():  # the interpreter pays per program, not per element: one program per row there
        return triton.next_power_of_2(vocab)
    wanted = triton.next_power_of_2(triton.cdiv(vocab, TARGET_BLOCKS))
    return min(max(wanted, MIN_BLOCK), MAX_BLOCK, triton.next_power_of_2(vocab))


def greedy(logits: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """ids [M] int64 of logits [M, V] (any float dtype, compared in fp32); no host synchronisation.

    ``block`` (a power of two) overrides the ids per program, so that the combine can be tested on small
    vocabularies.
    """
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = block or greedy_block(vocab)
    blocks = triton.cdiv(vocab, block)
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    num_warps = min(8, max(1, block // 512))
    if blocks == 1:
        _greedy_block_kernel[(rows, 1)](logits, logits.stride(0), vocab, ids, ids, ids,
                                        CAP=LOGIT_CAP, BLOCK=block, WHOLE_ROW=True, num_warps=num_warps)
        return ids
    best = torch.empty(rows, blocks, dtype=torch.float32, device=logits.device)
    at = torch.empty(rows, blocks, dtype=torch.int32, device=logits.device)
    _greedy_block_kernel[(rows, blocks)](logits, logits.stride(0), vocab, best, at, ids,
                                         CAP=LOGIT_CAP, BLOCK=block, WHOLE_ROW=False, num_warps=num_warps)
    _greedy_combine_kernel[(rows,)](best, at, ids, blocks, BLOCKS_P2=triton.next_power_of_2(blocks), num_warps=1)
    return ids


@triton.jit
def _advance_kernel(ids_ptr, tokens_ptr, positions_ptr, index_ptr, window_ptr, window_stride, out_ptr,
                    final_ptr, cont_ptr, done_ptr, length_ptr, vocab,
                    WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr, NUM_STOPS: tl.constexpr, STOPS_P2: tl.constexpr):
    """Program (row): the row advanced by its id, and checked; program 0 also counts the step in index."""
    row = tl.program_id(0).to(tl.int64)
    newest = tl.load(ids_ptr + row).to(tl.int64)
    window_row = window_ptr + row * window_stride
    slot = tl.arange(0, WIDTH_P2)
    kept = tl.load(window_row + 1 + slot, mask=slot < WIDTH - 1, other=-1)  # the WIDTH - 1 newest ids stay
    # The check reads the window before the shift: the ids before the newest are its last WIDTH - 1.
    finished = stop_hit(newest, window_row + WIDTH - 1, WIDTH - 1, final_ptr, cont_ptr, done_ptr, length_ptr,
                        vocab, NUM_STOPS, STOPS_P2)
    # The shift overwrites ids that other threads of the program read above: every read comes first.
    tl.debug_barrier()
    tl.store(window_row + slot, tl.where(slot == WIDTH - 1, newest, kept), mask=slot < WIDTH)
    tl.store(tokens_ptr + row, newest)
    tl.store(positions_ptr + row, tl.load(positions_ptr + row) + 1)
    first = row == 0
    tl.store(index_ptr, tl.load(index_ptr, mask=first, other=0) + 1, mask=first)
    tl.store(out_ptr + row * 2, newest)
    tl.store(out_ptr + row * 2 + 1, finished.to(tl.int64))


def advance(ids: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
            window: torch.Tensor, table, out: torch.Tensor) -> None:
    """``step_choice.advance_ref``'s changes, in one launch; no host synchronisation."""
    rows, width = window.shape
    if window.stride(1) != 1 or not out.is_contiguous():
        raise ValueError("advance works in place: window's rows and out must be contiguous")
    stops = table.final.shape[0]
    _advance_kernel[(rows,)](
        ids, tokens, positions, index, window, window.stride(0), out,
        table.final, table.cont, table.done, table.length, table.final.shape[1],
        WIDTH=width, WIDTH_P2=triton.next_power_of_2(width), NUM_STOPS=stops,
        STOPS_P2=triton.next_power_of_2(stops), num_warps=1,
    )
