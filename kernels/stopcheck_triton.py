"""The stop-check kernel (semantics and table layout: ``stopcheck``)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _stop_kernel(
    window_ptr, window_len, final_ptr, cont_ptr, done_ptr, length_ptr, finished_ptr, vocab,
    NUM_STOPS: tl.constexpr, STOPS_P2: tl.constexpr,
):
    """One program per row; each stop string is one lane, its matched lengths one int64 bit set."""
    row = tl.program_id(0).to(tl.int64)
    stop = tl.arange(0, STOPS_P2)
    table_row = stop.to(tl.int64) * vocab
    lanes = stop < NUM_STOPS
    newest = tl.load(window_ptr + row * window_len + window_len - 1)
    present = (newest >= 0) & (newest < vocab)
    newest = tl.where(present, newest, 0)
    final = tl.where(present, tl.load(final_ptr + table_row + newest, mask=lanes, other=0), 0)
    hit = (final & 1) != 0
    matched = final & -2
    for back in range(1, window_len):
        token = tl.load(window_ptr + row * window_len + window_len - 1 - back)
        present = (token >= 0) & (token < vocab)  # -1: before the first generated token
        token = tl.where(present, token, 0)
        done = tl.where(present, tl.load(done_ptr + table_row + token, mask=lanes, other=0), 0)
        cont = tl.where(present, tl.load(cont_ptr + table_row + token, mask=lanes, other=0), 0)
        shift = tl.load(length_ptr + token).to(tl.int64)
        hit |= (matched & done) != 0
        matched = (matched & cont) << shift
    tl.store(finished_ptr + row, tl.max(hit.to(tl.int32), axis=0) != 0)


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
