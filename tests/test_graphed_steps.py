"""The CUDA decode steps' bookkeeping (``cuda_graph.GraphedSteps``) on the CPU: which rows share a step, and the
step that chooses its token, whose buffers advance on the device and are set again after other steps ran.

A GPU runs these rarely; here the step's Triton kernels run through the interpreter, and a "captured graph"
keeps the step to run again at each replay (what a CUDA graph replays: the same kernels on the same buffers),
after the warm-up run the real capture does too. What the GPU adds, captures and bit-exact products, is
tests/test_cuda.py's.
"""
import os
import types
import weakref

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # chosen at @triton.jit: before the kernel modules are imported

import pytest  # noqa: E402

from tornchat import prompt  # noqa: E402
from tornchat.engine import cuda_graph, llama, step_ops  # noqa: E402
from tornchat.engine.slots import SlotPool  # noqa: E402
from tornchat.engine.types import GenerationRequest, SamplingParams  # noqa: E402
from tornchat.engine.worker import Engine  # noqa: E402

from test_parallel import CHEAP, reply, together  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda.py runs these steps captured")


def replayed_capture(self, key, kvs, run):
    """``GraphedSteps._capture`` without CUDA: the warm-up run, then a 'graph' whose replay runs the step again and
    leaves its result where the first run left it."""
    if len(self.captured) >= cuda_graph.GRAPH_LIMIT or any(ref() is None for c in self.captured.values() for ref in c.kvs):
        self.captured.clear()
        self.seen.clear()
    with torch.inference_mode():
        output = run()

    def replay():
        with torch.inference_mode():
            result = run()
            if result is not output:
                output.copy_(result)

    captured = cuda_graph._Captured(types.SimpleNamespace(replay=replay), tuple(weakref.ref(kv) for kv in kvs), output)
    self.captured[key] = captured
    self.captures += 1
    self.loaded = None
    return captured


@pytest.fixture
def graphed(monkeypatch):
    """A 2-layer random Llama's lean forward with GraphedSteps, its step's kernels interpreted; over the first
    4,096 ids of SmolLM2's vocabulary (the interpreter runs a program at a time: a whole vocabulary's head
    would take most of the time)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("TORNCHAT_TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: types.SimpleNamespace())
    monkeypatch.setattr(cuda_graph.GraphedSteps, "_capture", replayed_capture)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=True)).eval()
    spec, weights = llama.from_transformers(model)
    run = llama.LlamaRunner(spec, weights, kv_dtype=torch.float32, graphs=False)
    assert step_ops.triton_ops().rows_apart(run)
    return run


def requests(tokenizer) -> list[GenerationRequest]:
    ids = [list(range(1000 + 50 * i, 1020 + 50 * i)) for i in range(4)]
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=5)
    return [
        GenerationRequest(ids[0], sampling=SamplingParams(temperature=0.0), max_tokens=8),
        GenerationRequest(ids[1], sampling=seeded, max_tokens=8),
        # drafts: verifies (steps of several rows, the logits chosen on the host) between chosen steps
        GenerationRequest(ids[2], sampling=SamplingParams(temperature=0.0), max_tokens=8,
                          prediction_ids=tokenizer(" the the the the the")["input_ids"]),
        GenerationRequest(ids[3], sampling=SamplingParams(temperature=0.9, seed=3), max_tokens=16, stop=("e", "an")),
    ]


def test_a_chosen_step_gives_the_replies_the_host_chooses_and_shares_nothing_stale(graphed, tokenizer, monkeypatch):
    """Each request alone, then all four together (a lone generation's steps chosen on the device, shared steps
    and verifies chosen on the host, in turn as generations end), against every token chosen on the host."""
    stops = prompt.stop_token_ids(tokenizer, None)
    batch = requests(tokenizer)
    replies = {}
    for on_device in (True, False):
        graphed.graphs = cuda_graph.GraphedSteps(graphed)
        if not on_device:
            monkeypatch.setattr(llama.LlamaRunner, "chooses_on_device", property(lambda self: False))
        alone = Engine(graphed, tokenizer, stops, SlotPool(graphed, 4, 1 << 30), speculation=CHEAP, parallel=1)
        try:
            replies[on_device, "alone"] = [reply(list(alone.generate(r))) for r in batch]
        finally:
            alone.close()
        chosen = [key for key in graphed.graphs.captured if key[0] == "chosen"]
        assert bool(chosen) == on_device
        shared = Engine(graphed, tokenizer, stops, SlotPool(graphed, 4, 1 << 30), speculation=CHEAP, parallel=4)
        try:
            replies[on_device, "together"] = together(shared, batch)
            assert shared.batch.largest == 4
        finally:
            shared.close()
    assert replies[True, "alone"] == replies[False, "alone"] == replies[True, "together"] == replies[False, "together"]
    finishes = [finish for _, _, finish in replies[True, "alone"]]
    assert finishes[3] == "stop" and all(len(tokens) == 8 for tokens, _, _ in replies[True, "alone"][:3])


def test_a_lone_reply_sets_the_chosen_steps_buffers_once(graphed, tokenizer, monkeypatch):
    """The token, position, index and window a chosen step feeds itself advance on the device: a lone reply
    copies them in before its first chosen step (before the capture's warm-up run, and again after it) and never
    again, and still gets the host's tokens."""
    loads = []
    load = cuda_graph.GraphedSteps._load
    monkeypatch.setattr(cuda_graph.GraphedSteps, "_load", lambda self, *args: loads.append(args[0]) or load(self, *args))
    stops = prompt.stop_token_ids(tokenizer, None)
    request = requests(tokenizer)[1]  # seeded: the sampler's index must advance too
    replies = []
    for on_device in (True, False):
        graphed.graphs = cuda_graph.GraphedSteps(graphed)
        if not on_device:
            monkeypatch.setattr(llama.LlamaRunner, "chooses_on_device", property(lambda self: False))
        engine = Engine(graphed, tokenizer, stops, SlotPool(graphed, 4, 1 << 30))
        try:
            replies.append(reply(list(engine.generate(request))))
        finally:
            engine.close()
        if on_device:
            assert len(loads) == 2 and len(replies[0][0]) == request.max_tokens
    assert replies[0] == replies[1]
