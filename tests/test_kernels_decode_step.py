"""The CUDA decode step's Triton kernels (through Triton's interpreter on the CPU) against their PyTorch references
(``step_ops``), one op at a time and as a whole step."""
import os

import torch

# Compiled kernels on a GPU; elsewhere Triton's interpreter runs them on CPU
# tensors. The interpreter is chosen at @triton.jit, so before kernel imports.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tornchat.engine import cuda_graph, llama, step_ops  # noqa: E402

KERNELS = step_ops.triton_ops()


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed), device=DEVICE).to(dtype)


def rounded_alike(got: torch.Tensor, expected: torch.Tensor) -> None:
    """One rounding of the same fp32 value: equal, where the kernels round to nearest as the GPU does (Triton's
    interpreter truncates fp32 to bf16, a unit in the last place off)."""
    if DEVICE == "cuda" or got.dtype == torch.float32:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=0, rtol=2 ** -7)


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * scale, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width, with_delta", [(576, True), (2048, False), (100, True)])
def test_add_rms_norm_adds_in_the_stream_dtype_and_norms_in_fp32(dtype, width, with_delta):
    x, weight = randn(3, width, dtype=dtype, seed=1), randn(width, dtype=dtype, seed=2)
    delta = randn(3, width, dtype=dtype, seed=3) if with_delta else None
    for out_dtype in (torch.float32, torch.bfloat16):
        total, normed = KERNELS.add_rms_norm(x, delta, weight, 1e-5, out_dtype)
        expected_total, _ = step_ops.add_rms_norm_ref(x, delta, weight, 1e-5, out_dtype)
        assert total.dtype == x.dtype and normed.dtype == out_dtype
        rounded_alike(total, expected_total)
        close(normed, step_ops.add_rms_norm_ref(total, None, weight, 1e-5, out_dtype)[1], out_dtype)


def rope_case(heads, kv_heads, head_dim, dtype, bias, qk_norm, capacity=64):
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(1, width, dtype=dtype, seed=4)
    angles = torch.outer(torch.arange(capacity, dtype=torch.float32, device=DEVICE),
                         1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE) / head_dim))
    table = torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).contiguous()
    return (qkv, randn(width, dtype=dtype, seed=5) if bias else None, table,
            randn(2, head_dim, dtype=dtype, seed=6) if qk_norm else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, bias, qk_norm",
                         [(4, 2, 32, False, False), (9, 3, 64, True, False), (8, 8, 16, False, True), (6, 2, 48, True, True)])
def test_rope_store_rotates_and_writes_one_cache_row(dtype, heads, kv_heads, head_dim, bias, qk_norm):
    qkv, bias_values, table, norm = rope_case(heads, kv_heads, head_dim, dtype, bias, qk_norm)
    position = torch.tensor([37], device=DEVICE)
    caches = []
    for ops in (step_ops.REFERENCE, KERNELS):
        keys = torch.full((64, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
        values = keys.clone()
        q = ops.rope_store(qkv, bias_values, table, position, keys, values, heads, kv_heads, norm, 1e-6)
        assert q.shape == (1, heads, head_dim) and q.dtype == dtype
        caches.append((q, keys, values))
    (q_ref, keys_ref, values_ref), (q, keys, values) = caches
    close(q, q_ref, dtype)
    close(keys[37], keys_ref[37], dtype)
    rounded_alike(values[37], values_ref[37])  # a copy (after the bias, added in qkv's dtype)
    others = torch.arange(64, device=DEVICE) != 37
    assert keys[others].isnan().all() and values[others].isnan().all()  # no other row written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, capacity, position", [
    (4, 2, 32, 64, 0),  # the first position alone
    (9, 3, 64, 256, 200),  # one program per KV head (the 135M's groups of 3)
    (32, 8, 64, 1024, 700),  # split among programs, some past the row's position
    (8, 1, 128, 2048, 2047),  # every position of a split cache
    (32, 1, 64, 600, 450),  # more query heads to a KV head than the smallest tile holds
    (6, 2, 80, 300, 299),  # a head size that is not a power of 2
])
def test_attend_is_softmax_attention_up_to_the_rows_position(dtype, heads, kv_heads, head_dim, capacity, position):
    q = randn(1, heads, head_dim, dtype=dtype, seed=9)
    keys, values = (randn(capacity, kv_heads, head_dim, dtype=dtype, seed=seed) for seed in (7, 8))
    later = torch.arange(position + 1, capacity, device=DEVICE)
    where = torch.tensor([position], device=DEVICE)
    # NaN past the row's position for the kernel (had it read them, its output would be NaN); zeros for SDPA,
    # whose masked positions still enter its weighted sum (0 * NaN).
    got = KERNELS.attend(q, keys.index_fill(0, later, float("nan")), values.index_fill(0, later, float("nan")), where,
                         head_dim ** -0.5)
    expected = step_ops.attend_ref(q, keys.index_fill(0, later, 0), values.index_fill(0, later, 0), where, head_dim ** -0.5)
    assert got.shape == (1, heads * head_dim) and got.dtype == dtype and not got.isnan().any()
    close(got, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_reference(dtype):
    gate_up = randn(3, 2 * 1500, dtype=dtype, seed=10) * 4
    close(KERNELS.silu_mul(gate_up), step_ops.REFERENCE.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("qwen, kv_dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_a_step_on_the_kernels_is_the_step_on_the_references(qwen, kv_dtype):
    """Two rows of different caches, one row of a cache twice (its first key must be there before the second
    attends), and padding: logits and cache rows close to the references' step."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
    model = (Qwen3ForCausalLM(Qwen3Config(head_dim=32, **shape)) if qwen else LlamaForCausalLM(LlamaConfig(**shape))).eval()
    spec, weights = llama.from_transformers(model.to(DEVICE))
    run = llama.LlamaRunner(spec, weights, kv_dtype=kv_dtype, graphs=False)
    results = []
    with torch.inference_mode():
        for ops in (step_ops.REFERENCE, KERNELS):
            caches = [run.new_cache() for _ in range(2)]
            for cache, prompt in zip(caches, (range(10, 30), range(40, 47))):
                run.forward(list(prompt), cache)
                cache.kv[:, :, cache.length :] = 0  # as LlamaRunner.reserve leaves a CUDA cache
            tokens, positions = torch.tensor([5, 6, 7, 0], device=DEVICE), torch.tensor([20, 7, 21, 0], device=DEVICE)
            logits = cuda_graph.step(run, tokens, positions, (caches[0].kv, caches[1].kv, caches[0].kv), ops)
            results.append((logits[:3], [cache.kv[:, :, :22] for cache in caches]))
            assert not caches[0].kv[:, :, 22:].any() and not caches[1].kv[:, :, 8:].any()  # padding wrote nothing
    (expected, expected_kv), (got, got_kv) = results
    close(got, expected, kv_dtype)
    for e, g in zip(expected_kv, got_kv):
        close(g, e, kv_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(96, 64), (200, 300), (1000, 1100)])
def test_linear_rows_is_the_product_and_a_row_gets_the_same_bits_beside_any_rows(dtype, n, k):
    """x @ w.T rounded once to w's dtype; row i of a call of any rows, at any place in it, equal to a call of
    that row alone, bit for bit (widths that are no multiple of the kernel's blocks included)."""
    kernels = step_ops._kernels()
    x, w = randn(16, k, dtype=dtype, seed=11), randn(n, k, dtype=dtype, seed=12) / k ** 0.5
    alone = torch.cat([kernels.linear_rows(x[i : i + 1], w) for i in range(16)])
    assert alone.shape == (16, n) and alone.dtype == dtype
    close(alone, x.float() @ w.float().T, dtype)
    for start, end in ((0, 16), (3, 5), (7, 15), (15, 16)):
        assert torch.equal(kernels.linear_rows(x[start:end], w), alone[start:end])
    for config in (kernels.LinearConfig(16, 64, 4, 2), kernels.LinearConfig(64, 128, 8, 3)):  # launches bench/gpu.py tries
        close(kernels.linear_rows(x[:3], w, config), alone[:3], dtype)
    with pytest.raises(ValueError, match="at most 16"):
        kernels.linear_rows(randn(17, k, dtype=dtype), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_cache_are_rotated_stored_and_attended_as_each_alone(dtype):
    """A verify's rows in one call of rope_store and one of attend: each row's query, cache entries and attention
    over the cache up to its own position bit for bit those of the row's own calls, one after another."""
    heads, kv_heads, head_dim, capacity = 8, 2, 32, 512
    qkv, bias, table, norm = rope_case(heads, kv_heads, head_dim, dtype, True, True, capacity)
    rows = randn(5, qkv.shape[1], dtype=dtype, seed=13)
    positions = torch.arange(250, 255, device=DEVICE)  # across the first split's end (256 positions)
    caches = []
    for together in (True, False):
        keys, values = (randn(capacity, kv_heads, head_dim, dtype=dtype, seed=seed) for seed in (14, 15))
        if together:
            q = KERNELS.rope_store(rows, bias, table, positions, keys, values, heads, kv_heads, norm, 1e-6)
            out = KERNELS.attend(q, keys, values, positions, head_dim ** -0.5)
        else:
            q = torch.cat([KERNELS.rope_store(rows[r : r + 1], bias, table, positions[r : r + 1], keys, values, heads,
                                              kv_heads, norm, 1e-6) for r in range(5)])
            out = torch.cat([KERNELS.attend(q[r : r + 1], keys, values, positions[r : r + 1], head_dim ** -0.5)
                             for r in range(5)])
        caches.append((q, keys, values, out))
    for got, expected in zip(*caches):
        assert torch.equal(got, expected)
    reference = step_ops.attend_ref(caches[0][0], caches[0][1], caches[0][2], positions, head_dim ** -0.5)
    close(caches[0][3], reference, dtype)


@pytest.mark.parametrize("position", [3, 255, 256, 700])
def test_a_rows_attention_does_not_depend_on_the_caches_capacity(position):
    """The same keys and values in caches of 256, 1024 and 4096 positions (one block of positions, then split
    among programs): the same bits at every position, so a verify that grows the cache before a row attends
    gives that row what a step on the smaller cache gives."""
    heads, kv_heads, head_dim = 8, 2, 64
    q = randn(1, heads, head_dim, seed=16)
    keys, values = (randn(4096, kv_heads, head_dim, seed=seed) for seed in (17, 18))
    where = torch.tensor([position], device=DEVICE)
    got = [KERNELS.attend(q, keys[:capacity], values[:capacity], where, 0.125)
           for capacity in (256, 1024, 4096) if capacity > position]
    assert all(torch.equal(g, got[-1]) for g in got)
    close(got[-1], step_ops.attend_ref(q, keys[: position + 1], values[: position + 1], where, 0.125), torch.float32)


def test_a_verify_in_one_step_is_its_rows_steps_bit_for_bit():
    """Four rows of one cache in one step (padded to 8 rows) against four one-row steps on a copy of the cache:
    the same logits and cache entries, bit for bit. The kernels' ops say so of this runner (its captured
    steps then take a verify whole); PyTorch's do not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                         tie_word_embeddings=True)).eval()
    spec, weights = llama.from_transformers(model.to(DEVICE))
    run = llama.LlamaRunner(spec, weights, graphs=False)
    assert KERNELS.rows_apart(run) and not step_ops.REFERENCE.rows_apart(run)
    drafts, positions = [5, 6, 7, 8], list(range(20, 24))
    with torch.inference_mode():
        cache = run.new_cache()
        run.forward(list(range(10, 30)), cache)
        cache.kv[:, :, cache.length :] = 0
        copy = cache.kv.clone()
        together = cuda_graph.step(run, torch.tensor(drafts + [0] * 4, device=DEVICE),
                                   torch.tensor(positions + [0] * 4, device=DEVICE), (cache.kv,) * 4, KERNELS)[:4]
        alone = torch.cat([cuda_graph.step(run, torch.tensor([t], device=DEVICE), torch.tensor([p], device=DEVICE),
                                           (copy,), KERNELS) for t, p in zip(drafts, positions)])
    assert torch.equal(together, alone)
    assert torch.equal(cache.kv, copy)
