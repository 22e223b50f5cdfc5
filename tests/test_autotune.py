"""--quantize auto: decided by timing on this machine, gated by quality, remembered per CPU.

The timings and CPU probes are faked here to check the choices another CPU
would make; one test runs the real measurement on a tiny model.
"""
import json
import logging
import math
import time
from dataclasses import asdict, replace

import pytest
import torch

from tornchat.engine import autotune, chunk_attention, cpu, llama, quant
from tornchat.engine.autotune import Format
from tornchat.weights import gguf_file

IDS = list(range(100, 160))


def plain(model):
    """Config and plain weights, fresh for each choice (a choice may give the plain layers up)."""
    return llama.from_transformers(model)


def key(fmt: Format) -> tuple:
    """How fake_machine's tables name a format: (quantize, inputs), with "vnni" added for gemv.cpp's kernels."""
    return (fmt.quantize, fmt.inputs) + (("vnni",) if fmt.matmul == "vnni" else ())


def fake_machine(monkeypatch, step_ms: dict, estimate_ms: dict | None = None, quality: dict | None = None,
                 missing: tuple = (), vnni: bool = False):
    """Timings and quality by ``key``; formats in missing raise as a kernel this CPU lacks; ``vnni``: whether
    the CPU runs csrc/gemv.cpp's kernels."""
    calls = {"matmuls": 0, "steps": 0, "quality": 0}

    def time_matmuls(fmt, base, bound=math.inf, memo=None):
        calls["matmuls"] += 1
        if key(fmt) in missing:
            raise RuntimeError("kernel not built for this CPU\nsecond line")
        return (estimate_ms or step_ms)[key(fmt)] / 1000

    def time_steps(runner, ids):
        calls["steps"] += 1
        return step_ms[key(getattr(runner, "format", Format("none")))] / 1000

    def check_quality(runner, ids, reference):
        calls["quality"] += 1
        return {"perplexity_rise": (quality or {}).get(key(runner.format), 0.0), "agreement": 1.0, "positions": 9.0}

    monkeypatch.setattr(quant, "vnni_runs", lambda: vnni)

    monkeypatch.setattr(autotune, "time_matmuls", time_matmuls)
    monkeypatch.setattr(autotune, "time_steps", time_steps)
    monkeypatch.setattr(autotune, "check_quality", check_quality)
    monkeypatch.setattr(autotune, "bf16_cache_pays", lambda base: (False, {}))
    monkeypatch.setattr(autotune, "own_attention_pays", lambda base, dtype: (False, {}))
    monkeypatch.setattr(autotune, "chunk_attention_pays", lambda base: (False, {}))
    monkeypatch.setattr(autotune, "prefill_policy", lambda runner, int8=True: ("kernels", 1, {}))
    return calls


AVX2_LIKE = {("none", "fp32"): 40.0, ("bf16", "bf16"): 12.0, ("int8", "bf16"): 9.0, ("int8", "fp32"): 200.0,
             ("int4", "bf16"): 10.0, ("int4", "fp32"): 400.0}


def test_fastest_format_whose_quality_holds(tiny_model, tmp_path, monkeypatch):
    calls = fake_machine(monkeypatch, AVX2_LIKE, quality={("int8", "bf16"): 0.05})  # int8 fastest, but lossy
    runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format == Format("int4", "bf16", "fp32") and runner.format == choice.format
    assert isinstance(runner.layers[0].w13, quant.Int4Weight) and quant.input_dtype(runner.layers[0].w13) == torch.bfloat16
    assert not choice.cached and calls["quality"] == 2
    # Only candidates within 3x of the best estimate get whole steps timed: not fp32, nor the scalar fp32-input paths.
    assert calls["steps"] == 3 and len(choice.estimate_ms) == 6
    assert choice.step_ms == {"bf16 (bf16 inputs, fp32 cache, sdpa attention, prefill kernels)": 12.0,
                              "int8 (bf16 inputs, fp32 cache, sdpa attention, prefill kernels)": 9.0,
                              "int4 (bf16 inputs, fp32 cache, sdpa attention, prefill kernels)": 10.0}


@pytest.mark.parametrize("lossy", [False, True])
def test_vnni_kernels_are_candidates_the_quality_gate_may_refuse(tiny_model, tmp_path, monkeypatch, lossy):
    """Where the CPU runs gemv.cpp's kernels, auto times int4 and int8 through them too; their int8
    activations are kept only if the gate passes them, else PyTorch's kernels are."""
    step_ms = {**AVX2_LIKE, ("int8", "bf16", "vnni"): 7.0, ("int4", "bf16", "vnni"): 6.0}
    quality = {("int4", "bf16", "vnni"): 0.05, ("int8", "bf16", "vnni"): 0.05} if lossy else {}
    fake_machine(monkeypatch, step_ms, quality=quality, vnni=True)
    runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    expected = Format("int8", "bf16", "fp32") if lossy else Format("int4", "bf16", "fp32", matmul="vnni")
    assert choice.format == expected and len(choice.estimate_ms) == 8
    assert runner.layers[0].w13.vnni == (not lossy and quant.int4_layout() == quant.Int4Layout(64, True))


def test_whole_steps_overrule_the_one_layer_estimate(tiny_model, tmp_path, monkeypatch):
    estimates = {**AVX2_LIKE, ("int8", "bf16"): 4.0}  # cache-resident weights flatter int8
    fake_machine(monkeypatch, AVX2_LIKE | {("int8", "bf16"): 11.0}, estimate_ms=estimates)
    _, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format.quantize == "int4"


def test_a_cpu_where_fp32_inputs_win(tiny_model, tmp_path, monkeypatch):
    """As the AVX-512 machine without bf16 measured for int4 (PERF-NOTES.md)."""
    fake_machine(monkeypatch, {**AVX2_LIKE, ("int4", "fp32"): 5.0, ("int4", "bf16"): 30.0, ("bf16", "bf16"): 50.0})
    runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format == Format("int4", "fp32") and quant.input_dtype(runner.layers[0].w13) == torch.float32


def test_kernels_missing_on_this_cpu_are_skipped(tiny_model, tmp_path, monkeypatch, caplog):
    fake_machine(monkeypatch, AVX2_LIKE, missing={("int8", "bf16"), ("int4", "bf16")})
    with caplog.at_level(logging.INFO, logger="tornchat.engine"):
        _, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format == Format("bf16", "bf16")
    assert "do not run here: kernel not built for this CPU" in caplog.text and "second line" not in caplog.text
    fake_machine(monkeypatch, AVX2_LIKE, missing={("bf16", "bf16")})
    with pytest.raises(autotune.NoFormat, match="--quantize bf16: none of its kernels runs on this CPU"):
        autotune.choose(*plain(tiny_model), "bf16", IDS, tmp_path / "d.json", "ckpt")


def test_an_explicit_mode_times_its_inputs_and_skips_the_quality_gate(tiny_model, tmp_path, monkeypatch):
    calls = fake_machine(monkeypatch, {**AVX2_LIKE, ("int8", "fp32"): 8.0}, quality={("int8", "fp32"): 0.5})
    runner, choice = autotune.choose(*plain(tiny_model), "int8", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format == Format("int8", "fp32") and calls["quality"] == 0
    assert set(choice.estimate_ms) == {"int8 (bf16 inputs, fp32 cache, sdpa attention, prefill kernels)", "int8 (fp32 inputs, fp32 cache, sdpa attention, prefill kernels)"}


def test_int4_is_no_candidate_where_the_shapes_do_not_fit():
    assert [f.quantize for f in autotune.candidates("auto", int4_fits=False)] == ["none", "bf16", "int8", "int8"]
    assert autotune.candidates("int4", int4_fits=False) == []


def test_the_bf16_cache_goes_with_the_packed_formats_where_it_pays(tiny_model, tmp_path, monkeypatch):
    fake_machine(monkeypatch, AVX2_LIKE)
    monkeypatch.setattr(autotune, "bf16_cache_pays", lambda base: (True, {}))
    runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format == Format("int8", "bf16", "bf16") and runner.new_cache().kv.dtype == torch.bfloat16
    # ... and with it the chunk attention autotune timed faster
    monkeypatch.setattr(autotune, "chunk_attention_pays", lambda base: (True, {}))
    runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "e.json", "ckpt")
    assert choice.format == Format("int8", "bf16", "bf16", chunk_attention="products")
    assert runner.chunk_attention == ("products" if chunk_attention.runs(torch.bfloat16, runner.device) else "sdpa")


def test_the_prefill_policy_goes_with_the_kept_format(tiny_model, tmp_path, monkeypatch):
    fake_machine(monkeypatch, AVX2_LIKE)
    monkeypatch.setattr(autotune, "prefill_policy", lambda runner, int8=True: ("bf16", 128, {}))
    runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format == Format("int8", "bf16", "fp32", "bf16", 128)
    assert (runner.prefill_dtype, runner.prefill_from) == (torch.bfloat16, 128)
    assert isinstance(runner.layers[0].w13, quant.Int8Weight)  # one copy: prefill dequantizes the packed weights
    again, cached = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert cached.cached and (again.prefill_dtype, again.prefill_from) == (torch.bfloat16, 128)


def fake_prefill_timings(monkeypatch, table: dict):
    """autotune._seconds from table[rows, path], path being kernels, bf16, fp32 or int8 as the timed matmul shows."""
    runs = []
    real_linear = quant.linear

    def linear(x, w):
        if isinstance(w, quant.DynamicInt8Weight):
            path = "int8"
        else:
            path = "kernels" if not isinstance(w, torch.Tensor) else {torch.bfloat16: "bf16", torch.float32: "fp32"}[w.dtype]
        runs.append((x.shape[0], path))
        if (x.shape[0], path) not in table:
            raise RuntimeError("not built here")
        return real_linear(x, w)

    def timed(fn, repeats, calls, limit=math.inf):
        runs.clear()
        fn()
        return table[runs[-1]] / 1000 / 4  # four matrices per layer

    monkeypatch.setattr(quant, "linear", linear)
    monkeypatch.setattr(autotune, "_seconds", timed)


@pytest.mark.parametrize("table, expected", [
    ({(512, "kernels"): 10, (512, "bf16"): 4, (512, "fp32"): 8, (256, "kernels"): 5, (256, "bf16"): 2,
      (128, "kernels"): 2, (128, "bf16"): 3}, ("bf16", 256)),
    ({(512, "kernels"): 10, (512, "bf16"): 9, (512, "fp32"): 8, (256, "kernels"): 5, (256, "fp32"): 6}, ("fp32", 512)),
    ({(512, "kernels"): 3, (512, "bf16"): 4, (512, "fp32"): 8}, ("kernels", 1)),
])
def test_the_prefill_policy_is_timed_by_chunk_length(tiny_model, monkeypatch, table, expected):
    runner = autotune.Format("int8", "bf16").runner(*plain(tiny_model))
    fake_prefill_timings(monkeypatch, table)
    dtype, start, ms = autotune.prefill_policy(runner)
    assert (dtype, start) == expected and ms["kernels 512"] == pytest.approx(table[512, "kernels"])


def test_no_dequantized_prefill_where_bf16_matmuls_do_not_run(tiny_model, monkeypatch):
    runner = autotune.Format("int8", "bf16").runner(*plain(tiny_model))
    real_linear = quant.linear

    def refuse_bf16(x, w):
        if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16:
            raise RuntimeError("bf16 matmul not built for this CPU")
        return real_linear(x, w)

    monkeypatch.setattr(quant, "linear", refuse_bf16)
    dtype, _, ms = autotune.prefill_policy(runner, int8=False)  # the float paths alone
    assert dtype in ("fp32", "kernels") and "bf16 512" not in ms


@pytest.mark.parametrize("decode, prefill, pays", [((1, 2), (10, 10), True), ((2, 1), (10, 10), False),
                                                   ((1, 2), (20, 10), False), ((2.04, 2), (10.4, 10), True)])
def test_a_bf16_cache_is_kept_unless_it_costs_decode_or_prefill(tiny_model, monkeypatch, decode, prefill, pays):
    table = {(torch.bfloat16, 1): decode[0], (torch.float32, 1): decode[1],
             (torch.bfloat16, 64): prefill[0], (torch.float32, 64): prefill[1]}
    monkeypatch.setattr(autotune, "time_attention", lambda base, dtype, rows: table[dtype, rows])
    decided, ms = autotune.bf16_cache_pays(llama.LlamaRunner(*plain(tiny_model)))
    assert decided == pays and ms["decode bf16"] == 1000 * decode[0]


def test_the_decision_is_cached_per_cpu_checkpoint_and_mode(tiny_model, tmp_path, monkeypatch):
    cache_file = tmp_path / "d.json"
    calls = fake_machine(monkeypatch, AVX2_LIKE)
    _, first = autotune.choose(*plain(tiny_model), "auto", IDS, cache_file, "ckpt")
    measured = dict(calls)
    runner, again = autotune.choose(*plain(tiny_model), "auto", IDS, cache_file, "ckpt")
    assert calls == measured and again.cached and again.format == first.format == Format("int8", "bf16")
    assert runner.format == again.format and isinstance(runner.layers[0].w13, quant.Int8Weight)
    stored = json.loads(cache_file.read_text())
    assert len(stored) == 1 and "packed" not in cache_file.read_text()  # the decision, never weights
    about = next(iter(stored.values()))["for"]
    assert about["cpu"] == cpu.model_name() and about["torch"] == torch.__version__ and about["checkpoint"] == "ckpt"
    for change in (lambda: autotune.choose(*plain(tiny_model), "auto", IDS, cache_file, "another checkpoint"),
                   lambda: autotune.choose(*plain(tiny_model), "int4", IDS, cache_file, "ckpt")):
        before = calls["matmuls"]
        change()
        assert calls["matmuls"] > before
    monkeypatch.setattr(cpu, "model_name", lambda: "Some Other CPU")
    before = calls["matmuls"]
    autotune.choose(*plain(tiny_model), "auto", IDS, cache_file, "ckpt")
    assert calls["matmuls"] > before and len(json.loads(cache_file.read_text())) == 4


def test_the_cache_file_keeps_the_latest_decisions(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "MAX_DECISIONS", 3)
    fake_machine(monkeypatch, AVX2_LIKE)
    for checkpoint in ("a", "b", "c", "d", "b"):
        autotune.choose(*plain(tiny_model), "int8", IDS, tmp_path / "d.json", checkpoint)
    kept = [entry["for"]["checkpoint"] for entry in json.loads((tmp_path / "d.json").read_text()).values()]
    assert kept == ["b", "c", "d"]  # a cached decision is read, not written again


def test_real_measurement_on_a_tiny_model(tiny_model, tmp_path, caplog):
    """No fakes: every candidate that runs on this CPU is timed, and the choice passes its own quality gate."""
    with caplog.at_level(logging.INFO, logger="tornchat.engine"):
        runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "tiny")
    fmt = choice.format
    assert (fmt.quantize, fmt.inputs) in [(f.quantize, f.inputs) for f in autotune.candidates("auto", True)]
    assert choice.step_ms and all(ms > 0 for ms in choice.step_ms.values())
    decode_label = replace(choice.format, prefill="kernels", prefill_from=1).label()  # steps are timed before prefill
    assert choice.step_ms[decode_label] == min(choice.step_ms.values()) or "rejected" in caplog.text
    if choice.format.quantize != "none":
        own = llama.LlamaRunner(*plain(tiny_model)).score(IDS, "exact")
        assert autotune.passes(autotune.check_quality(runner, IDS, own))
    assert "chosen in" in caplog.text


def test_check_quality_measures_the_decode_and_prefill_paths(tiny_model):
    own_runner = llama.LlamaRunner(*plain(tiny_model))
    own = own_runner.score(IDS, "exact")
    same = autotune.check_quality(own_runner, IDS, own)  # decode and prefill read the model's own weights
    assert same["perplexity_rise"] == pytest.approx(0, abs=1e-6) and same["agreement"] == 1.0
    int8 = Format("int8", "bf16", prefill="fp32", prefill_from=8).runner(*plain(tiny_model))
    assert autotune.passes(autotune.check_quality(int8, IDS, own))
    for path in ("prefill", "decode"):  # break one path: its logits prefer the opposite
        broken = Format("int8", "bf16", prefill="fp32", prefill_from=8).runner(*plain(tiny_model))
        real_score = broken.score
        broken.score = lambda ids, mode, path=path, real=real_score: -real(ids, mode) if mode == path else real(ids, mode)
        quality = autotune.check_quality(broken, IDS, own)
        assert quality["perplexity_rise"] > 0.02 and not autotune.passes(quality)


def test_agreement_counts_only_where_the_model_decides(tiny_model):
    """A greedy choice changed where the model's own first choice is sure (NEAR_TIE above the next, holding
    DECIDED of the probability) fails the gate; changed among flat logits, however wide the first two's gap
    (a random-weight model's), it is not counted."""
    runner = llama.LlamaRunner(*plain(tiny_model))
    vocab = runner.score(IDS, "exact").shape[-1]
    rows = torch.arange(len(IDS))
    for first, counted in ((2 * autotune.NEAR_TIE, False), (20.0, True)):
        reference = torch.zeros(len(IDS), vocab)
        reference[rows, 7] = first  # 2 * NEAR_TIE above the rest: a tie by probability only (vocab > 8)
        swapped = torch.zeros(len(IDS), vocab)
        swapped[rows, 9] = first
        runner.score = lambda ids, mode, swapped=swapped: swapped
        quality = autotune.check_quality(runner, IDS, reference)
        assert quality["agreement"] == (0.0 if counted else 1.0)
        assert quality["positions"] == (len(IDS) if counted else 0)


def test_a_quantized_ggufs_blocks_are_a_format_whose_inputs_are_timed(tmp_path, monkeypatch):
    """autotune's "packed" format: a GGUF's blocks as loaded, fed bf16 or fp32 inputs; no repacking."""
    from tornchat import checkpoint
    from tornchat.weights import gguf_file

    config, weights = gguf_file.load(checkpoint.default_gguf_path())
    # The embedded model's head is Q8_0, so int8; rounding it onto int4 is a candidate, whose quality decides.
    fake_machine(monkeypatch, {("packed", "bf16"): 5.0, ("packed", "fp32"): 40.0, ("packed-int4-head", "bf16"): 4.0},
                 quality={("packed-int4-head", "bf16"): 0.08})
    runner, choice = autotune.choose(config, weights, "packed", IDS, tmp_path / "d.json", "gguf", gate=True)
    assert choice.format == Format("packed", "bf16") and runner.layers[0].w13.packed is weights.layers[0].w13.packed
    assert quant.input_dtype(runner.layers[0].w13) == torch.bfloat16 and isinstance(runner.head, quant.Int8Weight)
    assert [f.quantize for f in autotune.candidates("packed", True, int8_layers=True, int8_head=True)] == [
        "packed", "packed", "packed-int4", "packed-int4-head"]
    narrowed = Format("packed-int4-head", "bf16").runner(config, weights)
    assert isinstance(narrowed.head, quant.Int4Weight) and narrowed.weights.embed is narrowed.head
    step = narrowed.head.dequantize(torch.float32) - weights.head.dequantize(torch.float32)
    assert step.abs().max() < weights.head.dequantize(torch.float32).abs().max() / 7  # half an int4 step at most


def test_a_candidate_is_timed_only_until_it_is_ruled_out(tiny_model):
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    assert autotune._seconds(slow, limit=0.005) >= 0.02 and len(calls) == 2  # two calls over the limit say enough
    calls.clear()
    durations = iter([0.03] + [0.0] * 20)  # a first call's one-time costs alone do not rule fn out

    def first_slow():
        calls.append(1)
        time.sleep(next(durations))

    assert autotune._seconds(first_slow, repeats=2, calls=1, limit=0.01) < 0.01 and len(calls) == 5
    calls.clear()
    autotune._seconds(slow, repeats=2, calls=1, limit=1.0)
    assert len(calls) == 4  # warm-up, a batch, two repeats
    base = llama.LlamaRunner(*plain(tiny_model))
    timed = []
    real_seconds = autotune._seconds
    autotune._seconds = lambda fn, repeats=7, calls=10, limit=math.inf: timed.append(limit) or 1.0
    try:
        estimate = autotune.time_matmuls(Format("int8", "bf16"), base, bound=0.5)
    finally:
        autotune._seconds = real_seconds
    assert len(timed) == 1 and estimate >= 0.5  # the first matrix alone passed the bound: no more timing
    assert timed[0] == pytest.approx(0.5 / len(base.layers))


def test_candidates_that_round_the_same_matrices_share_them(monkeypatch):
    from tornchat import checkpoint
    from tornchat.weights import gguf_file

    config, weights = gguf_file.load(checkpoint.default_gguf_path())
    rounded = []
    real_narrowed = quant.narrowed
    monkeypatch.setattr(quant, "narrowed", lambda w, inputs: rounded.append(w) or real_narrowed(w, inputs))
    memo = {}
    first = Format("packed-int4-head", "bf16").runner(config, weights, memo=memo)
    second = Format("packed-int4-head", "bf16").runner(config, weights, memo=memo)
    assert first.head is second.head and isinstance(first.head, quant.Int4Weight)
    assert rounded.count(weights.head) == 1  # rounded once for both
    Format("packed-int4-head", "fp32").runner(config, weights, memo=memo)
    assert rounded.count(weights.head) == 2  # other inputs: another rounding


def test_quality_scores_one_path_where_prefill_runs_the_decode_kernels(tiny_model):
    own = llama.LlamaRunner(*plain(tiny_model)).score(IDS, "exact")
    # A prefill path is scored even where the text is shorter than prefill_from: a chunk that long takes it.
    for prefill, prefill_from, modes in (("kernels", 1, ["decode"]), ("fp32", len(IDS) + 1, ["prefill", "decode"]),
                                         ("fp32", 8, ["prefill", "decode"])):
        runner = Format("int8", "bf16", prefill=prefill, prefill_from=prefill_from).runner(*plain(tiny_model))
        scored = []
        real_score = runner.score
        runner.score = lambda ids, mode, real=real_score: scored.append(mode) or real(ids, mode)
        assert autotune.passes(autotune.check_quality(runner, IDS, own))
        assert scored == modes and runner.prefill_from == prefill_from


@pytest.mark.parametrize("own_faster", [True, False])
def test_the_decode_steps_attention_is_the_faster_one(tiny_model, tmp_path, monkeypatch, own_faster):
    fake_machine(monkeypatch, AVX2_LIKE)
    monkeypatch.setattr(autotune, "own_attention_pays", lambda base, dtype: (own_faster, {"own": 1.0, "sdpa": 2.0}))
    runner, choice = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert choice.format.attention == runner.attention == ("own" if own_faster else "sdpa")
    assert runner.decode_step is not None
    cached, again = autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert again.cached and cached.attention == runner.attention


def test_own_attention_is_timed_against_sdpa(tiny_model):
    pays, ms = autotune.own_attention_pays(llama.LlamaRunner(*plain(tiny_model)), torch.float32)
    assert set(ms) == {"own", "sdpa"} and pays == (ms["own"] < ms["sdpa"])


def test_a_quantized_files_candidates_are_checked_against_its_own_blocks():
    """What auto changes beyond the file (int8 blocks rounded onto int4) is what it checks: the reference is
    the file's blocks through the fastest of their timed kernels, not an fp32 forward of the whole file."""
    from tornchat import checkpoint
    from tornchat.weights import gguf_file

    config, weights = gguf_file.load(checkpoint.default_gguf_path())
    base = llama.LlamaRunner(config, weights)
    formats = [Format("packed", "bf16"), Format("packed", "fp32"), Format("packed-int4-head", "bf16")]
    runners = {fmt: fmt.runner(config, weights) for fmt in formats}
    steps = dict(zip(formats, (0.005, 0.04, 0.004)))
    ids = IDS[:12]
    reference = autotune.quality_reference(base, runners, steps, ids)
    assert torch.equal(reference, runners[formats[0]].score(ids, "decode"))  # as loaded, the faster inputs
    vnni = Format("packed", "bf16", matmul="vnni")  # int8 activations: never the reference
    runners[vnni], steps[vnni] = vnni.runner(config, weights), 0.001
    assert torch.equal(autotune.quality_reference(base, runners, steps, ids), reference)
    del steps[formats[0]], steps[formats[1]]  # no as-loaded format timed with PyTorch's kernels: built for it
    assert torch.equal(autotune.quality_reference(base, runners, steps, ids), reference)
    narrowed = autotune.check_quality(runners[formats[2]], ids, reference)
    assert narrowed["perplexity_rise"] != 0 and autotune.check_quality(runners[formats[0]], ids, reference)[
        "perplexity_rise"] == 0


def test_a_first_start_serves_with_the_modes_own_weights_fed_the_faster_inputs(tiny_model, monkeypatch):
    fake_machine(monkeypatch, {**AVX2_LIKE, ("int8", "fp32"): 8.0})
    served = autotune.provisional(*plain(tiny_model), "int8")
    assert isinstance(served.layers[0].w13, quant.Int8Weight) and quant.input_dtype(served.layers[0].w13) == torch.float32
    assert autotune.provisional(*plain(tiny_model), "auto").layers[0].w13.dtype == torch.float32  # the model's own
    fake_machine(monkeypatch, AVX2_LIKE, missing={("int4", "bf16"), ("int4", "fp32")})
    with pytest.raises(autotune.NoFormat, match="--quantize int4: none of its kernels runs"):
        autotune.provisional(*plain(tiny_model), "int4")


def test_the_measurement_runs_in_slices_and_decides_what_choose_does(tiny_model, tmp_path, monkeypatch):
    calls = fake_machine(monkeypatch, AVX2_LIKE, quality={("int8", "bf16"): 0.05})
    steps = autotune.measure(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    slices = 0
    with pytest.raises(StopIteration) as done:
        while True:
            before = dict(calls)
            next(steps)
            slices += 1
            assert sum(calls.values()) - sum(before.values()) <= 1  # at most one timing or quality check a slice
    runner, choice = done.value.value
    assert slices >= 10 and choice.format == Format("int4", "bf16", "fp32") and runner.format == choice.format
    assert autotune.recall(tmp_path / "d.json", autotune.cache_key("auto", "ckpt"))["format"]["quantize"] == "int4"


def test_a_later_start_serves_the_loaded_blocks_while_the_kept_format_is_built(tmp_path, monkeypatch):
    """A decision that rounds a file's int8 matrices onto int4 takes seconds at every start: it is built as
    one engine slice, from the same weights the provisional runner (its inputs known: no timing) reads."""
    import gguf_files
    from test_gguf import MIXES

    calls = fake_machine(monkeypatch, AVX2_LIKE)
    config, weights = gguf_file.load(gguf_files.write(tmp_path / "m.gguf", MIXES["q4_k_m"]))
    known = {"format": asdict(Format("packed-int4", inputs="fp32")), "step_ms": {}, "estimate_ms": {}, "quality": {}}
    assert autotune.rebuilds(known) and not autotune.rebuilds({**known, "format": asdict(Format("packed", "bf16"))})
    served = autotune.provisional(config, weights, "packed", known["format"]["inputs"])
    assert calls["matmuls"] == 0 and quant.input_dtype(served.layers[0].w2) == torch.float32
    assert isinstance(served.layers[0].w2, quant.Int8Weight)  # Q6_K as loaded
    steps = autotune.recalled(config, weights, known)
    next(steps)
    with pytest.raises(StopIteration) as done:
        next(steps)
    runner, choice = done.value.value
    assert choice.cached and runner.format == Format("packed-int4", inputs="fp32")
    assert isinstance(runner.layers[0].w2, quant.Int4Weight) and isinstance(served.layers[0].w2, quant.Int8Weight)


def test_decisions_made_before_new_candidates_are_measured_again(tiny_model, tmp_path, monkeypatch):
    fake_machine(monkeypatch, AVX2_LIKE)
    autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")
    assert autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")[1].cached
    monkeypatch.setattr(autotune, "CANDIDATES", autotune.CANDIDATES + 1)  # a version that times more formats
    assert not autotune.choose(*plain(tiny_model), "auto", IDS, tmp_path / "d.json", "ckpt")[1].cached
