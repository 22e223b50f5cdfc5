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
