"""The stop-check kernel (semantics and table layout: ``stopcheck``)."""
import torch
import triton
import triton.language as tl


@triton.jit
def stop_hit(newest, before_ptr, before, final_ptr, cont_ptr, done_ptr, length_ptr, vocab,
             NUM_STOPS: tl.constexpr, STOPS_P2: tl.constexpr):
    """Whether id ``newest`` finishes its row (``stopcheck``'s rule and table), given the ``before`` ids before
    it, newest first, at before_ptr, before_ptr - 1, ...: a window [W]'s check is
    stop_hit(window[W - 1], &window[W - 2], W - 1, ...).

    Each stop string is one lane, its matched lengths one int64 bit set.
    """
    stop = tl.arange(0, STOPS_P2)
    table_row = stop.to(tl.int64) * vocab
    lanes = stop < NUM_STOPS
    present = (newest >= 0) & (newest < vocab)
    final = tl.where(present, tl.load(final_ptr + table_row + tl.where(present, newest, 0), mask=lanes, other=0), 0)
    hit = (final & 1) != 0
    matched = final & -2
    back = 0
    # Once no stop string is partly matched, older ids change nothing: most checks end here, before the walk.
    while (back < before) & (tl.max((matched != 0).to(tl.int32), axis=0) != 0):
        token = tl.load(before_ptr - back)
        known = (token >= 0) & (token < vocab)  # -1: before the first generated token
        token = tl.where(known, token, 0)
        done = tl.where(known, tl.load(done_ptr + table_row + token, mask=lanes, other=0), 0)
        cont = tl.where(known, tl.load(cont_ptr + table_row + token, mask=lanes, other=0), 0)
        hit |= (matched & done) != 0
        matched = (matched & cont) << tl.load(length_ptr + token).to(tl.int64)
        back += 1
    return tl.max(hit.to(tl.int32), axis=0) != 0


@triton.jit
def _stop_kernel(window_ptr, window_len, final_ptr, cont_ptr, done_ptr, length_ptr, finished_ptr, vocab,
                 NUM_STOPS: tl.constexpr, STOPS_P2: tl.constexpr):
    """One program per row: its window's newest id checked against the ids before it."""
    row = tl.program_id(0).to(tl.int64)
    newest_ptr = window_ptr + row * window_len + window_len - 1
    finished = stop_hit(tl.load(newest_ptr), newest_ptr - 1, window_len - 1, final_ptr, cont_ptr, done_ptr,
                        length_ptr, vocab, NUM_STOPS, STOPS_P2)
    tl.store(finished_ptr + row, finished)


def stop_check(window: torch.Tensor, table) -> torch.Tensor:
    """Finished flags [B] bool; no host synchronisation."""
    batch, window_len = window.shape
    window = window.to(torch.int64).contiguous()
    finished = torch.empty(batch, dtype=torch.bool, device=window.device)
    num_stops = table.final.shape[0]
    _stop_kernel[(batch,)](
        window, window_len, table.final, table.cont, table.done, table.length, finished, table.final.shape[1],
        NUM_STOPS=num_stops, STOPS_P2=triton.next_power_of_2(num_stops), num_warps=1,
    )
    return finished
