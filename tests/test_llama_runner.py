"""The lean Llama forward against transformers' modules, and int4 packing.

Tiny random models check the cache mechanics fast; the real SmolLM2 checks
that greedy output is the same token for token, through the engine's KV
reuse path included.
"""

import pytest
import torch
import torch.nn.functional as F

from tornchat import checkpoint, prompt
from tornchat.config import Config
from tornchat.engine import cpu, llama, quant
from tornchat.engine.build import make_runner
from tornchat.engine.model import HFRunner
from tornchat.engine.slots import SlotPool
from tornchat.engine.types import GenerationRequest, SamplingParams
from tornchat.engine.worker import Engine

from runners import decode_nll, exact, lean

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "List three uses of a paperclip.",
]


def run_chunks(runner, cache, tokens: list[int], chunk: int) -> torch.Tensor:
    for start in range(0, len(tokens), chunk):
        logits = runner.forward(tokens[start : start + chunk], cache)
    return logits


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_qwen2"])
def test_tiny_logits_match_hf_prefill_chunks_and_decode(model_name, request):
    model = request.getfixturevalue(model_name)
    hf, lean_runner = HFRunner(model), lean(model)
    tokens = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    hf_cache, lean_cache = hf.new_cache(), lean_runner.new_cache()
    expected = run_chunks(hf, hf_cache, tokens, 40)
    got = run_chunks(lean_runner, lean_cache, tokens, 7)  # uneven chunks: masks with a cached prefix
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for token in (5, 17, 99):
        torch.testing.assert_close(lean_runner.forward([token], lean_cache), hf.forward([token], hf_cache), atol=1e-4, rtol=1e-4)
    assert lean_cache.length == 43


def test_cache_grows_in_chunks_and_truncate_recomputes(tiny_model):
    runner = lean(tiny_model)
    per_position = 2 * 2 * 2 * 16 * 4  # layers * (k, v) * kv_heads * head_dim * fp32 bytes
    cache = runner.new_cache()
    assert runner.cache_bytes(cache) == 0
    tokens = list(range(10, 310))
    runner.forward(tokens[:200], cache)
    assert runner.cache_bytes(cache) == llama.CACHE_CHUNK * per_position
    grown = runner.forward(tokens[200:], cache)  # crosses a chunk boundary: the prefix is copied over
    assert runner.cache_bytes(cache) == 2 * llama.CACHE_CHUNK * per_position

    fresh = runner.new_cache()
    torch.testing.assert_close(run_chunks(runner, fresh, tokens, 512), grown)

    forked = runner.fork(cache, 100)
    assert runner.cache_bytes(forked) == llama.CACHE_CHUNK * per_position
    torch.testing.assert_close(runner.forward([7], forked), run_chunks(runner, runner.new_cache(), tokens[:100] + [7], 512))

    runner.truncate(cache, 150)
    runner.truncate(cache, 999)  # never lengthens
    assert cache.length == 150
    rewritten = runner.forward([7, 8, 9], cache)
    torch.testing.assert_close(rewritten, run_chunks(runner, runner.new_cache(), tokens[:150] + [7, 8, 9], 512))


def test_context_is_capped(tiny_model):
    runner = lean(tiny_model)  # max_position_embeddings = 512
    cache = runner.new_cache()
    runner.forward(list(range(511)), cache)
    runner.forward([3], cache)
    assert runner.cache_bytes(cache) == 512 * 2 * 2 * 2 * 16 * 4  # capped at the context, not a whole chunk more
    with pytest.raises(ValueError):
        runner.forward([4], cache)


@pytest.mark.parametrize("inputs", [torch.bfloat16, torch.float32])
def test_int4_round_trip_and_kernel_match_dequantized_weights(inputs):
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    packed = quant.quantize_int4(weight, group_size=32, inputs=inputs)
    dequantized = quant.fake_quantize_int4(weight, group_size=32)
    step = (weight.reshape(96, 4, 32).amax(-1) - weight.reshape(96, 4, 32).amin(-1)) / 15
    assert ((dequantized - weight).abs().reshape(96, 4, 32) <= step[..., None] / 2 + 1e-5).all()
    # Weights already on a 16-level grid (a Q4_1 GGUF's) come back exactly.
    torch.testing.assert_close(quant.fake_quantize_int4(dequantized, 32), dequantized, atol=1e-5, rtol=0)
    assert not quant.supports(torch.zeros(96, 48), 32)
    # The kernel computes (q - 8) * scale + zero, with scales, zeros and inputs in its own dtype.
    q, _, _ = quant.group_levels(weight, 32)
    scales, zeros = packed.scales_and_zeros.float().unbind(-1)  # [groups, N]
    kernel_weight = ((q - 8) * scales.T[..., None] + zeros.T[..., None]).reshape(96, 128)
    x = torch.randn(3, 128)
    out = quant.linear(x, packed)
    assert out.dtype == inputs == quant.input_dtype(packed)  # the kernel's, for the next projection to take as it is
    torch.testing.assert_close(out.float(), F.linear(x.to(inputs).float(), kernel_weight), atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), F.linear(x, dequantized), atol=1e-1, rtol=2e-2)


@pytest.mark.parametrize("inputs", [torch.bfloat16, torch.float32])
def test_int8_round_trip_and_kernel_match_dequantized_weights(inputs):
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    packed = quant.quantize_int8(weight, inputs)
    assert packed.values.dtype == torch.int8 and packed.scales.shape == (96,)
    dequantized = quant.fake_quantize_int8(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    # Half a step of rounding, plus the scale's own rounding to bf16 (2^-9 relative).
    assert ((dequantized - weight).abs() <= step / 2 + weight.abs() * 2**-8 + 1e-6).all()
    assert not torch.equal(dequantized, weight)
    x = torch.randn(15, 128)
    out = quant.linear(x, packed)
    assert out.shape == (15, 96) and out.dtype == inputs == quant.input_dtype(packed)
    kernel_weight = packed.values.float() * packed.scales.float()[:, None]
    torch.testing.assert_close(out.float(), F.linear(x.to(inputs).float(), kernel_weight), atol=3e-2, rtol=1e-2)


def prefill_then_step(runners, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each runner prefills tokens into a cache of its own, then decodes one step: (prefill logits, step logits)."""
    caches = [r.new_cache() for r in runners]
    prefill = [r.forward(tokens, c) for r, c in zip(runners, caches)]
    return prefill, [r.forward([11], c, decode=True) for r, c in zip(runners, caches)]


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("inputs", [torch.bfloat16, torch.float32])
def test_one_copy_of_packed_weights_serves_decode_and_prefill(tiny_model, mode, inputs):
    """Decode steps run the packed kernels; a prefill chunk from prefill_from rows dequantizes the same packed
    weights, layer by layer, and computes exactly what plain weights of those values compute."""
    fp32 = lean(tiny_model)
    packed = lean(tiny_model, mode, inputs, prefill_dtype=torch.float32, prefill_from=16)
    layer_type = quant.Int4Weight if mode == "int4" else quant.Int8Weight
    assert all(isinstance(layer.w13, layer_type) and quant.input_dtype(layer.w13) == inputs for layer in packed.layers)
    assert isinstance(packed.head, quant.Int8Weight)  # int4 heads cost SmolLM2 8% perplexity
    assert packed.weights.embed is packed.head  # tied: the head's rows are the embedding, one copy
    reference = exact(packed)
    tokens = list(range(50, 80))
    torch.testing.assert_close(packed.score(tokens, "prefill"), reference.score(tokens, "prefill"), atol=0, rtol=0)
    prefill, steps = prefill_then_step((fp32, packed, reference), tokens)  # a forward's last row: the head's kernel
    torch.testing.assert_close(prefill[1], prefill[2], atol=2e-2, rtol=2e-2)
    short = [r.forward(list(range(50, 60)), r.new_cache()) for r in (packed, reference)]  # 10 rows: the kernels
    torch.testing.assert_close(short[0], short[1], atol=2e-2, rtol=2e-2)
    assert steps[1].dtype == torch.float32
    torch.testing.assert_close(steps[1], steps[2], atol=2e-2, rtol=2e-2)  # only the inputs' rounding differs
    assert not torch.equal(steps[1], steps[0])  # it really used other weights


@pytest.mark.parametrize("onednn", [True, False])
def test_bf16_runner_decodes_with_bf16_weights_with_or_without_onednn(tiny_model, monkeypatch, onednn):
    """Where oneDNN's bf16 linear refuses the CPU (AVX2 only), bf16 decode falls back to plain bf16 weights."""
    if onednn and not cpu.packs_bf16():
        pytest.skip(f"oneDNN has no packed bf16 linear on this CPU ({cpu.describe()}); the fallback case runs")
    monkeypatch.setattr(cpu, "packs_bf16", lambda: onednn)
    fp32, bf16 = lean(tiny_model), lean(tiny_model, "bf16")
    expected_type = quant.Bf16Weight if onednn else torch.Tensor
    assert all(isinstance(layer.w13, expected_type) for layer in bf16.layers)
    assert isinstance(bf16.head, expected_type) and quant.input_dtype(bf16.head) == torch.bfloat16
    # oneDNN's layout cannot give rows back, so the embedding keeps its own plain copy; plain bf16 can.
    assert (bf16.weights.embed is bf16.head) == (not onednn)
    # What bf16 computes: every projection on bf16-rounded weights and inputs, the rest in fp32.
    config, weights = llama.from_transformers(tiny_model)
    rounded = llama.LlamaWeights(
        embed=weights.embed.bfloat16().float() if not onednn else weights.embed,
        layers=[layer.packed(lambda w: w.bfloat16().float()) for layer in weights.layers],
        final_norm=weights.final_norm, head=weights.head.bfloat16().float(),
    )
    reference = llama.LlamaRunner(config, rounded)
    prefill, steps = prefill_then_step((fp32, bf16, reference), list(range(50, 80)))
    assert steps[1].dtype == torch.float32
    for got, want in ((prefill[1], prefill[2]), (steps[1], steps[2])):  # only the inputs' rounding differs
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert not torch.equal(steps[1], steps[0])
    torch.testing.assert_close(steps[1], steps[0], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_cache_dtype_is_a_setting_kept_by_growth_and_forks(tiny_model, kv_dtype):
    fp32 = lean(tiny_model)
    assert fp32.new_cache().kv.dtype == torch.float32  # the model's own by default
    runner = lean(tiny_model, "int4", kv_dtype=kv_dtype, prefill_dtype=torch.float32)
    cache = runner.new_cache()
    runner.forward(list(range(300)), cache)  # grows past one chunk
    forked = runner.fork(cache, 30)
    assert cache.kv.dtype == forked.kv.dtype == kv_dtype
    assert runner.cache_bytes(forked) == forked.kv.numel() * forked.kv.element_size()
    # A bf16 cache rounds keys and values, nothing else.
    tolerance = 3e-2 if kv_dtype == torch.bfloat16 else 1e-5
    got, expected = runner.score(list(range(300)), "prefill"), exact(runner).score(list(range(300)), "prefill")
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_score_gives_every_position_as_forward_does(tiny_model):
    runner = lean(tiny_model, "int8", prefill_dtype=torch.float32, prefill_from=8)
    tokens = list(range(40, 60))
    for mode, decode in (("prefill", False), ("decode", True)):
        scores = runner.score(tokens, mode)
        assert scores.shape == (20, tiny_model.config.vocab_size) and scores.dtype == torch.float32
        cache = runner.new_cache()
        runner.forward(tokens[:5], cache)
        step = runner.forward([tokens[5]], cache, decode=decode)
        torch.testing.assert_close(scores[5], step, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(runner.score(tokens, "exact"), exact(runner).score(tokens, "prefill"), atol=0, rtol=0)


def test_build_picks_runner(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setenv("TORNCHAT_CACHE", str(tmp_path))
    ids = list(range(100, 140))

    def runner_for(config):
        return make_runner(checkpoint.Loaded(tokenizer=None, source="tiny", model=tiny_model), config, ids, "tiny")[0]

    assert isinstance(runner_for(Config()), llama.LlamaRunner)
    assert isinstance(runner_for(Config(model_impl="hf")), HFRunner)
    assert runner_for(Config(quantize="none")).layers[0].w13.dtype == torch.float32
    assert isinstance(runner_for(Config(quantize="int8")).head, quant.Int8Weight)
    assert (tmp_path / "decode-formats.json").exists()  # the measured choices, for the next start
    with pytest.raises(Exception, match="quantize int4 needs the lean forward"):
        runner_for(Config(model_impl="hf", quantize="int4"))


# ---- the real SmolLM2 -------------------------------------------------------


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def engine_for(runner, smol) -> Engine:
    stops = prompt.stop_token_ids(smol.tokenizer, smol.model.generation_config)
    return Engine(runner, smol.tokenizer, stops, SlotPool(runner, 2, 1 << 30))


def run(engine: Engine, ids: list[int], max_tokens: int) -> list[int]:
    request = GenerationRequest(prompt_ids=ids, sampling=GREEDY, max_tokens=max_tokens)
    return [t for event in engine.generate(request) for t in event.token_ids]


@pytest.fixture(scope="module")
def smol_lean(smol):
    return lean(smol.model)


def test_real_model_logits_and_greedy_match_hf(smol, smol_lean):
    hf = HFRunner(smol.model)
    for text in PROMPTS[:3]:
        ids = chat_ids(smol.tokenizer, text)
        hf_cache, lean_cache = hf.new_cache(), smol_lean.new_cache()
        expected, got = hf.forward(ids, hf_cache), smol_lean.forward(ids, lean_cache)
        for _ in range(12):
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
            token = int(expected.argmax())
            assert int(got.argmax()) == token
            expected, got = hf.forward([token], hf_cache), smol_lean.forward([token], lean_cache)


def test_real_model_engine_reuses_kv_like_hf(smol, smol_lean):
    """A long first turn (two prefill chunks), then a second turn that truncates the slot and continues."""
    story = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(90))
    first = chat_ids(smol.tokenizer, f"{story}\nWhich color is item 7?")
    assert len(first) > 512
    # Shares 400 tokens with the slot, so the slot is cut back to them and refilled.
    second = first[:400] + smol.tokenizer(" Which color is item 8?")["input_ids"] + first[-5:]
    results = []
    for runner in (HFRunner(smol.model), smol_lean):
        engine = engine_for(runner, smol)
        try:
            answers = [run(engine, first, 12), run(engine, second, 12)]
            third = second + answers[1] + first[-5:]  # the next turn appends to the slot
            answers.append(run(engine, third, 12))
            results.append((answers, engine.stats.counters["reused_tokens"]))
        finally:
            engine.close()
    assert results[0] == results[1]
    assert results[1][1] >= 400 + len(second)


def test_int4_greedy_and_perplexity_track_fp32(smol, smol_lean):
    """This model's Q4_1 layers re-pack exactly, the Q8_0 head goes to per-row int8."""
    q_proj = smol.model.model.layers[5].self_attn.q_proj.weight
    torch.testing.assert_close(quant.fake_quantize_int4(q_proj), q_proj, atol=1e-5 * float(q_proj.abs().max()), rtol=0)
    int4 = lean(smol.model, "int4")
    agree = total = 0
    for text in PROMPTS[1:]:
        ids = chat_ids(smol.tokenizer, text)
        fp_cache, q_cache = smol_lean.new_cache(), int4.new_cache()
        expected, got = smol_lean.forward(ids, fp_cache), int4.forward(ids, q_cache)
        for _ in range(20):  # both fed fp32's greedy choice: a per-position comparison
            token = int(expected.argmax())
            agree += int(got.argmax()) == token
            total += 1
            expected, got = smol_lean.forward([token], fp_cache), int4.forward([token], q_cache, decode=True)
    # Measured 128/128 over 4 x 32 positions (bench/decode_speed.py).
    assert agree / total >= 0.95

    # Perplexity through the decode path, the weights a decode step reads.
    ids = smol.tokenizer(open(__file__).read()[:2000])["input_ids"][:160]
    assert abs(decode_nll(int4, ids) / decode_nll(smol_lean, ids) - 1) < 0.01  # measured -0.35% in perplexity on 256 tokens


@pytest.mark.parametrize("mode,inputs", [("int4", torch.bfloat16), ("int4", torch.float32), ("int8", torch.bfloat16),
                                         ("none", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("native", ["own", "sdpa", None])
def test_verify_rows_are_bit_for_bit_decode_steps(tiny_model, mode, inputs, native):
    """A speculative verify over n rows gives each row exactly the one-token step's logits (greedy stays
    identical with speculation on), whatever the weight format, with the C++ step (either attention) or
    without it."""
    runner = lean(tiny_model, mode, inputs, prefill_dtype=torch.float32, prefill_from=8, attention=native or "sdpa")
    if not native:
        runner.decode_step = None
    elif runner.decode_step is None:  # oneDNN's packed bf16 layout has no C++ step: verify runs the steps
        assert mode == "bf16" and isinstance(runner.head, quant.Bf16Weight)
    prompt_ids = list(range(100, 140))
    drafts = [7, 300, 12, 12, 55, 901, 3, 44, 8]
    stepped, verified = runner.new_cache(), runner.new_cache()
    runner.forward(prompt_ids, stepped)
    runner.forward(prompt_ids, verified)
    steps = torch.stack([runner.forward([token], stepped, decode=True) for token in drafts])
    rows = runner.verify(drafts[:4], verified)  # in two verifies, the second after a rollback
    runner.truncate(verified, len(prompt_ids) + 2)
    rows = torch.cat([rows[:2], runner.verify(drafts[2:], verified)])
    assert verified.length == stepped.length == len(prompt_ids) + len(drafts)
    assert torch.equal(rows, steps)
    assert torch.equal(verified.kv[:, :, : verified.length], stepped.kv[:, :, : stepped.length])
