"""chunk_attention.py and its C++ passes: a prefill chunk's attention by bf16 matrix products.

Held to fused.attend_ref (fp32) within bf16's rounding, like PyTorch's SDPA on the same bf16 inputs; the
row-max shift is what keeps large scores precise; a runner with it prefills as one with SDPA does; autotune
times it against SDPA.
"""
import pytest
import torch

from tornchat.engine import autotune, chunk_attention, fused, llama, quant

native = quant._prefill()
needs_native = pytest.mark.skipif(native is None, reason="csrc/prefill.cpp not built")


def chunk(heads: int, kv_heads: int, head_dim: int, start: int, n: int, logit_scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(start + n + 7, kv_heads, head_dim, generator=g) * logit_scale).bfloat16()
    values = torch.randn(start + n + 7, kv_heads, head_dim, generator=g).bfloat16()
    q = (torch.randn(n, heads, head_dim, generator=g) * logit_scale).bfloat16()
    return q, keys, values


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@needs_native
@pytest.mark.parametrize("heads,kv_heads,head_dim,start,n", [
    (4, 2, 64, 0, 37), (9, 3, 64, 45, 21), (8, 8, 128, 100, 64), (4, 1, 32, 0, 2)])
def test_matches_the_fp32_reference_as_sdpa_does(heads, kv_heads, head_dim, start, n):
    q, keys, values = chunk(heads, kv_heads, head_dim, start, n)
    scale = head_dim ** -0.5
    want = fused.attend_ref(q, keys, values, start, scale)
    got = chunk_attention.attend(q, keys, values, start, scale)
    sdpa = llama.sdpa_attend(q, keys, values, start, scale)
    assert got.shape == (n, heads * head_dim) and got.dtype == torch.bfloat16
    assert relative(got, want) < 2 * relative(sdpa, want) + 1e-3  # both round q, k, v and the output to bf16


@needs_native
def test_large_scores_keep_their_precision_through_the_shift(monkeypatch):
    """Scores in the hundreds: rounded to bf16 unshifted they move the softmax by percents; shifted by each
    row's largest, as SDPA's fp32 scores."""
    q, keys, values = chunk(4, 2, 64, 30, 40, logit_scale=6.0)
    scale = 64 ** -0.5
    want = fused.attend_ref(q, keys, values, 30, scale)
    shifted = relative(chunk_attention.attend(q, keys, values, 30, scale), want)
    monkeypatch.setattr(native, "causal_row_max", lambda scores, start, n, row0: torch.zeros(
        scores.shape[0], 1, dtype=torch.bfloat16), raising=False)
    unshifted = relative(chunk_attention.attend(q, keys, values, 30, scale), want)
    assert shifted < 0.01 < unshifted


@needs_native
def test_rows_split_into_blocks_give_the_same_result(monkeypatch):
    q, keys, values = chunk(6, 2, 64, 20, 33)
    whole = chunk_attention.attend(q, keys, values, 20, 0.125)
    monkeypatch.setattr(chunk_attention, "SCORES", 53 * 10)  # 10 rows a block: blocks start mid-group
    assert torch.equal(chunk_attention.attend(q, keys, values, 20, 0.125), whole)


@needs_native
def test_the_passes_are_their_references():
    g = torch.Generator().manual_seed(3)
    start, n, groups = 5, 6, 2
    scores = (torch.randn(groups * n, start + n + 3, generator=g) * 4).bfloat16()  # columns past the chunk unseen
    row0 = 1  # a block starting at its second row
    rows = scores[row0:].contiguous()
    seen = [start + (row0 + i) % n + 1 for i in range(rows.shape[0])]
    largest = native.causal_row_max(rows, start, n, row0)
    assert torch.equal(largest[:, 0], torch.stack([rows[i, :s].max() for i, s in enumerate(seen)]))
    probs = rows.clone()
    native.causal_softmax_(probs, start, n, row0)
    for i, s in enumerate(seen):
        want = torch.softmax(rows[i, :s].float(), -1)
        assert torch.allclose(probs[i, :s].float(), want, rtol=1e-2, atol=1e-6)
        assert not probs[i, s:].any()


@needs_native
def test_a_runner_prefills_with_products_as_with_sdpa(tiny_model):
    config, weights = llama.from_transformers(tiny_model)
    sdpa = llama.LlamaRunner(config, weights, kv_dtype=torch.bfloat16)
    products = llama.LlamaRunner(config, weights, kv_dtype=torch.bfloat16, chunk_attention="products")
    assert products.chunk_attention == "products" and "products chunk attention" in products.label()
    ids = list(range(200, 260))
    caches = sdpa.new_cache(), products.new_cache()
    for first in (0, 40):  # a chunk from the start, then one after cached positions
        want = sdpa.forward(ids[first : first + 40], caches[0])
        got = products.forward(ids[first : first + 40], caches[1])
        assert relative(got, want) < 0.02 and got.argmax() == want.argmax()
    assert llama.LlamaRunner(config, weights, chunk_attention="products").chunk_attention == "sdpa"  # fp32 cache


def test_autotune_times_it_against_sdpa(tiny_model):
    base = llama.LlamaRunner(*llama.from_transformers(tiny_model))
    pays, ms = autotune.chunk_attention_pays(base)
    if native is None:
        assert (pays, ms) == (False, {})
    else:
        assert set(ms) == {"products", "sdpa"} and pays == (ms["products"] < ms["sdpa"])
