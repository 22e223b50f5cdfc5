"""The end of the CUDA decode step: choose each row's token, then advance the row by it and check for a stop.

Captured at the end of the step's graph, these let one replay yield each
row's token and whether it ended the reply, so that the host reads one small
tensor per step instead of the logits.

``greedy(logits [M, V]) -> ids [M] int64`` is the sampler's greedy rule
(``sampling``'s rules 1-2, without the log-probability): NaN counts as -inf
and any value above LOGIT_CAP (+inf too) as LOGIT_CAP; the argmax of that,
the lowest id on ties, so a row with no finite logit yields token 0.

``advance(ids, tokens, positions, index, window, table, out)`` changes its
buffers in place. For each row r:

- tokens[r] = ids[r] and positions[r] += 1: the next step's input;
- window[r], the last W generated ids (-1 before the first), shifts left by
  one and ends with ids[r];
- out[r] = (ids[r], finished), finished 1 if ids[r] ended the reply by
  ``stopcheck``'s rule on the shifted window (an EOS id of the table, or an
  occurrence of a stop string that ends inside ids[r]), else 0;

and index[0] += 1 once for all rows (the reply's token index, by which the
sampler keys its randomness). In the check an id that the table does not
cover (an id of logits wider than the tokenizer's vocabulary) counts as -1:
it finishes nothing, and nothing before it counts.

The shapes: ids, tokens, positions int64 [M]; index int32 [1]; window int64
[M, W]; out int64 [M, 2]; the table's tensors as ``build_stop_table`` makes
them, on the same device.

A captured graph keeps the addresses and shapes it was captured with, and
reads everything else from memory at each replay: the engine sizes its
window WINDOW wide, pads each request's table to MAX_STOP_STRINGS rows with
``padded_table`` and copies it into the tensors it captured with, and resets
the window to -1 at the start of each reply.
"""
import dataclasses

import torch

from tornchat.kernels import dispatch
from tornchat.kernels.sampling import sanitize_logits
from tornchat.kernels.stopcheck import MAX_STOP_BYTES, MAX_STOP_STRINGS, StopTable, stop_hit_reference

# Ids a window holds: a stop string of MAX_STOP_BYTES bytes spans at most that many tokens where each adds a byte
# or more. Tokens that add none (special tokens) lengthen the span: a stop string spread over more than WINDOW
# tokens goes unseen.
WINDOW = MAX_STOP_BYTES


def padded_table(table: StopTable, stops: int = MAX_STOP_STRINGS) -> StopTable:
    """The same table with ``stops`` rows of masks: the added rows are zero, a stop string that nothing matches,
    so every check gives what it gives on ``table``."""
    rows = table.final.shape[0]
    if rows > stops:
        raise ValueError(f"a table of {rows} stop strings does not fit in {stops} rows")

    def pad(masks: torch.Tensor) -> torch.Tensor:
        return torch.cat([masks, masks.new_zeros(stops - rows, masks.shape[1])])

    return dataclasses.replace(table, final=pad(table.final), cont=pad(table.cont), done=pad(table.done))


def greedy_ref(logits: torch.Tensor) -> torch.Tensor:
    """ids [M] int64: the argmax of each row of sanitized logits [M, V], the lowest id on ties (torch's argmax
    gives the first maximal index), so 0 where no logit is finite."""
    return torch.argmax(sanitize_logits(logits), dim=-1)


def advance_ref(ids: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
                window: torch.Tensor, table: StopTable, out: torch.Tensor) -> None:
    """The buffers changed as the module docstring says, with ``stop_hit_reference`` as the check."""
    tokens.copy_(ids)
    positions.add_(1)
    index.add_(1)
    window.copy_(torch.cat([window[:, 1:], ids[:, None].to(window.dtype)], dim=1))
    vocab = len(table.vocab)
    finished = [stop_hit_reference([t if 0 <= t < vocab else -1 for t in row], table) for row in window.tolist()]
    out[:, 0] = ids
    out[:, 1] = torch.tensor(finished, dtype=out.dtype)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``greedy_ref``'s ids: CUDA tensors (or any, with TORNCHAT_TRITON_INTERPRET=1) take the Triton kernels,
    which need no host synchronisation; elsewhere the reference."""
    if dispatch.use_triton(logits):
        return dispatch.triton_module("step_choice_triton").greedy(logits)
    return greedy_ref(logits)


def advance(ids: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
            window: torch.Tensor, table: StopTable, out: torch.Tensor) -> None:
    """``advance_ref``'s changes: CUDA tensors (or any, with TORNCHAT_TRITON_INTERPRET=1) take the Triton kernel,
    one launch with no host value read; elsewhere the reference."""
    if dispatch.use_triton(ids):
        dispatch.triton_module("step_choice_triton").advance(ids, tokens, positions, index, window, table, out)
    else:
        advance_ref(ids, tokens, positions, index, window, table, out)
