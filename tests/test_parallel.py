"""Parallel requests decoded together (Engine(parallel=N), --parallel): one forward serves every running
generation, and each reply is the one its request gets alone (the C++ forward computes every row by itself)."""
import queue
import threading

import pytest

from tornchat import prompt
from tornchat.engine import scheduler, speculate
from tornchat.engine.model import PREFILL_CHUNK
from tornchat.engine.slots import SlotPool
from tornchat.engine.types import GenerationRequest, SamplingParams
from tornchat.engine.worker import Engine

from runners import lean

CHEAP = speculate.Costs((1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35))  # drafts whenever there are any
TEXTS = ["Name three colors.", "Write a haiku about the sea.", "What is 12 times 12?", "Give me a tip for learning to cook."]


@pytest.fixture(scope="module")
def runner(smol):
    return lean(smol.model, "int4")


def requests(smol) -> list[GenerationRequest]:
    ids = [prompt.encode(smol.tokenizer, prompt.render(smol.tokenizer, [{"role": "user", "content": t}])) for t in TEXTS]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    return [
        GenerationRequest(ids[0], sampling=SamplingParams(temperature=0.0), max_tokens=24),
        GenerationRequest(ids[1], sampling=seeded, max_tokens=24),
        # drafts from a prediction: its verifies' rows go into the same forwards as the others' steps
        GenerationRequest(ids[2], sampling=SamplingParams(temperature=0.0), max_tokens=24,
                          prediction_ids=smol.tokenizer("12 times 12 is 144.")["input_ids"]),
        GenerationRequest(ids[3], sampling=seeded, max_tokens=24, stop=("cook",)),
    ]


def engine(runner, smol, parallel: int) -> Engine:
    stops = prompt.stop_token_ids(smol.tokenizer, smol.generation_config)
    return Engine(runner, smol.tokenizer, stops, SlotPool(runner, 4, 1 << 30), speculation=CHEAP, parallel=parallel)


def reply(events) -> tuple:
    return tuple(t for e in events for t in e.token_ids), "".join(e.text for e in events), events[-1].finish_reason


def together(engine: Engine, batch: list[GenerationRequest], cancel: int | None = None) -> list[tuple | None]:
    """Every request submitted at once; their replies (None for the one cancelled after its first text)."""
    inboxes = [queue.SimpleQueue() for _ in batch]
    handles = [engine.submit(request, inbox.put) for request, inbox in zip(batch, inboxes)]
    replies = []
    for i, (handle, inbox) in enumerate(zip(handles, inboxes)):
        events = [inbox.get(timeout=120)]
        if i == cancel:
            engine.withdraw(handle)
            replies.append(None)
            continue
        while not events[-1].is_last:
            events.append(inbox.get(timeout=120))
        replies.append(reply(events))
    return replies


def test_concurrent_requests_get_the_replies_they_get_alone(smol, runner):
    batch = requests(smol)
    solo = engine(runner, smol, parallel=1)
    alone = [reply(list(solo.generate(request))) for request in batch]
    solo.close()
    parallel = engine(runner, smol, parallel=4)
    try:
        assert together(parallel, batch) == alone
        assert parallel.batch.largest == 4  # they did share forwards
        assert parallel.stats.counters["completed"] == 4
        # One cancelled after its first text leaves the batch; the others' replies do not change.
        got = together(parallel, batch, cancel=1)
        assert got[1] is None and [g for i, g in enumerate(got) if i != 1] == [a for i, a in enumerate(alone) if i != 1]
    finally:
        parallel.close()


def test_more_requests_than_parallel_wait_their_turn(smol, runner):
    batch = requests(smol)
    two = engine(runner, smol, parallel=2)
    try:
        solo_replies = [reply(list(two.generate(request))) for request in batch]
        assert together(two, batch) == solo_replies
        assert two.batch.largest == 2
    finally:
        two.close()


def test_drafts_are_weighed_against_the_generations_sharing_the_step(smol, runner, monkeypatch):
    """A generation decoding beside others proposes its drafts for a step of that many generations (a draft's
    rows cost more against its share of such a step): alone 1, four at once 4 once they share forwards."""
    seen = []
    propose = speculate.Drafter.propose
    monkeypatch.setattr(speculate.Drafter, "propose",
                        lambda self, limit, generations=1: seen.append(generations) or propose(self, limit, generations))
    batch = requests(smol)
    four = engine(runner, smol, parallel=4)
    try:
        list(four.generate(batch[2]))
        assert seen and set(seen) == {1}
        seen.clear()
        together(four, batch)
        assert max(seen) == 4 and four.batch.largest == 4
    finally:
        four.close()


def test_a_steps_events_are_handed_on_once_every_generation_in_it_has_moved_on(smol, runner):
    """Two identical greedy requests decode in lockstep; each event is handed on only after the whole step,
    so the k-th events of both see the same count of decode steps (handed on as produced, the first one's
    went out before the second had counted its step, and the server's IOLoop, woken by it, took the GIL from
    the worker in the middle of the step). A receiver that raises is logged and the worker goes on."""
    stops = prompt.stop_token_ids(smol.tokenizer, smol.generation_config)
    three = Engine(runner, smol.tokenizer, stops, SlotPool(runner, 4, 1 << 30), parallel=3)
    try:
        held, gate = threading.Event(), threading.Event()

        def hold(event):  # holds the worker in its first step's hand-on, then fails
            held.set()
            gate.wait(30)
            raise RuntimeError("a receiver that fails")

        request = requests(smol)[0]
        three.submit(GenerationRequest(request.prompt_ids, max_tokens=2), hold)
        assert held.wait(60)
        seen: list[list[int]] = [[], []]
        done = [threading.Event(), threading.Event()]

        def receiver(i):
            def on_event(event):
                seen[i].append(three.stats.counters["decode_steps"])
                if event.is_last:
                    done[i].set()
            return on_event

        for i in range(2):  # both wait while the first request holds the worker: admitted together
            three.submit(request, receiver(i))
        gate.set()
        assert done[0].wait(120) and done[1].wait(120)
        assert len(seen[0]) > 3 and seen[0] == seen[1]
        assert three.stats.counters["completed"] == 3
    finally:
        three.close()


def test_a_shared_prompt_chunk_is_sized_by_the_rows_measured_cost():
    """Beside other generations each prompt chunk reads as many rows as, together, the last prompt rows' cost fits
    in SHARED_GAP_S, within SHARED_CHUNK_MIN (also before any cost was measured) and PREFILL_CHUNK."""
    batch = scheduler.Batch(runner=None, limit=4)
    assert batch.shared_rows(1) == scheduler.SHARED_CHUNK_MIN
    batch.row_seconds = scheduler.SHARED_GAP_S / 400
    assert batch.shared_rows(1) == 400 and batch.shared_rows(2) == 200  # two prompts share the gap
    batch.row_seconds = scheduler.SHARED_GAP_S  # a row as slow as the whole gap: the prompt still moves on
    assert batch.shared_rows(1) == scheduler.SHARED_CHUNK_MIN
    batch.row_seconds = scheduler.SHARED_GAP_S / 10_000
    assert batch.shared_rows(1) == PREFILL_CHUNK


def test_a_prompt_read_beside_a_stream_is_read_in_small_chunks_with_the_same_reply(smol, runner, monkeypatch):
    """A long prompt admitted while another request streams is read in the rows the gap allows (here the least,
    SHARED_CHUNK_MIN, made 16) of each forward it shares, so the stream's next token waits one small chunk, not a
    whole PREFILL_CHUNK; alone the same prompt is one chunk. Both replies are the ones their requests get alone."""
    monkeypatch.setattr(scheduler, "SHARED_GAP_S", 0.0)
    monkeypatch.setattr(scheduler, "SHARED_CHUNK_MIN", 16)
    forwards: list[list[tuple[int, bool]]] = []  # per forward: (rows, every) of each generation in it
    forward_many = runner.forward_many
    monkeypatch.setattr(runner, "forward_many", lambda batch: forwards.append(
        [(len(ids), every) for ids, _, every in batch]) or forward_many(batch))
    stops = prompt.stop_token_ids(smol.tokenizer, smol.generation_config)
    endless = SamplingParams(temperature=0.0, options={"logit_bias": tuple((t, -100.0) for t in sorted(stops))})
    streaming = GenerationRequest(requests(smol)[0].prompt_ids, sampling=endless, max_tokens=120)
    long_ids = prompt.encode(smol.tokenizer, prompt.render(smol.tokenizer, [
        {"role": "user", "content": "Summarize this. " + " ".join(TEXTS * 10)}]))
    assert 4 * scheduler.SHARED_CHUNK_MIN < len(long_ids) <= PREFILL_CHUNK
    reading = GenerationRequest(long_ids, sampling=SamplingParams(temperature=0.8, seed=3), max_tokens=8)
    solo = engine(runner, smol, parallel=2)
    try:
        alone = [reply(list(solo.generate(streaming)))]
        forwards.clear()
        alone.append(reply(list(solo.generate(reading))))
        assert len([forward for forward in forwards if not forward[0][1]]) == 1  # its prompt in one chunk
    finally:
        solo.close()
    two = engine(runner, smol, parallel=2)  # its own KV slots: the long prompt read afresh
    try:
        forwards.clear()
        inboxes = [queue.SimpleQueue(), queue.SimpleQueue()]
        two.submit(streaming, inboxes[0].put)
        events = [[inboxes[0].get(timeout=120)], []]  # streaming when the long prompt arrives
        two.submit(reading, inboxes[1].put)
        for i in (1, 0):
            events[i].append(inboxes[i].get(timeout=120))
            while not events[i][-1].is_last:
                events[i].append(inboxes[i].get(timeout=120))
        assert [reply(e) for e in events] == alone
        shared = [rows for forward in forwards if len(forward) == 2 for rows, every in forward if not every]
        assert len(shared) >= 4 and set(shared[:-1]) == {scheduler.SHARED_CHUNK_MIN}  # the last: what is left
        assert shared[-1] <= scheduler.SHARED_CHUNK_MIN
    finally:
        two.close()


def test_a_request_arriving_while_a_long_prompt_is_read_waits_for_a_small_chunk(smol, runner, monkeypatch):
    """A short request admitted while a long prompt is read alone (512 rows a forward) shares the next forward,
    where the long prompt's chunk, already offered whole, is read in fewer rows: the short prompt's first token
    waits for those, not for 512 more. Both replies are the ones their requests get alone."""
    monkeypatch.setattr(scheduler, "SHARED_GAP_S", 0.0)
    monkeypatch.setattr(scheduler, "SHARED_CHUNK_MIN", 16)
    forwards: list[list[tuple[int, bool]]] = []
    holding, first_chunk, admitted = threading.Event(), threading.Event(), threading.Event()
    forward_many = runner.forward_many

    def recorded(batch):
        forwards.append([(len(ids), every) for ids, _, every in batch])
        if holding.is_set() and forwards[-1] == [(PREFILL_CHUNK, False)] and not first_chunk.is_set():
            first_chunk.set()  # the long prompt's first forward: hold it until the short request is queued
            assert admitted.wait(60)
        return forward_many(batch)

    monkeypatch.setattr(runner, "forward_many", recorded)
    long_ids = prompt.encode(smol.tokenizer, prompt.render(smol.tokenizer, [
        {"role": "user", "content": "Summarize this. " + " ".join(TEXTS * 40)}]))
    assert 2 * PREFILL_CHUNK < len(long_ids) < 4 * PREFILL_CHUNK
    reading = GenerationRequest(long_ids, sampling=SamplingParams(temperature=0.0), max_tokens=4)
    short = GenerationRequest(requests(smol)[2].prompt_ids, sampling=SamplingParams(temperature=0.0), max_tokens=4)
    solo = engine(runner, smol, parallel=2)
    try:
        alone = [reply(list(solo.generate(request))) for request in (reading, short)]
    finally:
        solo.close()
    two = engine(runner, smol, parallel=2)
    try:
        forwards.clear()
        holding.set()
        inboxes = [queue.SimpleQueue(), queue.SimpleQueue()]
        two.submit(reading, inboxes[0].put)
        assert first_chunk.wait(60)
        two.submit(short, inboxes[1].put)
        admitted.set()
        events = [[inboxes[i].get(timeout=120)] for i in (0, 1)]
        for inbox, got in zip(inboxes, events):
            while not got[-1].is_last:
                got.append(inbox.get(timeout=120))
        assert [reply(e) for e in events] == alone
        together = next(forward for forward in forwards if len(forward) == 2)
        assert together == [(16, False), (16, False)]  # the long prompt's offered 512 rows, and the short one's
    finally:
        two.close()
