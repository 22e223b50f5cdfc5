"""Fused temperature / top-k / top-p sampling: the PyTorch reference.

Semantics, per row of ``logits [B, V]``:

1. NaN logits count as -inf, and +inf (like any value above it) as
   LOGIT_CAP, so no non-finite value can produce an out-of-range id or a NaN
   probability. A row with no finite logit at all yields token 0.
2. Greedy rows (temperature < GREEDY_TEMPERATURE compared in fp32, so 0.01
   itself samples; or top_k == 1) take the
   argmax; on ties, the lowest id.
3. Otherwise z = logits / temperature. top-k (1 < top_k < V) keeps every
   token whose z is >= the k-th largest z (ties at the k-th value are kept).
   top-p (top_p < 1) then keeps the smallest set of most probable tokens
   whose softmax probability sums to >= top_p (tokens tied with the last
   one kept are kept too); at least one token always survives.
4. One token is drawn from softmax(z) renormalised over the kept set, with
   randomness keyed only by (seed, step): the same inputs give the same ids.

Also returned: the chosen token's log-probability under log_softmax(z)
(z = raw logits for greedy rows), before top-k/top-p truncation.
"""
import torch

from tornchat.kernels.dispatch import triton_module, use_triton

GREEDY_TEMPERATURE = 0.01
# Far above any real logit, yet LOGIT_CAP / GREEDY_TEMPERATURE stays finite in fp32.
LOGIT_CAP = 1e30


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """fp32 copy with NaN -> -inf and values above LOGIT_CAP (+inf too) -> LOGIT_CAP."""
    # neginf must be given: by default nan_to_num turns -inf into the lowest finite float.
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=LOGIT_CAP, neginf=float("-inf"))
    return logits.clamp(max=LOGIT_CAP)


def is_greedy(temperature: torch.Tensor, top_k: int) -> bool:
    """Rule 2's test for a row. temperature stays an fp32 tensor: compared in fp32, the fp32 value of 0.01 is not
    below GREEDY_TEMPERATURE (as a Python float it would be), as in the kernel."""
    return bool(temperature.float() < GREEDY_TEMPERATURE) or top_k == 1


def greedy_token(row_logits: torch.Tensor) -> int:
    """Rule 2 for one row [V]: the argmax of the sanitized logits, the lowest id on ties (0 where no logit is
    finite: every value is then -inf, the first of them the largest)."""
    if row_logits.device.type == "cpu":
        # numpy's argmax (vectorized; torch's is several times slower on a CPU) stops at the first NaN: a row whose
        # largest value is neither NaN nor past the cap is its own sanitized copy.
        values = row_logits.float().numpy()
        token = int(values.argmax())
        if values[token] <= LOGIT_CAP:
            return token
    return int(torch.argmax(sanitize_logits(row_logits)))


def greedy_row(row_logits: torch.Tensor) -> tuple[int, float]:
    """``greedy_token`` and its log-probability (-inf where no logit is finite)."""
    token = greedy_token(row_logits)
    row_logits = sanitize_logits(row_logits)
    if row_logits[token] == float("-inf"):  # no finite logit at all
        return 0, float("-inf")
    return token, float(torch.log_softmax(row_logits, dim=-1)[token])


def _row_generator(seed: int, step: int) -> torch.Generator:
    # Mix seed and step so consecutive steps of one request, and the same step
    # of neighbouring seeds, get unrelated streams.
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9) % (1 << 63))
    return gen


def truncation_mask(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask [V] of the tokens that top-k then top-p keep for one row z (sanitized: no NaN, no +inf)."""
    vocab = z.shape[-1]
    keep = z != float("-inf")  # isfinite's equal on a sanitized row, at half its cost
    if 1 < top_k < vocab:
        kth = torch.topk(z, top_k).values[-1]
        keep &= z >= kth
        z = z.masked_fill(~keep, float("-inf"))
    if top_p < 1.0 and bool(keep.any()):
        probs = torch.softmax(z, dim=-1)
        # The nucleus lies among the tokens still kept: where top-k or a grammar's mask left few, only they
        # are searched. The others' probabilities are 0 and would only follow them in the sorted row.
        keep &= probs >= nucleus_floor(probs if bool(keep.all()) else probs[keep], top_p)
    return keep


# A positive float32's bits shifted right by CODE_SHIFT: its exponent and the first 2 bits of its mantissa, a
# code that grows with the value, 4 to an octave; CODE_FLOOR[c] is the least value of code c.
CODE_SHIFT = 21
CODES = 1 << (31 - CODE_SHIFT)
CODE_FLOOR = (torch.arange(CODES + 1, dtype=torch.int32) << CODE_SHIFT).view(torch.float32).double()


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The probability of the last token top-p keeps (probs: a softmax's, whole or but for tokens of
    probability 0, in any order): going down the sorted probabilities, the first at which the running sum
    reaches top_p (the last one, where round-off leaves the sum below it)."""
    # Only the head of the sorted row matters, and sorting a whole large vocabulary costs milliseconds
    # (the largest 2,048 of 152k values: 1 ms on 2 cores). Counting the tokens by code bounds the mass
    # below each code from above (each token counted at the next code's floor), so the mass at or above
    # it from below; the tokens at or above the highest code whose bound reaches top_p hold the nucleus,
    # and being the head of the sorted row, their running sums are the whole sort's. Round-off can leave
    # those sums just short of top_p: then the whole row is sorted.
    codes = probs.contiguous().view(torch.int32) >> CODE_SHIFT
    count = torch.bincount(codes, minlength=CODES)  # weighted, a bin holding most tokens is 8x slower
    ceiling_mass = count * CODE_FLOOR[1:].to(count.device)
    below = torch.cumsum(ceiling_mass, 0) - ceiling_mass  # the mass of codes < c, at most (a softmax's sums to 1)
    reaching = ((1.0 - below >= top_p) & (count > 0)).nonzero()
    lowest = int(reaching[-1]) if len(reaching) else 0
    for code in dict.fromkeys((lowest, 0)):
        threshold = CODE_FLOOR[code].float()
        largest = torch.sort(probs[probs >= threshold] if code else probs, descending=True).values
        cumulative = torch.cumsum(largest, dim=-1)
        if bool(cumulative[-1] >= top_p):
            break
    target = torch.tensor([top_p], dtype=cumulative.dtype, device=cumulative.device)
    last = int(torch.searchsorted(cumulative, target).clamp(max=largest.shape[-1] - 1))
    return largest[last]


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (ids [B] int64, logprobs [B] fp32).

    temperature/top_p are float tensors [B], top_k/seed integer tensors [B]
    (top_k <= 0 means no top-k). ``step`` is the decode step, mixed into the
    randomness so each step draws fresh numbers.
    """
    batch, vocab = logits.shape
    ids = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.zeros(batch, dtype=torch.float32, device=logits.device)
    for row in range(batch):
        t, k, p = temperature[row].float(), int(top_k[row]), float(top_p[row])
        if is_greedy(t, k):
            ids[row], logprobs[row] = greedy_row(logits[row])
            continue
        row_logits = sanitize_logits(logits[row])
        z = row_logits / t.to(row_logits.device)
        kept = truncation_mask(z, k, p).nonzero()[:, 0]  # ids, ascending
        if kept.numel() == 0:  # no finite logit at all
            logprobs[row] = float("-inf")
            continue
        probs = torch.softmax(z[kept], dim=-1)
        # Exponential race (Gumbel-max in disguise): argmax p_i / E_i with
        # E_i ~ Exp(1) is an exact draw from p, and needs no cumulative sum.
        # E = -log(U), where U = 0 gives E = inf: no token wins by its noise alone.
        noise = torch.rand(kept.numel(), generator=_row_generator(int(seed[row]), step)).log_().neg_()
        token = int(kept[torch.argmax(probs.cpu() / noise)])
        ids[row] = token
        logprobs[row] = torch.log_softmax(z, dim=-1)[token]
    return ids, logprobs


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's one entry point: same contract as ``sample_reference``.

    CUDA tensors (or any, with TORNCHAT_TRITON_INTERPRET=1) go to the Triton
    kernel, whose Philox stream differs from the reference's generator: a
    seed reproduces its tokens on the same kind of device only.
    """
    if use_triton(logits):
        return triton_module("sampling_triton").sample(logits, temperature, top_k, top_p, seed, step)
    return sample_reference(logits, temperature, top_k, top_p, seed, step)
