"""Prompt-lookup speculation: what the drafter proposes, how long its drafts are, and that the text never
changes with it on (greedy and seeded, with every request option that touches the logits)."""
import threading
import time

import pytest
import torch

from tornchat import prompt
from tornchat.engine import speculate
from tornchat.engine.grammar import Compiler, json_value
from tornchat.engine.model import HFRunner
from tornchat.engine.slots import SlotPool
from tornchat.engine.speculate import Costs, Drafter
from tornchat.engine.types import GenerationRequest, SamplingParams
from tornchat.engine.worker import Engine

from runners import lean

CHEAP = Costs((1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35))  # drafts pay even at a low acceptance
FREE = Costs((1.0,) * 8)  # every draft as long as it can be
LINEAR = Costs(tuple(float(r) for r in range(1, 9)))  # a verify costs its rows in steps: never pays


def test_a_lookup_finds_the_latest_occurrence_that_something_follows():
    drafter = Drafter(FREE, [5, 6, 7, 1, 5, 6, 9, 5, 6], prediction=[])
    assert drafter.propose(8) == [9, 5, 6]  # "5 6" last ends at 6 with a follower; the one at the very end has none
    for token in (8, 5, 6):  # the reply's 8 follows the prompt's last "5 6", which now ends the latest one
        drafter.append(token)
    assert drafter.propose(8) == [8, 5, 6]
    assert Drafter(FREE, [3], prediction=[3]).propose(4) == []  # one token, followed by nothing
    assert speculate._latest_ends([5, 6, 5, 6, 7], 2) == {(5, 6): 4, (6, 5): 3}


def test_longest_match_first_and_the_prediction_before_the_context():
    drafter = Drafter(FREE, [1, 2, 3, 40, 41, 9, 3, 50, 51, 52, 2, 3], prediction=[])
    assert drafter.propose(2) == [40, 41]  # "2 3" matches once (at the start); "3" alone would say 50
    drafter = Drafter(FREE, [8, 3, 50, 51, 9, 9, 3], prediction=[])
    assert drafter.propose(3) == [50, 51, 9]  # only "3" matches; the most recent occurrence with a follower
    drafter = Drafter(FREE, [7, 1, 2, 60, 1, 2], prediction=[1, 2, 70, 71])
    assert drafter.propose(4) == [70, 71]  # the prediction first, up to its end
    assert Drafter(FREE, [1, 2, 3], prediction=[]).propose(4) == []  # nothing to look up


def test_a_followed_draft_continues_where_it_left_off_not_at_the_latest_repeat():
    source = [10, 11, 12, 13, 14, 10, 11, 12, 15, 16]  # "10 11 12" twice: the latest copy goes to 15
    drafter = Drafter(FREE, [99], prediction=source)
    for token in (7, 10, 11, 12):  # a reply that did not start as the prediction does
        drafter.append(token)
    assert drafter.propose(2) == [15, 16]  # latest occurrence of "10 11 12"
    drafter = Drafter(FREE, [99], prediction=source)
    drafter.append(10)
    assert drafter.propose(2) == [11, 12]  # the reply so far is the prediction's start: its continuation
    drafter.follow = (True, 3)  # as if the draft had come from the first copy
    for token in (11, 12):
        drafter.append(token)
    drafter.observe(2, 2)
    assert drafter.propose(2) == [13, 14]  # the first copy, continued


def test_draft_length_is_the_best_bet_at_the_estimated_acceptance():
    assert LINEAR.best_draft(0.99, 7) == 0 and not LINEAR.pays()
    assert CHEAP.pays()
    assert CHEAP.best_draft(0.9, 7) == 7 and CHEAP.best_draft(0.9, 2) == 2
    costs = Costs((1.0, 1.2, 1.5, 1.75, 2.4))
    assert costs.best_draft(0.1, 4) == 0  # 1.1 tokens for 1.2 steps
    assert costs.best_draft(0.5, 4) == 1  # 1.5 / 1.2 beats 1.75 / 1.5
    assert costs.best_draft(0.9, 4) == 3  # 3.44 / 1.75; four drafts' 4.1 / 2.4 is worse


def test_a_step_shared_by_other_generations_takes_shorter_drafts():
    """Among 4 generations a step costs each a quarter of a 4-row step (1.3 / 4 of a lone one here), and a
    draft's rows cost what they cost alone: 0.1 a row, so a third of that share."""
    costs = Costs((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7))
    assert costs.best_draft(0.5, 7) == 2 and costs.best_draft(0.5, 7, generations=1) == 2  # 1.75 / 1.2
    assert costs.best_draft(0.5, 7, generations=4) == 1  # 1.5 / 1.31 beats 1.75 / 1.62
    assert costs.best_draft(0.3, 7) == 1 and costs.best_draft(0.3, 7, generations=4) == 0  # 1.3 / 1.31: no gain
    # past the table each further row costs what the last one did: 20 rows 2.9 steps, a share of 0.145
    assert costs.rows(20) == pytest.approx(2.9) and costs.best_draft(0.9, 7, generations=20) == 2  # 2.71 / 2.38


def test_a_shared_step_weighs_the_rows_a_draft_adds_to_it():
    """Where a lone step's extra rows come nearly free (the weights' reading bounds it) and later rows do not
    (the arithmetic does), a draft in a step of 4 generations adds its rows past the fourth: 0.3 a row here,
    against a share of 1.1 / 4, so none pays; alone, three drafts cost 0.1."""
    costs = Costs((1.0, 1.0, 1.05, 1.1, 1.4, 1.7, 2.0, 2.3))
    assert costs.best_draft(0.5, 7) == 3  # 1.875 / 1.1
    assert costs.best_draft(0.5, 7, generations=4) == 0 and costs.best_draft(0.95, 7, generations=4) == 0
    assert costs.best_draft(0.95, 7, generations=2) == 2  # rows 3 and 4: 0.1 against a share of 0.5


def test_misses_shrink_drafts_to_none_and_faded_evidence_tries_again():
    costs = Costs((1.0, 1.2, 1.5, 1.75, 2.4))
    drafter = Drafter(costs, [5, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], prediction=[])
    assert drafter.propose(4) == [4]  # "1 2 3": at the 3-gram prior (0.6), one draft is the best bet
    for _ in range(5):
        drafter.observe(0, 1)
    assert drafter.propose(4) == []  # the match is there, but 3-gram drafts have stopped paying
    for _ in range(60):
        drafter.append(0)
    for token in (1, 2, 3):
        drafter.append(token)
    assert drafter.propose(4) == [0]  # the misses have faded towards the prior: the latest "1 2 3" again


def test_measured_costs_time_a_few_verify_sizes_and_interpolate_the_rest(monkeypatch):
    """Rows 1, 2, 4 and 8 are timed, taking turns, the others interpolated; each size keeps its fastest time, so
    a neighbour's load on one timing does not make drafts look dear; the rounds stop after two once they have
    taken the budget, where each size's two fastest timings agree (steady), else they go on. Measured in pieces
    (``measuring``), a round at a time, the budget counts the rounds alone, not what the caller did between
    them."""
    clock, timed = [0.0], []
    slowed = {(2, 2): 100}  # (rows, which of their timings: 0 the first) -> units a neighbour adds to it

    class Runner:  # a verify of r rows takes r + 1 units of a fake clock
        def new_cache(self):
            return type("Cache", (), {"length": 0})()

        def forward(self, ids, cache):
            cache.length = len(ids)

        def truncate(self, cache, length):
            cache.length = length

        def verify(self, ids, cache):
            timed.append(len(ids))
            clock[0] += len(ids) + 1 + slowed.get((len(ids), timed.count(len(ids)) - 1), 0)
            return torch.zeros(len(ids), 3)  # logits, read back as the loop reads them

    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])
    costs = speculate.measure(Runner(), list(range(20)), repeats=5, budget_s=1e9)
    assert timed == [1, 2, 4, 8] * 5  # the sizes in turn, five rounds
    assert costs.relative == (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5)  # the slowed 2-row timing is not the fastest
    assert costs.steady
    timed.clear()
    slowed = {(8, 0): 100}  # a first call's cold start: the fastest of the rounds is a later one's
    costs = speculate.measure(Runner(), list(range(20)), repeats=5, budget_s=15)  # a round takes 19 units or more
    assert timed == [1, 2, 4, 8] * 3  # the first round alone spent the budget; its 8 rows and the second's disagree
    assert costs.relative == (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5) and costs.steady
    timed.clear()
    slowed = {(1, n): 5 * (n + 1) for n in range(speculate.MAX_ROUNDS)}  # one row, slowed more at every round
    costs = speculate.measure(Runner(), list(range(20)), repeats=5, budget_s=10)
    assert timed == [1, 2, 4, 8] * 4  # 24 + 29 + 34 + 39 units: past UNSTEADY_BUDGET times the budget
    assert not costs.steady and costs.relative[:6] == (1.0,) * 6  # 2 rows in 3 units, one in 7: drafts look free
    timed.clear()
    slowed, pieces = {}, speculate.measuring(Runner(), list(range(20)), repeats=5, budget_s=60)
    for round_ in range(3):
        next(pieces)  # a piece: the prompt's prefill, or a round
        assert timed == [1, 2, 4, 8] * round_
        clock[0] += 1000  # the engine serves a request between pieces
    next(pieces)
    with pytest.raises(StopIteration) as done:
        next(pieces)
    assert timed == [1, 2, 4, 8] * 4  # 19 + 19 + 19 units are not yet 60; the 4th round's 76 are
    assert done.value.value.relative == (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5)


def test_verify_costs_are_measured_on_a_transformers_runner_too(tiny_model):
    """speculate.measure on HFRunner, whose caches are transformers' own (no length of ours): the costs of 1 to
    MAX_DRAFT + 1 rows relative to one row's, where a first start with speculation on used to stop."""
    costs = speculate.measure(HFRunner(tiny_model), list(range(20)), repeats=2, budget_s=0)
    assert len(costs.relative) == speculate.MAX_DRAFT + 1 and costs.relative[0] == 1.0
    assert all(cost > 0 for cost in costs.relative)


def test_a_prediction_is_drafted_from_the_first_token_and_never_starves():
    """The reply's first token starts the prediction: drafting follows it at once (not after an n-gram has
    matched), and even where the estimate says drafts do not pay, one predicted token is tried, so that
    hits can raise the estimate again."""
    drafter = Drafter(CHEAP, [5, 6, 7], prediction=[10, 11, 12, 13, 14])
    drafter.append(10)
    assert drafter.propose(8) == [11, 12, 13, 14]
    costly = Drafter(LINEAR, [5, 6, 7], prediction=[10, 11, 12, 13, 14])
    costly.append(10)
    assert costly.propose(8) == [11]  # LINEAR never pays, yet the prediction gets its test
    costly.observe(1, 1)
    costly.append(11)
    costly.append(12)
    assert costly.propose(8) == [13]
    elsewhere = Drafter(LINEAR, [5, 6, 7], prediction=[10, 11, 12, 13])
    elsewhere.append(99)  # the reply left the prediction: nothing of it follows
    assert elsewhere.propose(8) == []


@pytest.fixture(scope="module")
def int4_runner(smol):
    return lean(smol.model, "int4")


FUNCTION = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
"""
EDIT = f"Rename the variable `total` to `running` in this function. Reply with the whole function only.\n\n{FUNCTION}"
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)
OPTIONS = {
    "greedy": dict(sampling=SamplingParams(temperature=0.0)),
    "seeded": dict(sampling=SEEDED),
    "penalties and logprobs": dict(logprobs=3, sampling=SamplingParams(temperature=0.5, seed=99, options=dict(
        frequency_penalty=0.05, presence_penalty=0.05, repetition_penalty=1.02, logit_bias=((28, -2.0),), min_p=0.05))),
    # XTC's draw, like the sampler's, is keyed by (seed, index); DRY reads the history a verify's rows extend.
    "dry, xtc, typical_p, top_n_sigma": dict(sampling=SamplingParams(temperature=0.7, seed=5, options=dict(
        dry_multiplier=0.8, xtc_probability=0.5, xtc_threshold=0.05, typical_p=0.95, top_n_sigma=2.0))),
    "stop string": dict(sampling=SamplingParams(temperature=0.0), stop=("return",)),
    "odd max_tokens": dict(sampling=SEEDED, max_tokens=37),
}


def generate(engine: Engine, ids: list[int], **options) -> tuple[list[int], str, list, object]:
    options.setdefault("max_tokens", 160)
    events = list(engine.generate(GenerationRequest(list(ids), **options)))
    tokens = [t for e in events for t in e.token_ids]
    return tokens, "".join(e.text for e in events), [lp for e in events for lp in e.logprobs], events[-1]


@pytest.fixture(scope="module")
def engines(smol, int4_runner):
    tokenizer, stops = smol.tokenizer, prompt.stop_token_ids(smol.tokenizer, smol.generation_config)
    pair = {costs: Engine(int4_runner, tokenizer, stops, SlotPool(int4_runner, 2, 1 << 30), speculation=costs)
            for costs in (None, CHEAP)}
    yield pair
    for engine in pair.values():
        engine.close()


@pytest.mark.parametrize("option", list(OPTIONS))
def test_speculation_changes_nothing_in_the_reply(smol, engines, option):
    ids = prompt.encode(smol.tokenizer, prompt.render(smol.tokenizer, [{"role": "user", "content": EDIT}]))
    plain = generate(engines[None], ids, **OPTIONS[option])
    drafted = generate(engines[CHEAP], ids, prediction_ids=smol.tokenizer(FUNCTION)["input_ids"], **OPTIONS[option])
    assert drafted[:3] == plain[:3]  # ids, text, logprobs
    assert drafted[3].finish_reason == plain[3].finish_reason
    assert drafted[3].usage.completion_tokens == plain[3].usage.completion_tokens
    usage = drafted[3].usage
    assert usage.accepted_prediction_tokens + usage.rejected_prediction_tokens > 0  # drafts were verified
    assert plain[3].usage.accepted_prediction_tokens == plain[3].usage.rejected_prediction_tokens == 0
    if option == "greedy":  # a small model copying code: much of it comes from drafts (a third of it here, the
        # exact share depends on the reply, whose last bits depend on the CPU's instruction set)
        assert usage.accepted_prediction_tokens > usage.completion_tokens / 4 > 0


def test_speculation_keeps_a_grammar_exact(smol, engines):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    ask = 'Describe the function as JSON: {"name": ..., "tags": [...]}.\n\n' + FUNCTION
    ids = prompt.encode(smol.tokenizer, prompt.render(smol.tokenizer, [{"role": "user", "content": ask}]))
    compiler = Compiler(smol.tokenizer)
    replies = [generate(engine, ids, sampling=SEEDED, grammar=compiler.compile(f"start: {json_value(schema)}"))
               for engine in engines.values()]
    assert replies[0][:3] == replies[1][:3]
    assert replies[0][1].startswith("{")
    assert replies[1][3].usage.accepted_prediction_tokens + replies[1][3].usage.rejected_prediction_tokens > 0


def test_the_cache_after_a_speculative_reply_serves_the_next_turn(smol, engines):
    """Rejected drafts leave the slot's cache: the next turn reuses the reply and continues identically."""
    ids = prompt.encode(smol.tokenizer, prompt.render(smol.tokenizer, [{"role": "user", "content": EDIT}]))
    turns = []
    for engine in engines.values():
        first = generate(engine, ids, sampling=SEEDED)
        follow_up = ids + first[0] + smol.tokenizer("\nNow add a docstring.")["input_ids"]
        second = generate(engine, follow_up, sampling=SamplingParams(temperature=0.0))
        assert second[3].usage.cached_tokens >= len(ids) + len(first[0]) - 1
        turns.append((first[:3], second[:3]))
    assert turns[0] == turns[1]


def test_costs_that_timing_noise_made_cheaper_than_fewer_rows_are_raised():
    # Measured on a busy machine: 8 rows "cost" 0.02 steps. Kept, every draft would look free.
    noisy = Costs((1.0, 0.996, 0.993, 1.0, 1.028, 1.039, 0.023, 0.019))
    assert noisy.relative == (1.0, 1.0, 1.0, 1.0, 1.028, 1.039, 1.039, 1.039)
    assert Costs((1.0, 1.2, 1.5)).relative == (1.0, 1.2, 1.5)  # plausible costs are kept as measured


def test_remembered_costs_are_measured_again_for_another_build_of_the_kernels(monkeypatch, tmp_path):
    """An upgrade changes what a verify costs: the key of a remembered measurement names the kernels' build."""
    from tornchat.engine import fused, measurements

    cache_file = tmp_path / "measurements.json"
    measurements.remember(cache_file, measurements.cache_key("speculate: x", "checkpoint"), {"relative": [1.0, 1.1]})
    assert measurements.recall(cache_file, measurements.cache_key("speculate: x", "checkpoint")) == {"relative": [1.0, 1.1]}
    monkeypatch.setattr(fused, "build_id", lambda: "another build")
    assert measurements.recall(cache_file, measurements.cache_key("speculate: x", "checkpoint")) is None


def test_a_first_start_under_auto_measures_while_idle_and_remembers(tmp_path, monkeypatch):
    """--speculate auto at a first start: no costs yet and a measurement for the engine's idle moments, whose
    result is remembered, so the next start recalls it; --speculate lookup measures before the engine starts. A
    measurement whose timings never agreed (a busy machine) is taken again while idle, up to IDLE_MEASURES times;
    where none agreed it turns no drafts on and is not remembered: the next start measures again."""
    from tornchat import build

    monkeypatch.setenv("TORNCHAT_CACHE", str(tmp_path))
    clock, busy = [0.0], [0]  # busy: one-row verifies a neighbour still slows, each by a different amount
    monkeypatch.setattr(speculate.time, "perf_counter", lambda: clock[0])

    class Runner:  # a verify of r rows takes 20 + r units of a fake clock (drafts pay), one row more while busy
        def new_cache(self):
            return type("Cache", (), {})()

        def forward(self, ids, cache):
            pass

        def truncate(self, cache, length):
            pass

        def verify(self, ids, cache):
            slowed = 0
            if len(ids) == 1 and busy[0]:
                slowed, busy[0] = 5 * busy[0], busy[0] - 1
            clock[0] += (20 + len(ids) + slowed) / 1e4
            return torch.zeros(len(ids), 3)

    def run(measuring) -> speculate.Costs | None:
        with pytest.raises(StopIteration) as done:
            while True:
                next(measuring)
        return done.value.value

    busy[0] = build.IDLE_MEASURES * speculate.MAX_ROUNDS  # through every measurement's rounds
    _, measuring = build.speculation(Runner(), "auto", list(range(20)), "model-a")
    assert run(measuring) is None and busy[0] == 0  # one row's 26 units or more against 8 rows' 28: drafts looked free
    busy[0] = speculate.MAX_ROUNDS  # through the first measurement only: the second is steady, and remembered
    _, measuring = build.speculation(Runner(), "auto", list(range(20)), "model-busy-at-first")
    assert run(measuring).pays() and build.speculation(Runner(), "auto", [], "model-busy-at-first")[0].pays()

    costs, measuring = build.speculation(Runner(), "auto", list(range(20)), "model-a")
    assert costs is None and measuring is not None
    rounds = 0
    with pytest.raises(StopIteration) as done:
        while True:
            next(measuring)
            rounds += 1
    measured = done.value.value
    assert rounds == 5 and measured is not None and measured.pays()  # 5 rounds of 0.0122 units: under the budget
    assert measured.relative[:3] == (1.0, 1.048, 1.095)
    assert build.speculation(Runner(), "auto", [], "model-a") == (measured, None)  # recalled
    costs, measuring = build.speculation(Runner(), "lookup", list(range(20)), "model-b")
    assert measuring is None and costs is not None and costs.relative[0] == 1.0
    assert build.speculation(Runner(), "none", [], "model-c") == (None, None)


def test_the_engine_measures_between_requests_and_then_drafts(tiny_model, tokenizer):
    """The engine runs a measurement a piece at a time while nothing is queued: a request that comes meanwhile
    is served before the next piece, and the measurement's result turns drafts on."""
    costs, order, submitted = Costs((1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07)), [], threading.Event()

    def measuring():
        assert submitted.wait(30)  # a request comes while this piece runs
        order.append("first piece")
        yield
        order.append("second piece")
        return costs

    runner = HFRunner(tiny_model)
    engine = Engine(runner, tokenizer, prompt.stop_token_ids(tokenizer), SlotPool(runner, 2, 1 << 30), measuring=measuring())
    try:
        assert engine.speculation is None
        finished = threading.Event()

        def on_event(event):
            if event.is_last:
                order.append("request")
                finished.set()

        engine.submit(GenerationRequest([1, 2, 3], max_tokens=2, sampling=SamplingParams(temperature=0.0)), on_event)
        submitted.set()
        assert finished.wait(60)
        deadline = time.monotonic() + 30
        while engine.speculation is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["first piece", "request", "second piece"] and engine.speculation is costs
    finally:
        engine.close()
