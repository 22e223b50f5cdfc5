"""The CUDA path: graph-replayed decode steps, tinygemm int4, the server on a GPU. Runs where a GPU is."""
import gc
import os
import weakref

import openai
import pytest
import torch

import gguf_files
from bench import servers
from tornchat import prompt
from tornchat.engine import GenerationRequest, SamplingParams, cuda_graph, llama, quant
from tornchat.engine.slots import SlotPool
from tornchat.engine.worker import Engine
from tornchat.weights import gguf_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def gpu_tokenizer(request):
    """The embedded model's tokenizer, or any HF tokenizer directory named by TORNCHAT_TEST_TOKENIZER (a GPU
    machine without the embedded model's package)."""
    directory = os.environ.get("TORNCHAT_TEST_TOKENIZER")
    if directory:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    return request.getfixturevalue("tokenizer")


@pytest.fixture(scope="module")
def gpu_checkpoint(gpu_tokenizer, tmp_path_factory) -> str:
    """A random 2-layer Llama as a HF directory, for the server (widths that tinygemm's group 128 divides)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(gpu_tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("gpu-checkpoint")
    LlamaForCausalLM(config).save_pretrained(path)
    gpu_tokenizer.save_pretrained(path)
    return str(path)


def random_llama(vocab: int, dtype: torch.dtype):
    """A 4-layer random Llama on the GPU: its LlamaConfig and weights (``llama.from_transformers``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    return llama.from_transformers(LlamaForCausalLM(config).eval().cuda().to(dtype))


@pytest.fixture(scope="module")
def gpu_model(gpu_tokenizer):
    """Over SmolLM2's vocabulary, in fp32 (ties are rarer than in bf16)."""
    return random_llama(len(gpu_tokenizer), torch.float32)


def runner(model, graphs=True, quantize="none"):
    spec, weights = model
    return llama.LlamaRunner(spec, llama.pack(weights, quantize, keep=True), graphs=graphs)


def greedy_ids(run, prompt_ids, steps):
    cache = run.new_cache()
    logits = run.forward(prompt_ids, cache)
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = run.forward([out[-1]], cache, decode=True)
    return out, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_is_bit_for_bit_the_eager_step_cache_included(dtype):
    """Across a cache that grows (a new tensor: the old graph dropped, a new one captured)."""
    graphed = llama.LlamaRunner(*random_llama(1000, dtype))
    eager_cache, graph_cache = graphed.new_cache(), graphed.new_cache()
    prompt_ids = list(range(100, 340))
    graphed.forward(prompt_ids, eager_cache)
    graphed.forward(prompt_ids, graph_cache)
    for position, token in enumerate(range(500, 530), start=len(prompt_ids)):
        graphed.reserve(eager_cache, position + 1)
        with torch.inference_mode():
            eager = cuda_graph.step(graphed, torch.tensor([token], device="cuda"), torch.tensor([position], device="cuda"),
                                    (eager_cache.kv,))[0]
        eager_cache.length += 1
        replayed = graphed.forward([token], graph_cache, decode=True)
        assert torch.equal(replayed, eager)
    assert torch.equal(graph_cache.kv[:, :, : graph_cache.length], eager_cache.kv[:, :, : eager_cache.length])
    assert graphed.graphs.captures == 2 and graph_cache.kv.shape[2] == 512


def test_a_collection_due_during_a_capture_waits_for_its_end(gpu_model):
    """A runner and its graphs refer to each other, so a discarded runner's graphs are destroyed by whichever
    collection finds them; one that ran during another runner's capture invalidated that capture. Here the
    collector is made due at every allocation from inside a capture, with such a runner waiting in the
    youngest generation: the capture holds it off, so the graph is captured and replays the eager step bit
    for bit, and the discarded runner goes at the next collection."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.disable()  # until the capture: the discarded runner stays in the generation a due collection looks at
    in_capture = []  # for each collection, whether it ran inside a capture
    gc.callbacks.append(lambda phase, _: in_capture.append(torch.cuda.is_current_stream_capturing())
                        if phase == "start" else None)

    def collecting_step(*args):
        if torch.cuda.is_current_stream_capturing():
            gc.set_threshold(1)
            _ = [[] for _ in range(100)]  # allocations past the threshold: a collection here if one may run
        return cuda_graph.step(*args)

    try:
        discarded = runner(gpu_model)
        greedy_ids(discarded, list(range(100, 120)), 2)
        assert discarded.graphs.captures
        gone = weakref.ref(discarded.graphs)
        del discarded
        fresh = runner(gpu_model, graphs=False)
        graphs = cuda_graph.GraphedSteps(fresh, step_fn=collecting_step)
        replayed_cache, eager_cache = fresh.new_cache(), fresh.new_cache()
        for cache in (replayed_cache, eager_cache):
            fresh.forward(list(range(100, 120)), cache)
            fresh.reserve(cache, cache.length + 1)
        gc.set_threshold(10**9)
        gc.enable()
        replayed = graphs([(7, replayed_cache.kv, replayed_cache.length)])
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.pop()
    assert graphs.captures == 1 and not any(in_capture)
    with torch.inference_mode():
        eager = cuda_graph.step(fresh, torch.tensor([7], device="cuda"), torch.tensor([eager_cache.length], device="cuda"),
                                (eager_cache.kv,))
    assert torch.equal(replayed, eager)
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_generations_decoding_together_share_replays_and_a_verify_is_its_steps(gpu_model, quantize):
    """Rows of several generations in one step (a new mix runs eagerly, and is captured when seen again): with
    plain weights each row's logits and cache entries are those of its own one-token steps bit for bit (our
    product kernel computes a row by itself), with tinygemm's int4 up to its many-row products' rounding. A
    verify is its steps bit for bit: in one step with plain weights, one row a step with int4."""
    run = runner(gpu_model, True, quantize)
    assert run.graphs.rows_apart == (quantize == "none")
    tolerance = 0 if quantize == "none" else 5e-2  # of the logits' scale; int4 runs on bf16 inputs
    prompts = [list(range(100, 140)), list(range(300, 317)), list(range(700, 760))]
    together, alone = [run.new_cache() for _ in prompts], [run.new_cache() for _ in prompts]
    for prompt_ids, cache, reference in zip(prompts, together, alone):
        run.forward(prompt_ids, cache)
        run.forward(prompt_ids, reference)
    captures = []
    for rows in ([[5, 6, 7], [9], [11, 12]], [[13], [14, 15, 16, 17], [18]], [[19], [20], [21]], [[22], [23], [24]]):
        expected = [torch.stack([run.forward([token], cache, decode=True) for token in ids])
                    for ids, cache in zip(rows, alone)]
        captures.append(run.graphs.captures)
        got = run.forward_many([(ids, cache, True) for ids, cache in zip(rows, together)])
        captures[-1] = run.graphs.captures - captures[-1]
        for e, g in zip(expected, got):
            scale = float(e.abs().max())
            torch.testing.assert_close(g, e, atol=tolerance * scale, rtol=0)
    assert captures == [0, 0, 0, 1]  # only the mix seen a second time was captured
    for cache, reference in zip(together, alone):
        assert cache.length == reference.length
        scale = float(reference.kv[:, :, : reference.length].abs().max())
        torch.testing.assert_close(cache.kv[:, :, : cache.length], reference.kv[:, :, : reference.length],
                                   atol=tolerance * scale, rtol=0)
    verified, stepped = run.new_cache(), run.new_cache()
    run.forward(prompts[0], verified)
    run.forward(prompts[0], stepped)
    for drafts in (list(range(40, 48)), list(range(50, 53)), list(range(60, 68))):  # the third: replayed
        before = run.graphs.captures
        assert torch.equal(run.verify(drafts, verified),
                           torch.stack([run.forward([t], stepped, decode=True) for t in drafts]))
    assert run.graphs.captures - before == (1 if quantize == "none" else 0)  # (8 rows of one cache) seen twice
    assert torch.equal(verified.kv[:, :, : verified.length], stepped.kv[:, :, : stepped.length])


def test_speculation_on_the_gpu_drafts_and_changes_no_token(gpu_model, gpu_tokenizer):
    """Prompt-lookup drafts from a prediction that is the reply itself, verified in one captured step of plain
    weights: most drafts accepted, fewer forwards than tokens, and the same tokens (greedy and seeded) as with
    no speculation; across a cache that grows while drafting."""
    from test_parallel import CHEAP

    run = runner(gpu_model)
    stops = prompt.stop_token_ids(gpu_tokenizer, None)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    prompt_ids = list(range(1000, 1240))  # the cache grows past 256 positions while drafting
    replies = {}
    for speculation in (None, CHEAP):
        engine = Engine(run, gpu_tokenizer, stops, SlotPool(run, 4, 1 << 30), speculation=speculation)
        try:
            for name, sampling in (("greedy", GREEDY), ("seeded", seeded)):
                plain, _ = generated(engine, prompt_ids, sampling=sampling, max_tokens=48)
                if speculation is None:
                    replies[name] = plain
                    continue
                assert plain == replies[name]  # no prediction: drafts from the prompt and the reply, if any
                steps = engine.stats.counters["decode_steps"]
                drafted, last = generated(engine, prompt_ids, sampling=sampling, max_tokens=48,
                                          prediction_ids=replies[name])
                steps = engine.stats.counters["decode_steps"] - steps
                assert drafted == replies[name]
                assert last.usage.accepted_prediction_tokens >= 24 and steps <= len(drafted) - 24
        finally:
            engine.close()


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_graphs_decode_the_same_greedy_tokens_as_the_eager_loop_across_cache_growth(gpu_model, quantize):
    prompt_ids = list(range(1000, 1250))  # the cache grows past 256 positions while decoding: a new capture
    with_graphs, cache = greedy_ids(runner(gpu_model, True, quantize), prompt_ids, 40)
    eager, _ = greedy_ids(runner(gpu_model, False, quantize), prompt_ids, 40)
    assert with_graphs == eager
    assert cache.kv.shape[2] == 512


def test_int4_matmul_computes_the_int4_weights(gpu_model):
    weight = gpu_model[1].layers[0].w13.float()
    packed = quant.quantize_int4_cuda(weight, 32)
    x = torch.randn(3, weight.shape[1], device="cuda")
    expected = x.bfloat16().float() @ quant.fake_quantize_int4(weight, 32).T
    got = quant.linear(x, packed).float()
    assert got.shape == expected.shape and quant.shape(packed) == tuple(weight.shape)
    torch.testing.assert_close(got, expected, atol=0.05 * float(expected.abs().max()), rtol=0.02)


def engine_for(model, tokenizer, graphs=True):
    run = runner(model, graphs)
    stops = prompt.stop_token_ids(tokenizer, None)
    return Engine(run, tokenizer, stops, SlotPool(run, 4, 1 << 30), max_queue=4)


def generated(engine, ids, **kwargs):
    events = list(engine.generate(GenerationRequest(list(ids), **kwargs)))
    return [t for e in events for t in e.token_ids], events[-1]


def test_seeded_sampling_and_kv_reuse_are_the_same_with_graphs(gpu_model, gpu_tokenizer):
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    first_turn = list(range(2000, 2060))
    results = []
    for graphs in (True, False):
        engine = engine_for(gpu_model, gpu_tokenizer, graphs)
        try:
            reply, _ = generated(engine, first_turn, sampling=seeded, max_tokens=30)
            second_turn = first_turn + reply + list(range(3000, 3020))
            again, last = generated(engine, second_turn, sampling=GREEDY, max_tokens=30)
            results.append((reply, again, last.usage.cached_tokens))
        finally:
            engine.close()
    assert results[0] == results[1]
    assert results[0][2] >= len(first_turn)  # the second turn reused the first's cache


def test_concurrent_generations_on_the_gpu_get_the_replies_they_get_alone(gpu_model, gpu_tokenizer):
    """The scheduler's steps on CUDA: four requests (greedy, seeded, one drafting from a prediction, one with a
    stop string) decoded together in shared steps. With plain weights a row gets the bits it gets alone, so each
    reply is the one it gets alone."""
    from test_parallel import CHEAP, reply, together

    stops = prompt.stop_token_ids(gpu_tokenizer, None)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    prompts = [list(range(2000 + 100 * i, 2030 + 100 * i)) for i in range(4)]
    batch = [GenerationRequest(prompts[0], sampling=GREEDY, max_tokens=24),
             GenerationRequest(prompts[1], sampling=seeded, max_tokens=24),
             GenerationRequest(prompts[2], sampling=GREEDY, max_tokens=24, prediction_ids=list(range(5000, 5030))),
             GenerationRequest(prompts[3], sampling=seeded, max_tokens=24, stop=("e",))]
    run = runner(gpu_model)
    replies = {}
    for parallel in (1, 4):
        engine = Engine(run, gpu_tokenizer, stops, SlotPool(run, 4, 1 << 30), speculation=CHEAP, parallel=parallel)
        try:
            replies[parallel] = [reply(list(engine.generate(r))) for r in batch] if parallel == 1 else together(engine, batch)
            if parallel == 4:
                assert engine.batch.largest == 4
        finally:
            engine.close()
    for solo, shared, request in zip(replies[1], replies[4], batch):
        tokens, text, finish = shared
        assert finish in ("length", "stop") and 0 < len(tokens) <= request.max_tokens and text
        assert shared == solo


def test_the_server_streams_from_the_gpu_and_reuses_its_cache(gpu_checkpoint):
    with servers.running("--checkpoint-path", gpu_checkpoint, "--device", "cuda", "--quantize", "int4") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 20 and text
        turn = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "And the sky?"}]
        again = client.chat.completions.create(model="m", messages=turn, max_tokens=5, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert "tinygemm" in server.log() and "cuda" in server.log()


@pytest.mark.parametrize("arch, mix", [("llama", "q4_k_m"), ("llama", "q4_1+q5_1"), ("qwen3moe", "q4_k_m")])
def test_a_quantized_gguf_on_the_gpu_computes_what_it_does_on_the_cpu(tmp_path, arch, mix):
    """The GGUF loader's CUDA path: every tensor dequantized into the dtype on the device (each expert's too)."""
    from test_gguf import MIXES

    path = gguf_files.write(tmp_path / "m.gguf", MIXES[mix], arch=arch, tied=mix == "q4_k_m", ffn=256)
    ids = list(range(3, 60))
    config, on_cpu = gguf_file.load(path, plain=torch.float32)
    _, on_gpu = gguf_file.load(path, plain=torch.float32)
    cpu_logits = llama.LlamaRunner(config, on_cpu, kv_dtype=torch.float32).score(ids)
    gpu = llama.LlamaRunner(config, gguf_file.to_device(on_gpu, "cuda"))
    torch.testing.assert_close(gpu.score(ids).cpu(), cpu_logits, atol=2e-3, rtol=1e-3)
    cache = gpu.new_cache()
    gpu.forward(ids[:-1], cache)
    torch.testing.assert_close(gpu.forward(ids[-1:], cache, decode=True).cpu(), cpu_logits[-1], atol=2e-3, rtol=1e-3)


def test_a_step_that_chooses_its_token_gives_the_replies_the_host_chooses(gpu_model, gpu_tokenizer, monkeypatch):
    """A lone generation's token chosen inside the captured step (greedy, seeded, a stop string checked on the
    device) against the same requests with every token chosen on the host from the step's logits: the same
    tokens, text and finish; and those steps were the chosen ones."""
    run = runner(gpu_model)
    stops = prompt.stop_token_ids(gpu_tokenizer, None)
    requests = [dict(sampling=GREEDY, max_tokens=24),
                dict(sampling=SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=5), max_tokens=24),
                dict(sampling=SamplingParams(temperature=0.9, seed=3), max_tokens=40, stop=("e", "an"))]
    replies = {}
    for on_device in (True, False):
        if not on_device:
            monkeypatch.setattr(llama.LlamaRunner, "chooses_on_device", property(lambda self: False))
        engine = Engine(run, gpu_tokenizer, stops, SlotPool(run, 4, 1 << 30), max_queue=4)
        try:
            replies[on_device] = []
            for i, fields in enumerate(requests):
                events = list(engine.generate(GenerationRequest(list(range(2000 + 50 * i, 2030 + 50 * i)), **fields)))
                replies[on_device].append(([t for e in events for t in e.token_ids], "".join(e.text for e in events),
                                           events[-1].finish_reason))
        finally:
            engine.close()
        if on_device:
            assert any(key[0] == "chosen" for key in run.graphs.captured)
    assert replies[True] == replies[False]
    assert replies[True][2][2] == "stop" and len(replies[True][0][0]) == 24
