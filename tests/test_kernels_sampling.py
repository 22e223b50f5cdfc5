"""The Triton sampler (through Triton's interpreter on the CPU) against the PyTorch reference."""
import os

import torch

# Compiled kernels on a GPU; elsewhere Triton's interpreter runs them on CPU
# tensors. The interpreter is chosen at @triton.jit, so before kernel imports.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tornchat.kernels import sample  # noqa: E402
from tornchat.kernels import sampling_triton as kernel  # noqa: E402
from tornchat.kernels.sampling import (  # noqa: E402
    LOGIT_CAP,
    greedy_token,
    is_greedy,
    nucleus_floor,
    sample_reference,
    sanitize_logits,
    truncation_mask,
)


def params(rows, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype)  # noqa: E731
    return full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32), full(seed, torch.int64)


def keep_probs(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The reference's distribution after truncation: softmax(z) renormalised over its keep set."""
    keep = truncation_mask(z, top_k, top_p)
    return torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)


def awkward_rows(vocab: int) -> torch.Tensor:
    """NaN, +/-inf, a lone finite value, no finite value, ties: one row each."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(6, vocab, generator=gen) * 3
    rows[0, ::7] = float("nan")
    rows[1, 3] = float("inf")
    rows[1, 9] = float("inf")  # two +inf: capped to equal values, the lower id wins
    rows[2] = float("-inf")
    rows[2, vocab - 1] = 0.5
    rows[3] = float("-inf")
    rows[4] = torch.randint(0, 4, (vocab,), generator=gen).float()  # heavy ties everywhere
    rows[5, : vocab // 2] = float("-inf")
    return rows.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_rows_take_the_reference_argmax(dtype):
    logits = awkward_rows(300).to(dtype)
    rows = logits.shape[0]
    # temperature < 0.01, or top_k == 1 at any temperature, is greedy.
    configs = [(0.0, 0), (0.0099, 50), (1.5, 1)] if dtype == torch.float32 else [(0.0, 0)]
    for temperature, top_k in configs:
        t, k, p, s = params(rows, temperature, top_k, 0.5, seed=3)
        ids, logprobs = kernel.sample(logits, t, k, p, s, step=0)
        ref_ids, ref_logprobs = sample_reference(logits, t, k, p, s, step=0)
        assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
        assert ids.tolist() == ref_ids.tolist()
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)
    assert ids[1] == 3 and ids[2] == 299 and ids[3] == 0 and logprobs[3] == float("-inf")


# temperature, top_k, top_p of one row each, over a vocabulary of 1000.
CASES = [
    (1.0, 50, 1.0),
    (0.7, 0, 0.9),
    (1.3, 40, 0.8),
    (0.01, 0, 0.95),  # exactly the greedy threshold: sampled, and sharp
    (1.0, 1000, 0.5),  # top_k >= V: no top-k
    (2.0, 0, 1.0),  # nothing truncated
    (1.0, 5, 0.0),  # top_p 0: the most probable token (and its ties) only
    (1.0, 20, 0.99),  # ties straddling the k-th value
]


def test_sampled_tokens_lie_in_the_reference_keep_set():
    vocab = 1000
    random_rows = torch.randn(len(CASES), vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 4
    logits = torch.cat([random_rows, awkward_rows(vocab)])
    logits[len(CASES) - 1, :30] = logits[len(CASES) - 1].max()
    cases = CASES + [(1.0, 3, 0.9)] * (logits.shape[0] - len(CASES))
    t, k, p = (torch.tensor(column) for column in zip(*cases))
    seed = torch.arange(len(cases)) * 7919
    # block=512 splits the vocabulary across programs, as on a GPU.
    ids, logprobs = kernel.sample_draws(logits, t, k, p, seed, step=5, draws=64, block=512)
    assert ((ids >= 0) & (ids < vocab)).all()
    clean = sanitize_logits(logits)
    for row, (temperature, top_k, top_p) in enumerate(cases):
        if not torch.isfinite(clean[row]).any():
            assert (ids[row] == 0).all() and (logprobs[row] == float("-inf")).all()
            continue
        z = clean[row] / temperature
        keep = truncation_mask(z, top_k, top_p)
        assert keep[ids[row]].all(), (row, ids[row][~keep[ids[row]]])
        torch.testing.assert_close(logprobs[row], torch.log_softmax(z, -1)[ids[row]], rtol=1e-4, atol=1e-4)
    assert ids[len(CASES) - 1].unique().numel() > 1  # the tied top 30 are all candidates


def test_cross_block_search_matches_one_block():
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(7)).to(DEVICE) * 2
    t, k, p, s = params(2, 0.9, 100, 0.7, seed=11)
    split = kernel.sample_draws(logits, t, k, p, s, step=0, draws=16, block=256)
    whole = kernel.sample_draws(logits, t, k, p, s, step=0, draws=16)
    assert torch.equal(split[0], whole[0])


@pytest.mark.parametrize("vocab,temperature,top_k,top_p", [(64, 1.0, 20, 0.95), (300, 0.8, 0, 0.9)])
def test_distribution_matches_the_reference_probabilities(vocab, temperature, top_k, top_p):
    draws = 20_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(vocab)).to(DEVICE) * 2
    t, k, p, s = params(1, temperature, top_k, top_p, seed=1234)
    ids, _ = kernel.sample_draws(logits, t, k, p, s, step=0, draws=draws)
    expected = keep_probs(logits[0] / temperature, top_k, top_p)
    observed = torch.bincount(ids[0], minlength=vocab).double() / draws
    # Total variation of 20,000 draws over <= 64 kept tokens is ~0.02 (fixed seed: deterministic).
    assert 0.5 * (observed - expected.double()).abs().sum() < 0.035


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.randn(1, 800, generator=torch.Generator().manual_seed(3)).to(DEVICE).expand(2, 800)
    t, k, p, _ = params(2, 1.0, 0, 0.95)
    seeds = torch.tensor([5, 5], device=DEVICE)
    a, _ = kernel.sample_draws(logits, t, k, p, seeds, step=10, draws=32)
    b, _ = kernel.sample_draws(logits, t, k, p, seeds, step=10, draws=32)
    c, _ = kernel.sample_draws(logits, t, k, p, torch.tensor([6, 6], device=DEVICE), step=10, draws=32)
    assert torch.equal(a, b) and torch.equal(a[0], a[1])
    assert (a != c).float().mean() > 0.5
    # Draw d of a launch at step s is the token of step s + d.
    one, _ = kernel.sample(logits, t, k, p, seeds, step=13)
    assert torch.equal(one, a[:, 3])


def test_dispatch_sends_cuda_tensors_and_requested_cpu_tensors_to_the_kernel(monkeypatch):
    """sample() is the kernel on CUDA (or on CPU with TORNCHAT_TRITON_INTERPRET=1), the reference on CPU."""
    cpu_logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(4))
    logits = cpu_logits.to(DEVICE)
    t, k, p, s = (x.to(DEVICE) for x in params(2, 1.0, 10, 0.9, seed=8))
    if DEVICE == "cpu":
        monkeypatch.setenv("TORNCHAT_TRITON_INTERPRET", "1")
    dispatched = torch.stack([sample(logits, t, k, p, s, step)[0] for step in range(2, 6)], dim=1)
    kernel_ids = torch.stack([kernel.sample(logits, t, k, p, s, step)[0] for step in range(2, 6)], dim=1)
    assert torch.equal(dispatched, kernel_ids)
    for row in range(2):
        assert truncation_mask(logits[row], 10, 0.9)[dispatched[row]].all()
    monkeypatch.delenv("TORNCHAT_TRITON_INTERPRET", raising=False)
    cpu_params = [x.cpu() for x in (t, k, p, s)]
    reference = torch.stack([sample_reference(cpu_logits, *cpu_params, step)[0] for step in range(2, 6)], dim=1)
    assert torch.equal(torch.stack([sample(cpu_logits, *cpu_params, step)[0] for step in range(2, 6)], dim=1), reference)
    # Different random streams: a seed reproduces tokens on one kind of device only.
    assert not torch.equal(dispatched.cpu(), reference)


# Real vocabularies; the interpreter runs one program per row, so the CPU takes the smallest.
LARGE_VOCABS = [32_000, 49_152, 151_936, 262_144] if DEVICE == "cuda" else [32_000]


@pytest.mark.parametrize("vocab", LARGE_VOCABS)
def test_real_vocabularies_greedy_and_keep_set(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(4, vocab, generator=gen) * 3).to(DEVICE)
    logits[3, vocab // 3 : vocab // 3 + 8] = logits[3].max() + 8  # eight tied maxima holding most of the mass
    t = torch.tensor([0.0, 0.8, 1.0, 1.2])
    k = torch.tensor([0, 50, 0, 0])
    p = torch.tensor([1.0, 0.9, 0.95, 0.5])
    seed = torch.arange(4) + 17
    ids, logprobs = kernel.sample_draws(logits, t, k, p, seed, step=3, draws=8)
    assert ((ids >= 0) & (ids < vocab)).all()
    assert (ids[0] == torch.argmax(logits[0])).all()
    for row in range(1, 4):
        z = logits[row] / float(t[row])
        keep = truncation_mask(z, int(k[row]), float(p[row]))
        assert keep[ids[row]].all()
        torch.testing.assert_close(logprobs[row], torch.log_softmax(z, -1)[ids[row]], rtol=1e-4, atol=1e-4)
    assert set(ids[3].tolist()) <= set(range(vocab // 3, vocab // 3 + 8))


# The reference itself: it defines the semantics, so it gets its own checks.


def test_reference_distribution_matches_truncated_softmax():
    vocab, rows = 50, 20_000
    logits = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 2).expand(rows, vocab)
    t, k, p, _ = params(rows, 0.9, 15, 0.9)
    ids, _ = sample_reference(logits, t, k, p, torch.arange(rows), step=0)
    observed = torch.bincount(ids, minlength=vocab).double() / rows
    expected = keep_probs(logits[0] / 0.9, 15, 0.9).double()
    assert observed[expected == 0].sum() == 0
    assert 0.5 * (observed - expected).abs().sum() < 0.03


def test_reference_truncation_keeps_ties_and_at_least_one_token():
    z = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, float("-inf")])
    assert truncation_mask(z, 2, 1.0).tolist() == [True, True, True, True, False, False]  # ties at k-th kept
    assert truncation_mask(z, 0, 0.0).tolist() == [True, False, False, False, False, False]
    assert truncation_mask(z, 10, 1.0).tolist() == [True] * 5 + [False]  # top_k >= V: off; -inf never
    probs = torch.softmax(z, -1)
    # top_p just above the max's mass needs the next tokens, all three of them (tied).
    assert truncation_mask(z, 0, float(probs[0]) + 1e-3).sum() == 4


def full_sort_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    ordered = torch.sort(probs, descending=True).values
    cumulative = torch.cumsum(ordered, -1)
    return ordered[int(torch.searchsorted(cumulative, torch.tensor([top_p])).clamp(max=len(ordered) - 1))]


def test_nucleus_floor_is_the_full_sorts_whatever_the_nucleus_size():
    """The floor is looked for among the tokens above a probability a histogram finds, before a sort of the
    whole row: it must be what the whole sort gives, from a nucleus of one token to most of the row."""
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(5)) * 4
    sizes = []
    for temperature, top_p in [(0.5, 0.9), (0.7, 0.8), (1.0, 0.9), (1.5, 0.9), (3.0, 0.95), (1.0, 0.0), (9.0, 0.9)]:
        probs = torch.softmax(logits / temperature, dim=-1)
        floor = full_sort_floor(probs, top_p)
        sizes.append(int((probs >= floor).sum()))
        assert nucleus_floor(probs, top_p) == floor
    assert min(sizes) == 1 and any(64 < size < 2048 for size in sizes) and max(sizes) > 20_000


def test_nucleus_floor_where_round_off_leaves_the_sorted_sums_short():
    """A top_p at the very end of the sorted running sums, which round-off leaves a little off 1: the
    candidates a count by code picks (counting on a total of 1) may not reach it. The floor is still the
    whole sort's (its last token, where nothing reaches top_p)."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        probs = torch.softmax(torch.randn(1000, generator=generator) * 3, dim=-1)
        total = torch.cumsum(torch.sort(probs, descending=True).values, -1)[-1]
        for top_p in (total, torch.nextafter(total, torch.tensor(2.0))):
            top_p = min(float(top_p), float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))))
            assert nucleus_floor(probs, top_p) == full_sort_floor(probs, top_p)


def test_nucleus_floor_of_a_lone_probability_just_under_a_code_boundary():
    """Counted at its code's ceiling, 1.0, a probability of 1 - 2**-24 leaves every higher code a bound
    of 0 that top_p 0 reaches: the search must stay among codes that hold tokens."""
    probs = torch.tensor([1.0 - 2**-24])
    assert nucleus_floor(probs, 0.0) == probs[0]


def test_truncation_keeps_nothing_of_a_row_without_a_finite_logit():
    z = torch.full((1000,), float("-inf"))
    for top_k, top_p in [(0, 0.9), (3, 0.9), (0, 0.0)]:
        assert not truncation_mask(z, top_k, top_p).any()


def test_reference_never_returns_an_out_of_range_id():
    logits = awkward_rows(40)
    logits[0, :] = float("nan")
    rows = logits.shape[0]
    t, k, p, s = params(rows, 1.0, 3, 0.9)
    ids, logprobs = sample_reference(logits, t, k, p, s, step=1)
    assert ((ids >= 0) & (ids < 40)).all()
    assert ids[0] == 0 and logprobs[0] == float("-inf")
    assert ids[2] == 39 and logprobs[2] == 0.0
    capped = sanitize_logits(torch.tensor([[float("inf"), 1.0]]))
    assert capped[0, 0] == LOGIT_CAP and torch.isfinite(capped / 0.01).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_token_is_the_references_greedy_choice(dtype):
    """The chooser takes a greedy row's token by greedy_token (no log-probability): the reference's greedy id on
    every awkward row (a NaN first, +inf twice, one finite value, none, ties), on the CPU and on the device."""
    logits = torch.cat([awkward_rows(40), torch.full((1, 40), float("nan"), device=DEVICE)]).to(dtype)
    ids, _ = sample_reference(logits.cpu(), *params(len(logits), 0.0), step=0)
    for row, expected in zip(logits, ids.tolist()):
        assert greedy_token(row) == expected and greedy_token(row.cpu()) == expected
    assert ids[3] == 0 and ids[1] == 3  # nothing finite: 0; two capped +inf: the lower id


def test_the_greedy_rule_compares_the_temperature_in_fp32():
    """The kernel reads temperatures as fp32: 0.009999999999 is 0.01 there, so sampled, as the reference and
    the device's choice in a CUDA step (choose.Chooser.greedy) must agree."""
    assert not is_greedy(torch.tensor(0.009999999999, dtype=torch.float64), 50)
    assert 0.009999999999 < 0.01  # as Python floats it would have been greedy
    assert is_greedy(torch.tensor(0.0), 50) and is_greedy(torch.tensor(0.8), 1) and not is_greedy(torch.tensor(0.8), 50)
