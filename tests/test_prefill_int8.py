"""csrc/prefill.cpp: a prefill chunk's products in int8 (quant.DynamicInt8Weight), and autotune's use of them.

Each C++ piece is held to a PyTorch reference that states its semantics; the runner's int8 prefill is held
to the fp32 forward within the rounding of 8-bit activations; autotune's choice is checked with faked timings.
"""
import math

import pytest
import torch

from runners import exact, lean
from test_autotune import fake_machine, fake_prefill_timings
from tornchat.engine import autotune, llama, quant
from tornchat.engine.autotune import Format

native = quant._prefill()
needs_native = pytest.mark.skipif(native is None or quant.int4_layout() is None,
                                  reason="csrc/prefill.cpp not built, or no known int4 layout on this CPU")
SCRATCH = torch.empty(0, dtype=torch.uint8)


def inputs(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 40  # an outlier feature
    x[1] = 0  # a row of zeros: its scale is 0
    return x


def quantize_rows_reference(x: torch.Tensor, left_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x (fp32 or bf16, read as fp32) without the left_out columns: m = its largest |x|, scale =
    m / 127, q = round(x * (127 / m)) to nearest even (0 where m is 0, and in the left-out columns)."""
    kept = x.float().clone()
    kept[:, left_out] = 0
    m = kept.abs().amax(1)
    inverse = torch.where(m > 0, torch.full_like(m, 127) / m, torch.zeros_like(m))
    return (kept * inverse[:, None]).round().to(torch.int8), m / 127


def int4_to_int8_reference(values: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 weights' fp32 values [N, K] (as Int4Weight.dequantize gives them) -> int8 [K, N] and scales [N]: each
    row over m / 127, m the largest value its groups can hold, max |(0 - 8) * s + z|, |(15 - 8) * s + z|."""
    s, z = scales_and_zeros.float().unbind(-1)  # [G, N]
    m = torch.maximum((s * -8 + z).abs(), (s * 7 + z).abs()).amax(0)
    inverse = torch.where(m > 0, torch.full_like(m, 127) / m, torch.zeros_like(m))
    return (values * inverse[:, None]).round().to(torch.int8).T, m / 127


def epilogue_reference(acc, x_scales, w_scales, x_outliers, w_outliers) -> torch.Tensor:
    """fp32 (float(acc) * x_scale[row] + e) * w_scale[column], e the outlier columns' products summed in order:
    x_outliers [rows, count] times w_outliers [count, N], the outlier columns' int8 weights as floats."""
    e = torch.zeros(acc.shape)
    for t in range(x_outliers.shape[1]):
        e = e + x_outliers[:, t, None] * w_outliers[None, t, :]
    return (acc.float() * x_scales[:, None] + e) * w_scales[None, :]


def product_reference(x: torch.Tensor, w_values: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """What int4_linear and int8_linear compute in fp32 from the int8 weights [K, N] and their scales: x's rows
    quantized without its 16 outlier columns, those columns kept in fp32 (epilogue_reference)."""
    columns = native.outlier_columns(x, 16)
    q, x_scales = native.quantize_rows(x, columns)
    return epilogue_reference(torch._int_mm(q, w_values), x_scales, w_scales, x.float()[:, columns],
                              w_values[columns].float())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantize_as_the_reference(dtype):
    x = inputs(37, 83).to(dtype)  # K not a multiple of 16: the tail runs too
    for left_out in (torch.zeros(0, dtype=torch.long), torch.tensor([3, 80])):
        q, scales = native.quantize_rows(x, left_out)
        expected_q, expected_scales = quantize_rows_reference(x, left_out)
        assert torch.equal(q, expected_q) and torch.equal(scales, expected_scales)
    assert q[1].abs().sum() == 0 and q[:, 3].abs().sum() == 0


@needs_native
def test_outlier_columns_are_the_largest_magnitudes():
    x = inputs(9, 200)
    x[4, 150] = -1e4
    largest = x.abs().amax(0)
    assert native.outlier_columns(x, 16).tolist() == sorted(largest.topk(16).indices.tolist())
    assert native.outlier_columns(x, 500).tolist() == list(range(200))  # at most K
    ties = torch.ones(2, 40)
    assert native.outlier_columns(ties, 3).tolist() == [0, 1, 2]  # ties to the lower index
    assert torch.equal(native.outlier_columns(x.bfloat16(), 16), native.outlier_columns(x.bfloat16().float(), 16))


@needs_native
@pytest.mark.parametrize("bf16_out", [True, False])
def test_the_epilogue_scales_and_adds_as_the_reference(bf16_out):
    """epilogue_reference in fp32, rounded once to bf16 (to nearest even); rows past a tile of 4, columns past
    16-lane vectors."""
    g = torch.Generator().manual_seed(3)
    acc = torch.randint(-2**27, 2**27, (19, 75), dtype=torch.int32, generator=g)
    x_scales, w_scales = torch.rand(19, generator=g), torch.rand(75, generator=g)
    x_outliers, w_outliers = torch.randn(19, 5, generator=g) * 100, torch.randint(-127, 128, (5, 75), generator=g).float()
    expected = epilogue_reference(acc, x_scales, w_scales, x_outliers, w_outliers)
    got = native.scale_products(acc, x_scales, w_scales, x_outliers, w_outliers, bf16_out)
    assert torch.equal(got, expected.bfloat16() if bf16_out else expected)


@needs_native
@pytest.mark.parametrize("layout", [quant.Int4Layout(64, True), quant.Int4Layout(32, True), quant.Int4Layout(32, False),
                                    quant.Int4Layout(64, False)])
@pytest.mark.parametrize("inputs_dtype", [torch.bfloat16, torch.float32])
def test_int4_weights_convert_to_int8_rows_within_half_a_step(layout, inputs_dtype):
    """Every layout PyTorch's packer may have (Int4Layout), scales and zeros in either dtype."""
    n, k = 192, 128
    levels, scales, lows = quant.group_levels(torch.randn(n, k, generator=torch.Generator().manual_seed(4)), 32)
    w = quant.int4_weight(layout.pack(levels.reshape(n, k).to(torch.uint8)), scales.reshape(n, -1), lows.reshape(n, -1),
                          inputs_dtype)
    values = w.dequantize_reference(torch.float32, None, layout)
    got, got_scales = native.int4_to_int8(w.packed, w.scales_and_zeros, 32, layout.rows, layout.halves)
    expected, expected_scales = int4_to_int8_reference(values, w.scales_and_zeros)
    assert torch.equal(got, expected) and torch.equal(got_scales, expected_scales)
    error = (got.T.float() * got_scales[:, None] - values).abs()
    assert bool((error <= got_scales[:, None] / 2 * (1 + 1e-5)).all())


@needs_native
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_products_are_the_composed_reference(x_dtype):
    """int4 and int8 weights, N past one block of columns (and not a whole number of them), scratch reused."""
    n, k = 2048 + 192, 96
    plain = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    x = inputs(37, k).to(x_dtype)
    int4, int8 = quant.quantize_int4(plain, 32), quant.quantize_int8(plain, torch.bfloat16)
    values, scales = native.int4_to_int8(int4.packed, int4.scales_and_zeros, 32, quant.int4_layout().rows,
                                         quant.int4_layout().halves)
    scratch = torch.empty(0, dtype=torch.uint8)
    layout = quant.int4_layout()

    def product(w, bf16_out: bool) -> torch.Tensor:
        if isinstance(w, quant.Int8Weight):
            return native.int8_linear(x, w.values, w.scales, bf16_out, scratch)
        return native.int4_linear(x, w.packed, w.scales_and_zeros, 32, layout.rows, layout.halves, bf16_out, scratch)

    for w, expected in ((int4, product_reference(x, values, scales)),
                        (int8, product_reference(x, int8.values.T, int8.scales.float()))):
        assert torch.equal(product(w, False), expected)
        assert torch.equal(product(w, True), expected.bfloat16())
        assert torch.equal(quant.DynamicInt8Weight(w, scratch).mm(x), product(w, True))
    assert scratch.numel() > 0


@needs_native
def test_int8_products_stay_close_to_the_float_product():
    plain = torch.randn(512, 1024, generator=torch.Generator().manual_seed(6))
    x = inputs(64, 1024)
    w = quant.quantize_int4(plain, 32)
    expected = x @ w.dequantize(torch.float32).T
    error = (quant.DynamicInt8Weight(w, SCRATCH).mm(x).float() - expected).norm() / expected.norm()
    assert float(error) < 0.01  # 8-bit levels per row, the outlier feature kept in fp32: ~0.5% here


@needs_native
def test_as_plain_multiplies_packed_weights_in_int8_and_leaves_the_rest():
    int4, int8 = quant.quantize_int4(torch.randn(128, 64)), quant.quantize_int8(torch.randn(128, 64))
    scratch = {}
    first, second = llama.as_plain(int4, torch.int8, scratch, "wqkv"), llama.as_plain(int8, torch.int8, scratch, "w2")
    assert isinstance(first, quant.DynamicInt8Weight) and isinstance(second, quant.DynamicInt8Weight)
    assert first.scratch is second.scratch is scratch[torch.int8]  # one buffer for every product
    assert quant.input_dtype(first) == torch.float32 and quant.shape(first) == (128, 64)
    plain = torch.randn(128, 64)
    assert llama.as_plain(plain, torch.int8, scratch) is plain


@needs_native
@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_a_runners_int8_prefill_tracks_the_fp32_forward(tiny_model, quantize):
    runner = lean(tiny_model, quantize, prefill_dtype=torch.int8, prefill_from=8)
    tokens = list(range(40, 140))
    got, expected = runner.score(tokens, "prefill"), exact(runner).score(tokens, "prefill")
    assert float((got - expected).abs().max()) < 0.1 * float(expected.abs().max())
    assert float((got.argmax(-1) == expected.argmax(-1)).float().mean()) > 0.9
    cache = runner.new_cache()  # chunks from prefill_from rows run the int8 path; shorter ones the kernels
    runner.forward(tokens[:96], cache)
    torch.testing.assert_close(runner.forward(tokens[96:], cache), runner.score(tokens, "decode")[-1], atol=0.1, rtol=0.1)


FLOATS = {(512, "kernels"): 20, (512, "bf16"): 10, (512, "fp32"): 40, (256, "kernels"): 10, (256, "bf16"): 5,
          (128, "kernels"): 5, (128, "bf16"): 6}


@needs_native
@pytest.mark.parametrize("int8_ms, int8, expected", [
    ({(512, "int8"): 5, (256, "int8"): 2, (128, "int8"): 2, (32, "kernels"): 1, (32, "int8"): 3}, True, ("int8", 128)),
    ({(512, "int8"): 9}, True, ("bf16", 256)),  # faster, but not by PREFILL_MARGIN
    ({(512, "int8"): 5, (256, "int8"): 2, (128, "int8"): 2}, False, ("bf16", 256)),  # not asked for: not timed
    ({}, True, ("bf16", 256)),  # the int8 product raises here
])
def test_the_prefill_policy_keeps_int8_only_where_it_wins_by_the_margin(tiny_model, monkeypatch, int8_ms, int8,
                                                                          expected):
    runner = Format("int4", "bf16").runner(*llama.from_transformers(tiny_model))
    fake_prefill_timings(monkeypatch, {**FLOATS, **int8_ms})
    path, start, ms = autotune.prefill_policy(runner, int8=int8)
    assert (path, start) == expected
    assert ("int8 512" in ms) == (int8 and bool(int8_ms))


def test_the_quality_gate_scores_the_prefill_path_at_any_length(tiny_model):
    """The quality text is shorter than prefill_from may be: its prefill path is scored all the same."""
    runner = Format("int4", "bf16", prefill="int8" if native else "fp32", prefill_from=10_000).runner(
        *llama.from_transformers(tiny_model))
    own = llama.LlamaRunner(*llama.from_transformers(tiny_model)).score(list(range(100, 160)), "exact")
    paths = []
    real = llama.LlamaRunner._hidden
    runner._hidden = lambda ids, cache, weights_as, steps=False: paths.append(weights_as) or real(runner, ids, cache,
                                                                                                    weights_as, steps)
    autotune.check_quality(runner, list(range(100, 160)), own)
    assert paths == [runner.prefill_dtype, None] and runner.prefill_from == 10_000


@pytest.mark.parametrize("int8_passes", [True, False])
def test_a_failing_int8_prefill_falls_back_to_the_float_one(tiny_model, tmp_path, monkeypatch, int8_passes):
    policies = []

    def prefill_policy(runner, int8=True):
        policies.append(int8)
        return ("int8", 128, {}) if int8 else ("bf16", 256, {})

    def check_quality(runner, ids, reference):
        lossy = runner.format.prefill == "int8" and not int8_passes
        return {"perplexity_rise": 0.09 if lossy else 0.0, "agreement": 1.0, "positions": 9.0}

    monkeypatch.setattr(autotune, "prefill_policy", prefill_policy)
    monkeypatch.setattr(autotune, "check_quality", check_quality)
    monkeypatch.setattr(autotune, "time_steps", lambda runner, ids: 0.01)
    monkeypatch.setattr(autotune, "time_matmuls", lambda fmt, base, bound=math.inf, memo=None: 0.01)
    runner, choice = autotune.choose(*llama.from_transformers(tiny_model), "int4", list(range(100, 160)),
                                     tmp_path / "d.json", "ckpt", gate=True)
    assert (choice.format.prefill, choice.format.prefill_from) == (("int8", 128) if int8_passes else ("bf16", 256))
    assert runner.prefill_dtype == (torch.int8 if int8_passes else torch.bfloat16)
    assert policies == ([True] if int8_passes else [True, False])
    policies.clear()
    autotune.choose(*llama.from_transformers(tiny_model), "int4", list(range(100, 160)), tmp_path / "e.json", "ckpt")
    assert policies == [False]  # no quality gate, no int8 activations


def test_a_format_that_fails_the_gate_leaves_int8_prefill_to_the_next(tmp_path, monkeypatch):
    """int8 prefill is judged on the format it runs with: the fastest of a GGUF's packed formats failing on its
    own (with int8 prefill and with float) does not take int8 from the next, which shares its prefill timing."""
    from tornchat import checkpoint
    from tornchat.weights import gguf_file

    checked, policies = [], []

    def check_quality(runner, ids, reference):
        checked.append((runner.format.quantize, runner.format.prefill))
        lossy = runner.format.quantize == "packed-int4-head"
        return {"perplexity_rise": 0.09 if lossy else 0.0, "agreement": 1.0, "positions": 9.0}

    def prefill_policy(runner, int8=True):
        policies.append(int8)
        return ("int8", 128, {}) if int8 else ("bf16", 256, {})

    fake_machine(monkeypatch, {("packed-int4-head", "bf16"): 1.0, ("packed", "bf16"): 2.0, ("packed", "fp32"): 3.0})
    monkeypatch.setattr(autotune, "prefill_policy", prefill_policy)
    monkeypatch.setattr(autotune, "check_quality", check_quality)
    monkeypatch.setattr(autotune, "quality_reference", lambda base, runners, steps, ids: None)
    runner, choice = autotune.choose(*gguf_file.load(checkpoint.default_gguf_path()), "packed", list(range(100, 160)),
                                     tmp_path / "d.json", "ckpt", gate=True)
    assert checked == [("packed-int4-head", "int8"), ("packed-int4-head", "bf16"), ("packed", "int8")]
    assert policies == [True, False]  # the float policy timed once, for the format that failed
    assert (choice.format.quantize, choice.format.prefill) == ("packed", "int8") and runner.prefill_dtype == torch.int8
