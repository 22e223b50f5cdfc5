"""The lean Llama forward against transformers' modules, in every block format, and one answer per row.

Tiny random models check the cache mechanics and batch invariance fast; the
real SmolLM2 checks that greedy output is the same token for token as
transformers', through the engine's KV reuse path included.
"""

import pytest
import torch

from tornchat import checkpoint, prompt
from tornchat.config import Config
from tornchat.engine import blocks, llama, quant
from tornchat.build import make_runner
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


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_gemma3"])
def test_tiny_logits_match_hf_prefill_chunks_and_decode(model_name, request):
    model = request.getfixturevalue(model_name)
    assert llama.unsupported_reason(model.config) is None
    hf, lean_runner = HFRunner(model), lean(model, kv_dtype=torch.float32)  # F32 blocks: transformers' numbers
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
    per_position = 2 * 2 * 2 * 16 * 2  # layers * (k, v) * kv_heads * head_dim * bf16 bytes
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
    assert runner.cache_bytes(cache) == 512 * 2 * 2 * 2 * 16 * 2  # capped at the context, not a whole chunk more
    with pytest.raises(ValueError):
        runner.forward([4], cache)


def test_rope_rows_are_computed_in_blocks_as_forwards_reach_them(monkeypatch):
    """Only the blocks up to the furthest position asked for are held; a row is the same whichever range asks
    for it, one block or across blocks; and close to cos and sin of its angles."""
    monkeypatch.setattr(llama, "ROPE_BLOCK", 64)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32)
    table = llama.RopeTable(inv_freq, 0.5, 1000, torch.device("cpu"))
    first = table.rows(10, 20).clone()
    assert table.nbytes() == 64 * 16 * 2 * 4  # one block
    across = table.rows(0, 150)  # three blocks, in one tensor
    assert table.nbytes() == 3 * 64 * 16 * 2 * 4 and across.shape == (150, 16, 2) and across.is_contiguous()
    assert torch.equal(across[10:20], first) and torch.equal(table.rows(60, 70), across[60:70])
    assert table.whole().shape == (1000, 16, 2) and torch.equal(table.whole()[:150], across)
    angles = torch.outer(torch.arange(1000, dtype=torch.float64), inv_freq.double())
    torch.testing.assert_close(table.whole().double(), 0.5 * torch.stack([angles.cos(), angles.sin()], -1),
                               atol=5e-5, rtol=0)  # fp32 angles: 900 rad is a unit in the last place of 6e-5


FORMATS = ("none", "bf16", "int8", "int4")


@pytest.mark.parametrize("quantize", FORMATS)
def test_packed_formats_are_blocks_that_decode_to_their_weights(tiny_model, quantize):
    """--quantize packs every layer matrix into one GGML type; the blocks decode to the weights within the type's
    rounding, and a tied embedding reads its rows from the packed head (one copy)."""
    runner = lean(tiny_model, quantize)
    assert all(m.types == (blocks.grouped_type(quant.BLOCK_TYPES[quantize], rows=m.shape[0], panels=True),)
               for layer in runner.layers for m in layer.matrices())
    assert runner.head.types == (blocks.grouped_type(quant.HEAD_TYPES[quantize]),)  # int4's head at 8 bits
    assert runner.weights.embed is runner.head and runner.step is not None
    weight = tiny_model.model.layers[1].mlp.down_proj.weight.detach()
    step = {"none": 0, "bf16": 2**-8, "int8": 1 / 127, "int4": 1 / 15}[quantize]  # relative to the block's range
    error = (runner.layers[1].w2.dequantize(torch.float32) - weight).abs().max()
    assert float(error) <= step * float(weight.abs().max()) * 1.01
    rows = torch.tensor([3, 40_000])
    assert torch.equal(quant.dequantize(runner.weights.embed, torch.float32, rows),
                       runner.head.dequantize(torch.float32)[rows])


def test_rows_of_a_matrix_in_parts_of_two_types_decode_as_the_whole():
    """An embedding stored in parts (one a part, or several of different types): the rows asked for are those
    rows of the whole decoded matrix, in the order asked, from either part or both."""
    torch.manual_seed(0)
    first, second = quant.to_blocks(torch.randn(5, 64), "int8"), quant.to_blocks(torch.randn(7, 64), "int4")
    whole = quant.BlockWeight(first.parts + second.parts, first.types + second.types)
    assert whole.types == (blocks.grouped_type("Q8_0"), blocks.grouped_type("Q4_1"))
    for matrix in (whole, first):
        rows = torch.tensor([4, 0, 4]) if matrix is first else torch.tensor([11, 2, 5, 0, 6])
        assert torch.equal(matrix.dequantize(torch.float32, rows), matrix.dequantize(torch.float32)[rows])


def greedy_paths(runner, prompt_ids: list[int], drafts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The logits of every position of prompt_ids + drafts, and the cache after them, computed along four paths:
    the prompt in one prefill then one-token steps; in uneven chunks then verifies (one after a rollback);
    every token a step of its own; all of it in one chunk."""
    everything = prompt_ids + drafts
    paths = []
    cache = runner.new_cache()
    logits = [runner.score(prompt_ids)]  # every position of a one-chunk prefill, as forward computes its last
    runner.forward(prompt_ids, cache)
    logits += [runner.forward([t], cache, decode=True)[None] for t in drafts]
    paths.append((torch.cat(logits), runner.positions(cache)))

    cache, logits, at = runner.new_cache(), [], 0
    for size in (1, 7, 13, 2, 64):
        if at < len(prompt_ids):
            logits += [runner.verify(prompt_ids[at : at + size], cache)]
            at = min(at + size, len(prompt_ids))
    logits += [runner.verify(drafts[:4], cache)]
    runner.truncate(cache, len(prompt_ids) + 2)
    logits = logits[:-1] + [logits[-1][:2], runner.verify(drafts[2:], cache)]
    paths.append((torch.cat(logits), runner.positions(cache)))

    cache = runner.new_cache()
    paths.append((torch.stack([runner.forward([t], cache) for t in everything]), runner.positions(cache)))
    paths.append((runner.score(everything), None))
    return paths


@pytest.mark.parametrize("isa", blocks.isas())
@pytest.mark.parametrize("model_name, quantize", [(name, q) for name in ("tiny_model", "tiny_qwen3_moe") for q in FORMATS]
                         + [("tiny_gemma3", "int4")])
def test_a_row_gets_the_same_bits_whatever_path_it_takes(model_name, quantize, isa, request):
    """One answer per request: a position's logits and keys are the same bits whether it was prefilled in one
    chunk or several, stepped, verified with drafts (after a rollback too) or scored, in every block format and
    on every instruction-set path this CPU has (AVX2 on every x86 machine). With experts too: a row's experts
    run on whichever rows of the chunk chose them; and Gemma 3's windowed attention."""
    runner = lean(request.getfixturevalue(model_name), quantize, isa=isa)
    assert runner.isa == isa and runner.step is not None
    paths = greedy_paths(runner, list(range(100, 140)), [7, 300, 12, 12, 55, 901, 3, 44, 8])
    first_logits, first_kv = paths[0]
    assert first_logits.shape == (49, runner.head.shape[0])
    for logits, kv in paths[1:]:
        assert torch.equal(logits, first_logits)
        assert kv is None or torch.equal(kv, first_kv)


def test_windowed_layers_hold_only_what_their_window_sees(tiny_gemma3):
    """Gemma 3's windowed layers keep their own caches, which drop the key blocks no later row sees as the text
    grows, but for what a row at the held position (a prompt's last) sees: the logits are still the bits of the
    whole text scored at once (whose one forward holds everything), and the cache cut back or forked at the held
    position goes on as that score says."""
    runner = lean(tiny_gemma3, "int4")
    text = [(37 * i) % 997 + 2 for i in range(590)]
    expected = runner.score(text)
    cache = runner.new_cache()
    got = []
    for prompt_end, reply_end in [(60, 300), (360, 590)]:  # two turns, each a prompt and a reply
        runner.hold(cache, prompt_end - 1)  # a request sent again goes on from there
        got.append(runner.forward(text[cache.length : prompt_end], cache)[None])
        got += [runner.forward([t], cache, decode=True)[None] for t in text[prompt_end:reply_end]]
        assert cache.window_start <= prompt_end - runner.window  # what the held position sees stays
    assert torch.equal(torch.cat(got), expected[[59, *range(60, 300), 359, *range(360, 590)]])
    assert cache.window_start >= 256 and cache.windowed.shape[2] < len(text) - 256  # the first turn's are gone
    assert cache.kv.shape[2] >= len(text)  # the global layer keeps every position
    whole = runner.new_cache()
    runner.forward(text, whole)
    assert torch.equal(runner.positions(cache), runner.positions(whole))  # all the next row sees
    forked = runner.fork(cache, 360)
    assert torch.equal(runner.forward(text[360:370], forked), expected[369])
    runner.truncate(cache, 360)
    assert torch.equal(runner.verify(text[360:370], cache), expected[360:370])


def test_a_windowed_cache_is_not_cut_back_past_what_it_holds(tiny_gemma3):
    runner = lean(tiny_gemma3, "int4")
    text = [(41 * i) % 991 + 3 for i in range(500)]
    cache = runner.new_cache()
    runner.hold(cache, 499)
    runner.reserve(cache, 501)  # the decode loop's room for a whole prompt, before its chunks
    for start in range(0, 500, 50):
        runner.forward(text[start : start + 50], cache)
        assert cache.windowed.shape[2] <= llama.CACHE_CHUNK  # a chunk and the window before it: not the prompt
    first = runner.resumable_from(cache)
    assert first == cache.window_start + runner.window - 1 and 0 < first < 499
    with pytest.raises(ValueError, match="cut back"):
        runner.truncate(cache, first - 1)
    with pytest.raises(ValueError, match="cut back"):
        runner.fork(cache, first - 1)
    expected = runner.score(text[:first] + [5])[-1]
    assert torch.equal(runner.forward([5], runner.fork(cache, first)), expected)
    cache.window_start = 496  # past what the next row sees (from 493): the C++ forward refuses to read other positions
    with pytest.raises(RuntimeError, match="does not hold"):
        runner.forward([5], cache)


def test_slots_go_on_from_a_windowed_cache_only_where_it_holds_what_the_next_row_sees(tiny_gemma3):
    """A conversation whose reply runs far past the window: the same prompt again, and the next turn, reuse
    its slot; a prompt that leaves it before what the windowed layers still hold gets a cache of its own, with
    the logits of the text scored at once."""
    runner = lean(tiny_gemma3, "int4")
    pool = SlotPool(runner, 4, 1 << 30)
    history = [(43 * i) % 983 + 4 for i in range(300)]
    slot, reused, _ = pool.acquire(history[:40])
    runner.forward(history[:40], slot.cache)
    for token in history[40:]:  # the reply
        runner.forward([token], slot.cache)
    slot.tokens = list(history)
    pool.release(slot)
    assert 20 < runner.resumable_from(slot.cache) <= 39
    again, reused, _ = pool.acquire(history[:40])  # the same request again goes on from its prompt
    assert reused == 39
    assert torch.equal(runner.forward(history[39:40], again.cache), runner.score(history[:40])[-1])
    pool.release(again)
    edited = history[:20] + [999] + history[21:40]  # shares 20 tokens, which no slot can go on from
    fresh, reused, _ = pool.acquire(edited)
    assert reused == 0 and fresh not in (slot, again)
    assert torch.equal(runner.forward(edited, fresh.cache), runner.score(edited)[-1])
    pool.release(fresh)
    _, reused, _ = pool.acquire(history + [5, 6, 7])  # the next turn
    assert reused == len(history)


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_qwen3_moe", "tiny_gemma3"])
def test_every_path_gives_the_same_logits(model_name, request):
    """One answer on every CPU: the block kernels sum integers, and attention's and the gate's loops make the same
    fused multiply-adds in the same order on every path (vec.h), so an AVX2-only machine, or one on the baseline
    ("generic", as an ARM one), scores a text as an AVX-512 one does."""
    paths = blocks.isas()
    ids = list(range(100, 170))
    scores = {isa: lean(request.getfixturevalue(model_name), "int4", isa=isa).score(ids) for isa in paths}
    for isa, logits in scores.items():
        assert torch.equal(logits, scores[paths[0]]), isa


def test_the_kernels_track_the_weights_in_fp32(tiny_model):
    """The block kernels round activations to int8 per block of 32; against PyTorch on the same weights in
    fp32 the logits move by that rounding only."""
    runner = lean(tiny_model, "int8", kv_dtype=torch.float32)
    tokens = list(range(100, 160))
    got, expected = runner.score(tokens), exact(runner, kv_dtype=torch.float32).score(tokens)
    assert float((got - expected).abs().max()) <= 0.02 * float(expected.abs().max())
    torch.testing.assert_close(runner.score(tokens, "exact"), expected, atol=1e-5, rtol=1e-5)


def test_build_picks_runner(tiny_model):
    def runner_for(config):
        return make_runner(checkpoint.Loaded(tokenizer=None, source="tiny", model=tiny_model), config)

    assert isinstance(runner_for(Config()), llama.LlamaRunner)
    assert isinstance(runner_for(Config(model_impl="hf")), HFRunner)
    assert runner_for(Config()).layers[0].w13.types == ("F32",)  # auto: float weights stay as they are
    assert runner_for(Config(quantize="int8")).head.types == (blocks.grouped_type("Q8_0"),)
    with pytest.raises(Exception, match="quantize int4 needs the lean forward"):
        runner_for(Config(model_impl="hf", quantize="int4"))


def test_a_cpu_install_without_the_kernels_says_so_at_start(tiny_model, monkeypatch):
    # pip installs tornchat where the C++ build fails; the lean forward on a CPU cannot run without it
    monkeypatch.setattr(blocks, "_import", lambda: (None, "No module named 'tornchat.engine._fused'"))
    def runner_for(config):
        return make_runner(checkpoint.Loaded(tokenizer=None, source="tiny", model=tiny_model), config)

    with pytest.raises(checkpoint.CheckpointError, match=r"needs tornchat's C\+\+ kernels.*No module named.*--model-impl hf"):
        runner_for(Config())
    assert isinstance(runner_for(Config(model_impl="hf")), HFRunner)  # what the message offers


# ---- the real SmolLM2 -------------------------------------------------------


def chat_ids(tokenizer, text: str) -> list[int]:
    return prompt.encode(tokenizer, prompt.render(tokenizer, [{"role": "user", "content": text}]))


def engine_for(runner, smol) -> Engine:
    stops = prompt.stop_token_ids(smol.tokenizer, smol.model.generation_config)
    return Engine(runner, smol.tokenizer, stops, SlotPool(runner, 2, 1 << 30))


def run(engine: Engine, ids: list[int], max_tokens: int) -> list[int]:
    request = GenerationRequest(prompt_ids=ids, sampling=GREEDY, max_tokens=max_tokens)
    return [t for event in engine.generate(request) for t in event.token_ids]


@pytest.fixture(scope="module")
def smol_lean(smol):
    return lean(smol.model, kv_dtype=torch.float32)  # F32 blocks: transformers' numbers


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


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_greedy_and_perplexity_track_fp32(smol, smol_lean, quantize):
    """--quantize int8 (Q8_0) and int4 (Q4_1) of a float checkpoint: greedy choices and perplexity near fp32's."""
    packed = lean(smol.model, quantize)
    agree = total = 0
    for text in PROMPTS[1:]:
        ids = chat_ids(smol.tokenizer, text)
        fp_cache, q_cache = smol_lean.new_cache(), packed.new_cache()
        expected, got = smol_lean.forward(ids, fp_cache), packed.forward(ids, q_cache)
        for _ in range(16):  # both fed fp32's greedy choice: a per-position comparison
            token = int(expected.argmax())
            agree += int(got.argmax()) == token
            total += 1
            expected, got = smol_lean.forward([token], fp_cache), packed.forward([token], q_cache, decode=True)
    assert agree / total >= 0.9
    ids = smol.tokenizer(open(__file__).read()[:2000])["input_ids"][:160]
    rise = decode_nll(packed, ids) / decode_nll(smol_lean, ids) - 1
    assert rise < {"int8": 0.01, "int4": 0.05}[quantize]


@pytest.mark.parametrize("isa", blocks.isas())
@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_qwen3_moe", "tiny_gemma3"])
def test_sequences_batched_together_get_what_each_gets_alone(model_name, isa, request):
    """Several generations' rows in one forward (a prefill chunk, a step, a verify side by side, at different
    positions of their own caches): each sequence's logits and cache are the bits it gets alone."""
    runner = lean(request.getfixturevalue(model_name), "int4", isa=isa)
    prompts = [list(range(100, 140)), list(range(300, 307)), list(range(500, 519))]
    alone, caches = [], []
    for prompt_ids in prompts:
        cache = runner.new_cache()
        runner.forward(prompt_ids, cache)
        caches.append(cache)
        forked = runner.fork(cache, cache.length)
        alone.append([runner.forward([7], forked, decode=True)[None], runner.verify([8, 9, 10], forked),
                      runner.forward(list(range(600, 620)), forked)[None], runner.positions(forked)])
    steps = [([7], False), ([7], False), ([7], False)]
    first = runner.forward_many([(ids, cache, every) for (ids, every), cache in zip(steps, caches)])
    second = runner.forward_many([([8, 9, 10], caches[0], True), ([8, 9, 10], caches[1], True), ([8, 9, 10], caches[2], True)])
    third = runner.forward_many([(list(range(600, 620)), cache, False) for cache in caches])
    for i, cache in enumerate(caches):
        assert torch.equal(first[i], alone[i][0]) and torch.equal(second[i], alone[i][1])
        assert torch.equal(third[i], alone[i][2]) and torch.equal(runner.positions(cache), alone[i][3])
    # Mixed in one call: a verify, a prefill chunk and a step, each against the same call made alone.
    calls = [([8, 9, 10], True), (list(range(600, 620)), False), ([8], False)]
    expected = []
    for (ids, every), prompt_ids in zip(calls, prompts):
        cache = runner.new_cache()
        runner.forward(prompt_ids, cache)
        expected.append(runner.verify(ids, cache) if every else runner.forward(ids, cache)[None])
    mixed = [runner.new_cache() for _ in prompts]
    runner.forward_many([(prompt_ids, cache, False) for prompt_ids, cache in zip(prompts, mixed)])
    got = runner.forward_many([(ids, cache, every) for (ids, every), cache in zip(calls, mixed)])
    assert [g.shape[0] for g in got] == [3, 1, 1]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.parametrize("change, reason", [
    ({"final_logit_softcapping": 30.0}, "logit soft-capping"),
    ({"hidden_activation": "gelu"}, "activation 'gelu'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "RoPE type 'dynamic'"),
])
def test_gemma3_variants_it_does_not_run_are_named(tiny_gemma3, change, reason):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**{**tiny_gemma3.config.to_dict(), **change})
    assert reason in llama.unsupported_reason(config)


def test_a_step_reads_only_the_experts_its_router_chose(tiny_qwen3_moe, monkeypatch):
    """A decode step multiplies by the top_k experts chosen in each layer and by no other: with every other
    expert's weights NaN, the step's logits are the same bits."""
    runner = lean(tiny_qwen3_moe, "int8")
    cache = runner.new_cache()
    runner.forward(list(range(100, 120)), cache)
    chosen = []  # the step's experts per layer, as the Python forward routes the same row (its last)
    route = llama.route
    monkeypatch.setattr(llama, "route", lambda h, experts: chosen.append(route(h, experts)[1][-1].tolist()) or route(h, experts))
    python = llama.LlamaRunner(runner.config, runner.weights)
    python.step = None
    python.forward(list(range(100, 120)) + [7], python.new_cache())
    assert len(chosen) == len(runner.layers) and all(len(c) == 3 for c in chosen)

    def poisoned(w, keep):
        return w if keep else quant.to_blocks(torch.full(w.shape, float("nan")), "none")
    layers = [layer._replace(moe=layer.moe._replace(
        w13=tuple(poisoned(w, e in used) for e, w in enumerate(layer.moe.w13)),
        w2=tuple(poisoned(w, e in used) for e, w in enumerate(layer.moe.w2)))) for layer, used in zip(runner.layers, chosen)]
    unread = llama.LlamaRunner(runner.config, llama.LlamaWeights(runner.weights.embed, layers, runner.final_norm, runner.head))
    expected = runner.forward([7], runner.fork(cache, cache.length), decode=True)
    assert torch.equal(unread.forward([7], runner.fork(cache, cache.length), decode=True), expected)
    # Another token reads other experts: the NaNs reach it (the int8 head turns them to zeros).
    other = unread.forward([8], runner.fork(cache, cache.length), decode=True)
    assert not torch.equal(other, runner.forward([8], runner.fork(cache, cache.length), decode=True))

    def size(w):
        return sum(p.numel() for p in w.parts)
    layer = runner.layers[0]  # what a step reads, for the benchmarks' bandwidth figures: 3 experts of 8
    assert layer.step_bytes(size) == size(layer.wqkv) + size(layer.wo) + 3 * (size(layer.moe.w13[0]) + size(layer.moe.w2[0]))


def test_a_config_the_lean_forward_does_not_run_is_named_in_one_line():
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    assert llama.unsupported_reason(Qwen3MoeConfig()) is None
    assert llama.unsupported_reason(Qwen3MoeConfig(shared_expert_intermediate_size=64)) == "shared experts"
    assert "'qwen2_moe' is not one of" in llama.unsupported_reason(Qwen2MoeConfig())


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_qwen3"])
def test_a_captured_steps_rows_each_compute_their_own_sequence(model_name, request):
    """``cuda_graph.step``, the CUDA step, on the CPU (it is plain PyTorch): rows of two caches and a verify's
    rows on one of them, then padding, give each row the logits and cache entries of its sequence's own
    one-token forwards, and the padding touches no cache."""
    from tornchat.engine import cuda_graph

    runner = exact(lean(request.getfixturevalue(model_name)), kv_dtype=torch.float32)  # plain weights, as on CUDA
    assert runner.step is None
    first, second = list(range(10, 40)), list(range(200, 217))
    caches = [runner.new_cache(), runner.new_cache()]
    alone = [runner.new_cache(), runner.new_cache()]
    for prompt_ids, cache, reference in zip((first, second), caches, alone):
        runner.forward(prompt_ids, cache)
        runner.forward(prompt_ids, reference)
        runner.reserve(cache, cache.length + 8)
        with torch.inference_mode():  # zeros past the length, as a runner with captured steps leaves it (reserve)
            cache.kv[:, :, cache.length :] = 0
    rows = [(5, 0), (6, 0), (7, 0), (9, 1)]  # a verify of 3 rows on the first cache, a step on the second
    positions = [caches[0].length, caches[0].length + 1, caches[0].length + 2, caches[1].length]
    untouched = caches[1].kv[:, :, positions[-1] + 1 :].clone()
    tokens = torch.tensor([token for token, _ in rows] + [0] * (cuda_graph.STEP_ROWS - len(rows)))
    with torch.inference_mode():
        got = cuda_graph.step(runner, tokens, torch.tensor(positions + [0] * (len(tokens) - len(rows))),
                              tuple(caches[c].kv for _, c in rows))
    assert got.shape == (cuda_graph.STEP_ROWS, runner.head.shape[0])
    for r, (token, c) in enumerate(rows):
        expected = runner.forward([token], alone[c], decode=True)
        torch.testing.assert_close(got[r], expected, atol=1e-4, rtol=1e-4)
    for c, cache in enumerate(caches):
        held = alone[c].length
        torch.testing.assert_close(cache.kv[:, :, :held], alone[c].kv[:, :, :held], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1].kv[:, :, positions[-1] + 1 :], untouched)
