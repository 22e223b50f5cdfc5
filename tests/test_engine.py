"""The decode engine: greedy parity with transformers, KV reuse, stops, limits, seeds, cancel."""
import threading
import time

import pytest
import torch

from tornchat import prompt
from tornchat.engine import GenerationRequest, PromptTooLong, QueueFull, SamplingParams
from tornchat.engine.model import HFRunner
from tornchat.engine.slots import SlotPool
from tornchat.engine.worker import Engine

from conftest import make_engine
from runners import lean

GREEDY = SamplingParams(temperature=0.0)


def chat_ids(tokenizer, messages):
    return prompt.encode(tokenizer, prompt.render(tokenizer, messages))


def run(engine, ids, **kwargs):
    kwargs.setdefault("sampling", GREEDY)
    events = list(engine.generate(GenerationRequest(list(ids), **kwargs)))
    return "".join(e.text for e in events), events[-1]


def all_ids(engine, ids, **kwargs):
    kwargs.setdefault("sampling", GREEDY)
    out = []
    for event in engine.generate(GenerationRequest(list(ids), **kwargs)):
        out.extend(event.token_ids)
    return out


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_equals_transformers_generate(smol, smol_engine, question):
    tok = smol.tokenizer
    ids = chat_ids(tok, [{"role": "user", "content": question}])
    with torch.inference_mode():
        ref = smol.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids) :].tolist()
    stops = smol_engine.stop_token_ids
    if ref[-1] in stops:  # generate includes the EOS it stopped on; we report it as finish_reason
        ref = ref[:-1]
    text, last = run(smol_engine, ids, max_tokens=40)
    assert text == tok.decode(ref, skip_special_tokens=True)
    assert last.usage.completion_tokens == len(ref) + (last.finish_reason == "stop")


def conversation(turns):
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    for question, answer in turns:
        messages.append({"role": "user", "content": question})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return messages


def test_second_turn_prefills_only_its_new_suffix_and_matches_a_cold_run(smol):
    tok = smol.tokenizer
    warm, cold = make_engine(smol.model, tok), make_engine(smol.model, tok)
    try:
        turn1 = chat_ids(tok, conversation([("Name a fruit.", None)]))
        answer, _ = run(warm, turn1, max_tokens=20)
        turn2 = chat_ids(tok, conversation([("Name a fruit.", answer), ("And a vegetable?", None)]))
        text_warm, last = run(warm, turn2, max_tokens=20)
        shared = len(warm.slots.slots[0].tokens)  # what the slot held is at least turn 1's prompt
        assert warm.stats.last_reused_tokens >= len(turn1)
        assert warm.stats.last_prefill_tokens == len(turn2) - warm.stats.last_reused_tokens
        assert warm.stats.last_prefill_tokens < len(turn2) - len(turn1) + 5
        assert last.usage.cached_tokens == warm.stats.last_reused_tokens
        assert shared > len(turn2)
        text_cold, _ = run(cold, turn2, max_tokens=20)
        assert cold.stats.last_reused_tokens == 0
        assert text_warm == text_cold
    finally:
        warm.close()
        cold.close()


def test_identical_prompt_still_prefills_its_last_token(tiny_engine, tokenizer):
    ids = chat_ids(tokenizer, conversation([("hello", None)]))
    first = all_ids(tiny_engine, ids, max_tokens=5)
    second = all_ids(tiny_engine, ids, max_tokens=5)
    assert tiny_engine.stats.last_prefill_tokens == 1
    assert first == second


def test_edited_earlier_message_reuses_only_the_common_prefix(tiny_model, tokenizer):
    warm, cold = make_engine(tiny_model, tokenizer), make_engine(tiny_model, tokenizer)
    try:
        original = chat_ids(tokenizer, conversation([("The first question, long enough to matter.", "ok"), ("second", None)]))
        edited = chat_ids(tokenizer, conversation([("The first question, edited a little.", "ok"), ("second", None)]))
        shared = next(i for i, (a, b) in enumerate(zip(original, edited)) if a != b)
        all_ids(warm, original, max_tokens=8)
        got = all_ids(warm, edited, max_tokens=8)
        assert warm.stats.last_reused_tokens == shared
        assert warm.stats.last_prefill_tokens == len(edited) - shared
        assert got == all_ids(cold, edited, max_tokens=8)
    finally:
        warm.close()
        cold.close()


def test_slots_are_bounded_by_count_and_evict_least_recently_used(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer, kv_slots=2)
    try:
        convs = [chat_ids(tokenizer, [{"role": "user", "content": f"conversation {name} " * 5}]) for name in "abc"]
        for ids in convs:
            all_ids(engine, ids, max_tokens=3)
        assert len(engine.slots.slots) == 2
        all_ids(engine, convs[0], max_tokens=3)  # a was evicted: full prefill (apart from shared template)
        assert engine.stats.last_reused_tokens < len(convs[0]) - 5
        all_ids(engine, convs[2], max_tokens=3)  # c is still there
        assert engine.stats.last_prefill_tokens == 1
    finally:
        engine.close()


def test_running_slots_are_never_taken_over_nor_dropped(tiny_model):
    """Generations running together each keep their slot: a second request with the same prefix copies it, the
    pool holds more than max_slots while they all run, and comes back to max_slots once they end."""
    pool = SlotPool(HFRunner(tiny_model), 1, 1 << 30)
    first, reused, _ = pool.acquire([1, 2, 3])
    first.tokens.extend([1, 2, 3])
    second, reused, _ = pool.acquire([1, 2, 3, 4])
    assert second is not first and reused == 3 and second.tokens == [1, 2, 3]  # a copy of the running slot's prefix
    assert len(pool.slots) == 2 and first in pool.slots  # over max_slots: neither running slot was dropped
    pool.enforce_budget()
    assert len(pool.slots) == 2
    pool.release(first)
    pool.enforce_budget()
    assert pool.slots == [second]
    pool.release(second)
    again, reused, _ = pool.acquire([1, 2, 3, 4, 5])
    assert again is second and reused == 3  # an idle slot is taken over as before


def test_a_next_turn_that_renders_the_last_reply_otherwise_cuts_it_in_place(tiny_model):
    """A prompt holding the slot's whole last prompt, then other text than its reply (a template that drops an
    earlier reply's thinking): the slot itself is cut back and extended, not copied. The same prompt again (a
    second reply to it) still copies, keeping the first reply's branch."""
    pool = SlotPool(HFRunner(tiny_model), 4, 1 << 30)
    slot, reused, _ = pool.acquire([1, 2, 3])
    pool.runner.forward([1, 2, 3, 7, 8], slot.cache)
    slot.tokens.extend([1, 2, 3, 7, 8])  # the prompt prefilled, then its reply generated
    pool.release(slot)
    again, reused, _ = pool.acquire([1, 2, 3, 8, 4, 5])
    assert again is slot and reused == 3 and slot.tokens == [1, 2, 3] and slot.cache.get_seq_length() == 3
    assert pool.slots == [slot]
    slot.tokens.extend([8, 4, 5, 9])
    pool.release(slot)
    branch, reused, _ = pool.acquire([1, 2, 3, 8, 4, 5])
    assert branch is not slot and reused == 5 and slot.tokens == [1, 2, 3, 8, 4, 5, 9] and len(pool.slots) == 2


def test_a_re_rendered_reply_keeps_one_slot_and_the_cold_text(tiny_model, tokenizer):
    """Through the engine: the second turn sends the first reply back changed at its start (as Qwen3's template
    strips a reply's leading newlines), and the conversation stays in one slot, with the reply a cold run gives.
    The lean runner's C++ forward computes each row by itself, so warm and cold are equal by construction."""
    def lean_engine():
        runner = lean(tiny_model)
        return Engine(runner, tokenizer, prompt.stop_token_ids(tokenizer, None), SlotPool(runner, 4, 1 << 30))

    warm, cold = lean_engine(), lean_engine()
    assert warm.runner.step is not None  # the C++ forward, not the Python loop
    try:
        turn1 = chat_ids(tokenizer, conversation([("Tell me something.", None)]))
        answer, _ = run(warm, turn1, max_tokens=12)
        turn2 = chat_ids(tokenizer, conversation([("Tell me something.", "Re-rendered: " + answer), ("More?", None)]))
        got, _ = run(warm, turn2, max_tokens=8)
        assert len(warm.slots.slots) == 1 and warm.stats.last_reused_tokens >= len(turn1) - 1
        assert got == run(cold, turn2, max_tokens=8)[0]
    finally:
        warm.close()
        cold.close()


def test_slots_are_bounded_by_memory(tiny_model, tokenizer):
    ids = chat_ids(tokenizer, [{"role": "user", "content": "9 memory " * 40}])
    probe = make_engine(tiny_model, tokenizer)
    all_ids(probe, ids, max_tokens=2)
    one_slot = probe.slots.total_bytes()
    probe.close()
    engine = make_engine(tiny_model, tokenizer, kv_slots=8, kv_bytes=int(one_slot * 1.5))
    try:
        for n in range(4):
            all_ids(engine, chat_ids(tokenizer, [{"role": "user", "content": f"{n} memory " * 40}]), max_tokens=2)
            assert engine.slots.total_bytes() <= int(one_slot * 1.5)
        assert len(engine.slots.slots) == 1
    finally:
        engine.close()


def test_stop_string_spanning_tokens_stops_and_is_not_returned(smol, smol_engine):
    tok = smol.tokenizer
    ids = chat_ids(tok, [{"role": "user", "content": "Write a haiku about the sea."}])
    full, _ = run(smol_engine, ids, max_tokens=40)
    # A stop string that starts inside one token and ends inside another.
    gen_ids = tok(full, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in gen_ids]
    cut = len(pieces[0]) + len(pieces[1]) - 1
    stop = full[cut : cut + 4]
    assert len(stop) == 4
    text, last = run(smol_engine, ids, max_tokens=40, stop=(stop,))
    assert last.finish_reason == "stop"
    assert text == full[: full.index(stop)]
    assert stop not in text


def test_max_tokens_and_max_length_tighter_bound_wins(tiny_engine, tokenizer):
    ids = chat_ids(tokenizer, [{"role": "user", "content": "count"}])
    _, last = run(tiny_engine, ids, max_tokens=1)
    assert (last.finish_reason, last.usage.completion_tokens) == ("length", 1)
    _, last = run(tiny_engine, ids, max_tokens=10, max_length=len(ids) + 3)
    assert (last.finish_reason, last.usage.completion_tokens) == ("length", 3)
    _, last = run(tiny_engine, ids, max_tokens=2, max_length=len(ids) + 30)
    assert last.usage.completion_tokens == 2
    assert last.usage.total_tokens == len(ids) + 2


@pytest.mark.parametrize("max_length", [1, "prompt", "prompt-1"])
def test_prompt_filling_max_length_or_context_is_rejected(tiny_engine, tokenizer, max_length):
    ids = chat_ids(tokenizer, [{"role": "user", "content": "too long"}])
    limit = {1: 1, "prompt": len(ids), "prompt-1": len(ids) - 1}[max_length]
    with pytest.raises(PromptTooLong):
        tiny_engine.submit(GenerationRequest(ids, max_length=limit), lambda e: None)
    with pytest.raises(PromptTooLong):
        tiny_engine.submit(GenerationRequest([1] * tiny_engine.context_length), lambda e: None)


def test_seed_reproduces_sampling_and_other_seeds_differ(smol_engine, tokenizer):
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Tell me a very short story."}])
    sampled = lambda seed: run(smol_engine, ids, max_tokens=24, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed))[0]
    assert sampled(7) == sampled(7)
    assert len({sampled(7), sampled(8), sampled(9)}) > 1


def test_cancel_mid_generation_stops_within_one_step(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    try:
        ids = chat_ids(tokenizer, [{"role": "user", "content": "go"}])
        first = threading.Event()
        events = []

        def on_event(event):
            events.append(event)
            first.set()
            # Hold the worker inside this step until the cancel has landed.
            if len(events) == 1:
                handle.cancel()

        handle = engine.submit(GenerationRequest(ids, sampling=GREEDY, max_tokens=400, stop=()), on_event)
        assert first.wait(30)
        engine.submit(GenerationRequest(ids, max_tokens=1), lambda e: None)  # runs once the worker is free
        deadline = threading.Event()
        while engine.stats.counters["requests"] < 2 and not deadline.wait(0.05):
            pass
        assert engine.stats.counters["cancelled"] == 1
        assert not any(e.is_last for e in events)
        assert engine.stats.counters["decode_steps"] <= len(events) + 1
    finally:
        engine.close()


def held_worker(engine: Engine, tokenizer) -> tuple[threading.Event, list[int]]:
    """A first request whose first event holds the worker until the returned gate is set; and its prompt ids."""
    gate = threading.Event()
    ids = chat_ids(tokenizer, [{"role": "user", "content": "go"}])
    engine.submit(GenerationRequest(ids, max_tokens=2), lambda e: gate.wait(30))
    while engine.queue_depth():
        pass
    return gate, ids


def test_queued_request_can_be_withdrawn_and_queue_is_bounded(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer, max_queue=1)
    try:
        gate, ids = held_worker(engine, tokenizer)
        queued = engine.submit(GenerationRequest(ids, max_tokens=2), lambda e: None)
        with pytest.raises(QueueFull):
            engine.submit(GenerationRequest(ids, max_tokens=2), lambda e: None)
        engine.withdraw(queued)
        assert engine.queue_depth() == 0
        assert engine.stats.counters["cancelled"] == 1
        gate.set()
    finally:
        engine.close()


def test_the_time_a_request_waits_in_the_queue_is_counted_in_its_bucket(tiny_model, tokenizer):
    """A request queued behind a worker held for 0.3 s waited at least that: it falls past the 0.25 s bucket;
    both requests are counted, and in the sum."""
    from tornchat.engine.worker import QUEUE_WAIT_BUCKETS

    engine = make_engine(tiny_model, tokenizer)
    try:
        gate, ids = held_worker(engine, tokenizer)
        done = threading.Event()
        engine.submit(GenerationRequest(ids, max_tokens=2), lambda e: e.is_last and done.set())
        time.sleep(0.3)
        gate.set()
        assert done.wait(30)
        waits = engine.stats.queue_waits
        assert sum(waits) == 2 and engine.stats.queue_wait_sum >= 0.3
        assert sum(waits[QUEUE_WAIT_BUCKETS.index(0.25) + 1 :]) >= 1  # the first one's admission is not timed
    finally:
        engine.close()


def test_model_failure_reports_error_event_and_engine_recovers(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    try:
        ids = chat_ids(tokenizer, [{"role": "user", "content": "fail"}])
        real_forward = engine.runner.forward
        engine.runner.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
        events = list(engine.generate(GenerationRequest(ids, max_tokens=3)))
        assert isinstance(events[-1].error, RuntimeError)
        assert engine.slots.slots == []  # the half-written slot was dropped
        engine.runner.forward = real_forward
        _, last = run(engine, ids, max_tokens=3)
        assert last.finish_reason == "length"
    finally:
        engine.close()


def test_slot_pool_rejects_zero_slots(tiny_model):

    with pytest.raises(ValueError):
        SlotPool(HFRunner(tiny_model), 0, 1 << 20)


def test_the_model_is_built_on_the_thread_that_serves_it(tiny_checkpoint, monkeypatch):
    """One thread does all model work: with OpenMP, a second thread running torch ops brings a second
    team of threads, which on few cores slows every step (docs/performance.md, figures behind the code's
    choices)."""
    from tornchat.config import Config
    from tornchat import build

    built_on, served_on = [], []
    make_runner, run_forever = build.make_runner, build.Engine.run_forever
    monkeypatch.setattr(build, "make_runner", lambda *a, **k: built_on.append(threading.current_thread()) or make_runner(*a, **k))
    monkeypatch.setattr(build.Engine, "run_forever", lambda self: served_on.append(threading.current_thread()) or run_forever(self))
    engine = build.build_engine(Config(checkpoint_path=tiny_checkpoint, device="cpu"))
    try:
        _, last = run(engine, [1, 2, 3], max_tokens=2)
        assert last.usage.completion_tokens >= 1
        assert built_on == served_on and built_on[0] is not threading.main_thread()
    finally:
        engine.close()


SPELLING = (b"A", b"\n", b"\n\n", b"x", b"y", b"B", b"Bx")


def test_realign_takes_the_cached_ids_while_they_spell_the_same_bytes():
    from tornchat.engine.slots import realign

    # cached wrote "\n\n" as one token; the tokenizer's prompt has two. Same text up to "x" vs "y".
    assert realign([0, 1, 1, 3, 4], [0, 2, 3, 3], SPELLING) == [0, 2, 3, 4]
    assert realign([0, 1, 1, 4], [0, 2, 3], SPELLING) == [0, 2, 4]
    assert realign([0, 3, 4], [0, 2, 3], SPELLING) == [0, 3, 4]  # other text: unchanged
    assert realign([0, 1, 1, 4], [0, 99], SPELLING) == [0, 1, 1, 4]  # an id past the tokenizer's: no match
    # Never longer than the prompt, whose token budget was checked: "Bx" stays one token.
    assert realign([0, 6, 4], [0, 5, 3], SPELLING) == [0, 6, 4]


def test_resent_text_that_tokenizes_differently_still_reuses_the_slot(tiny_model, tokenizer):
    from tornchat.engine.worker import Engine
    from tornchat.kernels.stopcheck import prompt_bytes

    runner = HFRunner(tiny_model)
    engine = Engine(runner, tokenizer, prompt.stop_token_ids(tokenizer), SlotPool(runner, 2, 1 << 30, prompt_bytes(tokenizer)))
    try:
        newline, two_newlines = tokenizer.convert_tokens_to_ids(["Ċ", "ĊĊ"])
        canonical = tokenizer("Items are:\n\n1. one, 2. two", add_special_tokens=False)["input_ids"]
        i = canonical.index(newline)
        assert canonical[i + 1] == newline  # the tokenizer splits "\n\n" here; SmolLM2 writes it as one token
        as_generated = canonical[:i] + [two_newlines] + canonical[i + 2 :]
        run(engine, as_generated, max_tokens=1)
        resent = canonical + tokenizer(" and three", add_special_tokens=False)["input_ids"]
        _, last = run(engine, resent, max_tokens=1)
        assert engine.stats.last_reused_tokens == len(as_generated)  # not just up to the newline
        assert last.usage.prompt_tokens == len(resent) - 1  # the same text, in the slot's ids
    finally:
        engine.close()
