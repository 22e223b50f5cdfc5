"""Logits processors and log-probabilities against plain PyTorch references, alone and in the decode loop."""
import math
from pathlib import Path

import pytest
import torch

from bench import servers
from tornchat import prompt
from tornchat.engine import GenerationRequest, SamplingParams, logprobs, processors
from tornchat.engine.model import HFRunner
from tornchat.engine.processors import History

VOCAB = 500
PROMPT = [3, 7, 7, 42, 99]
OUTPUT = [7, 11, 11, 11, 42, 250]


def random_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def history(prompt_ids=PROMPT, output_ids=OUTPUT) -> History:
    h = History(list(prompt_ids))
    for token in output_ids:
        h.append(token)
    return h


def run(logits, params: SamplingParams, h: History, tokenizer=None, index: int = 0) -> torch.Tensor:
    """Both stages as the Chooser runs them, without a grammar mask."""
    context = processors.Context(h, tokenizer, params.temperature, params.seed or 0, index)
    logits = processors.run(processors.chosen(params, processors.BEFORE_MASK), logits, context)
    return processors.run(processors.chosen(params, processors.AFTER_MASK), logits, context)


# ---- references: one token at a time, the way the semantics are written down -----------


def reference_repetition(logits, penalty, ids):
    out = logits.clone()
    for token in set(ids):
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    return out


def reference_frequency_presence(logits, frequency, presence, output):
    out = logits.clone()
    for token in set(output):
        out[token] -= output.count(token) * frequency + presence
    return out


def reference_bias(logits, pairs):
    out = logits.clone()
    for token, bias in pairs:
        out[token] += bias
    return out


def reference_min_p(logits, min_p, temperature):
    probs = torch.softmax(logits / temperature, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def reference_typical(logits, mass, temperature):
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    distance = [abs(-math.log(p) - entropy) if p > 0 else math.inf for p in probs]
    held, kept = 0.0, []
    for token in sorted(range(len(probs)), key=lambda t: distance[t]):  # nearest the entropy first
        kept.append(token)
        held += probs[token]
        if held >= mass:
            break
    cutoff = max(distance[t] for t in kept)
    return [distance[t] <= cutoff for t in range(len(probs))]


def reference_top_n_sigma(logits, n):
    finite = [x for x in logits.tolist() if math.isfinite(x)]
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((x - mean) ** 2 for x in finite) / len(finite))
    return [x >= max(finite) - n * std for x in logits.tolist()]


def reference_dry(logits, ids, multiplier, base, allowed, breaking):
    """For each earlier token ids[j]: how many tokens before it equal the text's last ones (no breaker among them)."""
    longest = {}
    for j in range(1, len(ids)):
        n = 0
        while n < 50 and n < j and ids[j - 1 - n] == ids[-1 - n] and ids[-1 - n] not in breaking:
            n += 1
        if n >= allowed and ids[j] not in breaking:
            longest[ids[j]] = max(n, longest.get(ids[j], 0))
    out = logits.clone()
    for token, n in longest.items():
        out[token] -= multiplier * base ** (n - allowed)
    return out


def reference_xtc(logits, threshold, temperature):
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    top = [t for t, p in enumerate(probs) if p >= threshold and p > 0]
    keep = min(top, key=lambda t: (probs[t], t)) if len(top) >= 2 else None
    return [probs[t] > 0 and not (t in top and keep is not None and t != keep) for t in range(len(probs))]


def kept(out: torch.Tensor, logits: torch.Tensor) -> list[bool]:
    """Which tokens a truncation kept, checking that it left their logits as they were."""
    mask = ~torch.isneginf(out)
    assert torch.equal(out[mask], logits[mask])
    return mask.tolist()


# ---- each processor --------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_the_reference_over_prompt_and_output(penalty):
    logits = random_logits()
    before = logits.clone()
    out = processors.repetition_penalty(logits, repetition_penalty=penalty, history=history())
    torch.testing.assert_close(out, reference_repetition(before, penalty, PROMPT + OUTPUT))
    assert torch.equal(logits, before), "the input logits are not written to"


@pytest.mark.parametrize("frequency, presence", [(0.5, 0.0), (0.0, 1.5), (2.0, -2.0), (-1.0, 0.7)])
def test_frequency_and_presence_penalties_match_the_reference_over_the_output(frequency, presence):
    logits = random_logits(1)
    params = SamplingParams(options={"frequency_penalty": frequency, "presence_penalty": presence})
    out = run(logits, params, history())
    torch.testing.assert_close(out, reference_frequency_presence(logits, frequency, presence, OUTPUT))
    assert out[PROMPT[0]] == logits[PROMPT[0]], "prompt tokens are not penalized"


def test_logit_bias_matches_the_reference():
    logits = random_logits(2)
    pairs = ((5, 100.0), (6, -100.0), (400, 3.5))
    out = processors.logit_bias(logits, logit_bias=pairs)
    torch.testing.assert_close(out, reference_bias(logits, pairs))


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.1, 0.5), (0.3, 1.7), (1.0, 1.0)])
def test_min_p_matches_the_reference_on_the_tempered_distribution(min_p, temperature):
    logits = random_logits(3)
    out = processors.min_p(logits, min_p=min_p, temperature=temperature)
    expected = reference_min_p(logits, min_p, temperature)
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    kept = ~torch.isinf(out)
    assert torch.equal(out[kept], logits[kept]) and kept[logits.argmax()]
    assert 0 < int(kept.sum()) < VOCAB or min_p == 1.0


def test_min_p_leaves_greedy_requests_and_nan_logits_alone():
    logits = random_logits(4)
    assert run(logits, SamplingParams(temperature=0.0, options={"min_p": 0.5}), history()) is logits
    assert run(logits, SamplingParams(top_k=1, options={"min_p": 0.5}), history()) is logits
    with_nan = logits.clone()
    with_nan[10] = float("nan")
    out = processors.min_p(with_nan, min_p=0.5, temperature=1.0)
    assert not torch.isinf(out).any(), "a NaN maximum drops nothing; the sampler counts NaN as -inf"


@pytest.mark.parametrize("mass, temperature", [(0.2, 1.0), (0.5, 0.7), (0.9, 1.3), (0.999, 1.0)])
def test_typical_p_matches_the_reference_on_the_tempered_distribution(mass, temperature):
    logits = random_logits(8) / 3  # flatter: the entropy falls among the tokens, not at the top
    logits[:20] = float("-inf")  # masked by a grammar
    out = processors.typical_p(logits, typical_p=mass, temperature=temperature)
    expected = reference_typical(logits, mass, temperature)
    assert kept(out, logits) == expected
    assert 0 < sum(expected) < VOCAB - 20


@pytest.mark.parametrize("n", [0.5, 1.0, 2.5])
def test_top_n_sigma_matches_the_reference_over_the_finite_logits(n):
    logits = random_logits(9)
    logits[:50] = float("-inf")  # masked: left out of the mean and deviation
    out = processors.top_n_sigma(logits, top_n_sigma=n)
    expected = reference_top_n_sigma(logits, n)
    assert kept(out, logits) == expected
    assert 0 < sum(expected) < VOCAB - 50


DRY = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_sequence_breakers": ("\n", ":", '"', "*")}
NEWLINE, COLON = 198, 42  # SmolLM2's "\n" and ":": breakers by default; 300 to 320 are not


def dry(logits, ids, tokenizer, **fields):
    h = history(ids[:3], ids[3:])
    return processors.dry(logits, **{**DRY, **fields}, history=h, tokenizer=tokenizer)


def test_dry_penalizes_the_token_that_would_extend_a_repeat(tokenizer):
    logits = random_logits(10)
    #      [a    b    c    d    e    NL       a    b    c ]: "d" would repeat "a b c d"; c, b, a match back to the start
    ids = [300, 301, 302, 303, 304, NEWLINE, 300, 301, 302]
    out = dry(logits, ids, tokenizer)
    expected = logits.clone()
    expected[303] -= 0.8 * 1.75 ** (3 - 2)
    torch.testing.assert_close(out, expected)
    # A breaker inside the repeat cuts it: "c NL a b" is matched back to the NL only, 2 long: 0.8 x 1.75^0.
    ids = [300, 302, NEWLINE, 300, 301, 305, 302, NEWLINE, 300, 301]
    expected = logits.clone()
    expected[305] -= 0.8
    torch.testing.assert_close(dry(logits, ids, tokenizer), expected)
    assert torch.equal(dry(logits, ids, tokenizer, dry_allowed_length=3), logits), "2 long is allowed"
    assert torch.equal(dry(logits, [300, COLON, 300, COLON, 300], tokenizer), logits), "a breaker is never penalized"


@pytest.mark.parametrize("seed", range(6))
def test_dry_matches_the_reference_on_random_histories(tokenizer, seed):
    gen = torch.Generator().manual_seed(seed)
    alphabet = torch.tensor([300, 301, 302, 303, NEWLINE, COLON])  # few tokens: many repeats, some across breakers
    ids = alphabet[torch.randint(0, 6 - seed % 3, (120,), generator=gen)].tolist() + [302, 300, 301]  # no breaker at the end
    fields = {"dry_multiplier": 0.5 + seed / 4, "dry_base": 1.1 + seed / 10, "dry_allowed_length": 1 + seed % 3}
    if seed == 5:
        fields["dry_sequence_breakers"] = ("ur", "\n")  # 315 "ur" breaks; ":" no longer does
        ids = [315 if t == 303 else t for t in ids]
    breaking = {t for t in (NEWLINE, COLON, 315) if any(b in tokenizer.decode([t]) for b in fields.get("dry_sequence_breakers", DRY["dry_sequence_breakers"]))}
    logits = random_logits(seed)
    out = dry(logits, ids, tokenizer, **fields)
    expected = reference_dry(logits, ids, fields["dry_multiplier"], fields["dry_base"], fields["dry_allowed_length"], breaking)
    torch.testing.assert_close(out, expected)
    assert not torch.equal(out, logits)


def test_dry_is_off_at_multiplier_zero_whatever_else_is_set(tokenizer):
    logits, ids = random_logits(11), [300, 301, 302, 300, 301]
    assert processors.dry(logits, **{**DRY, "dry_multiplier": 0.0}, history=history(ids), tokenizer=tokenizer) is logits
    assert run(logits, SamplingParams(options={"dry_base": 3.0, "dry_allowed_length": 1}), history(ids), tokenizer) is logits


@pytest.mark.parametrize("threshold, temperature", [(0.1, 1.0), (0.15, 0.8), (0.05, 2.0), (0.2, 0.5), (0.0, 1.0), (0.5, 1.0)])
def test_xtc_matches_the_reference_when_it_fires(threshold, temperature):
    logits = random_logits(12)
    logits[[3, 4, 5]] = logits.max() + torch.tensor([0.3, 0.2, 0.1])  # a few top choices close together
    logits[:3] = float("-inf")  # masked
    out = processors.xtc(logits, xtc_probability=1.0, xtc_threshold=threshold, temperature=temperature, seed=1, index=0)
    expected = reference_xtc(logits, threshold, temperature)
    assert kept(out, logits) == expected
    assert sum(expected) < VOCAB - 3 or threshold == 0.5, "some top choices were excluded"


def test_xtc_fires_at_its_probability_keyed_by_seed_and_index():
    logits = random_logits(13)
    logits[[3, 4]] = logits.max() + 1.0  # two top choices: excluded whenever XTC fires

    def fired(seed, index, probability=0.3):
        out = processors.xtc(logits, xtc_probability=probability, xtc_threshold=0.1, temperature=1.0, seed=seed, index=index)
        return out is not logits

    pattern = [fired(7, i) for i in range(2000)]
    assert 0.27 < sum(pattern) / len(pattern) < 0.33
    assert pattern == [fired(7, i) for i in range(2000)], "the same draw for the same seed and index"
    assert pattern != [fired(8, i) for i in range(2000)]
    assert all(fired(7, i, 1.0) for i in range(100)) and not any(fired(7, i, 0.0) for i in range(100))


def test_neutral_parameters_cost_nothing():
    logits, h = random_logits(), history()
    assert run(logits, SamplingParams(), h) is logits
    neutral = {f.name: f.neutral for p in processors.PROCESSORS for f in p.fields}
    assert run(logits, SamplingParams(options=neutral), h) is logits, "fields set to their neutral values"
    assert h._counts is None and h._seen is None, "no tensor over the history was built"


def test_history_tensors_stay_current_after_first_use():
    logits = random_logits()
    params = SamplingParams(options={"frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.2})
    grown = history(output_ids=OUTPUT[:2])
    run(logits, params, grown)  # builds the tensors from the first two ids
    for token in OUTPUT[2:]:
        grown.append(token)
    torch.testing.assert_close(run(logits, params, grown), run(logits, params, history()))


def test_processors_run_in_the_documented_order():
    logits = random_logits(5)
    pairs = ((7, 2.0), (300, -1.0))
    params = SamplingParams(options={"repetition_penalty": 1.5, "frequency_penalty": 0.4, "presence_penalty": 0.3, "logit_bias": pairs})
    expected = reference_repetition(logits, 1.5, PROMPT + OUTPUT)
    expected = reference_frequency_presence(expected, 0.4, 0.3, OUTPUT)
    expected = reference_bias(expected, pairs)
    torch.testing.assert_close(run(logits, params, history()), expected)
    before = [p.name for p in processors.PROCESSORS if p.stage == processors.BEFORE_MASK]
    assert before[:3] == ["repetition_penalty", "frequency_penalty", "presence_penalty"] and before[-1] == "logit_bias"


def test_the_api_doc_lists_every_processor_field_with_its_records_doc():
    rows = {line.split(" | ")[0]: line for line in (Path(__file__).parent.parent / "docs" / "api.md").read_text().splitlines()}
    for processor in processors.PROCESSORS:
        for field in processor.fields:
            row = rows.get(f"| `{field.name}`")
            assert row is not None and row.endswith(f" | {field.doc} |"), f"docs/api.md's row for {field.name}"


# ---- log-probabilities -----------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(6)
    lp = logprobs.distribution(logits)
    torch.testing.assert_close(lp, torch.log_softmax(logits, dim=-1))
    entry = logprobs.for_token(lp, 17, 5)
    assert entry.token_id == 17 and entry.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[17]))
    values, ids = torch.topk(torch.log_softmax(logits, -1), 5)
    assert [t for t, _ in entry.top] == ids.tolist()
    assert [v for _, v in entry.top] == pytest.approx(values.tolist())
    assert logprobs.for_token(lp, 17, 0).top == ()


def test_impossible_tokens_get_the_floor_and_nan_counts_as_minus_infinity():
    logits = random_logits(7)
    logits[3], logits[4] = float("-inf"), float("nan")
    lp = logprobs.distribution(logits)
    for token in (3, 4):
        assert logprobs.for_token(lp, token, 0).logprob == logprobs.FLOOR
    assert math.isfinite(logprobs.for_token(lp, 5, 0).logprob)
    assert math.isclose(float(torch.logsumexp(lp, -1)), 0.0, abs_tol=1e-5)


# ---- in the decode loop (the tiny random model) -------------------------------------------


def ask(tokenizer):
    return prompt.encode(tokenizer, prompt.render(tokenizer, [{"role": "user", "content": "Count to five."}]))


def events(engine, ids, **kwargs):
    return list(engine.generate(GenerationRequest(list(ids), **kwargs)))


def test_events_carry_one_logprob_per_token_only_when_asked(tiny_engine, tokenizer):
    ids = ask(tokenizer)
    greedy = SamplingParams(temperature=0.0)
    plain = events(tiny_engine, ids, sampling=greedy, max_tokens=12)
    assert all(e.logprobs == () for e in plain)
    asked = events(tiny_engine, ids, sampling=greedy, max_tokens=12, logprobs=3)
    assert [e.token_ids for e in asked] == [e.token_ids for e in plain]
    entries = [entry for e in asked for entry in e.logprobs]
    assert [entry.token_id for entry in entries] == [t for e in asked for t in e.token_ids]
    for entry in entries:
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id, "greedy picks the most likely token"
        assert entry.logprob == pytest.approx(entry.top[0][1])


def test_logprobs_are_the_models_before_bias_and_temperature(tiny_model, tiny_engine, tokenizer):
    ids = ask(tokenizer)
    runner = HFRunner(tiny_model)
    raw = torch.log_softmax(runner.forward(ids, runner.new_cache()), dim=-1)
    favourite = int(raw.argmax())
    params = SamplingParams(temperature=0.0, options={"logit_bias": ((favourite, -100.0),)})
    first = next(e for e in events(tiny_engine, ids, sampling=params, max_tokens=1, logprobs=1) if e.logprobs).logprobs[0]
    assert first.token_id != favourite and first.top[0][0] == favourite, "the bias steered the sampler, not the report"
    assert first.logprob == pytest.approx(float(raw[first.token_id]), abs=1e-4)
    hot = SamplingParams(temperature=1.9, top_k=5, seed=3)
    sampled = next(e for e in events(tiny_engine, ids, sampling=hot, max_tokens=1, logprobs=0) if e.logprobs).logprobs[0]
    assert sampled.logprob == pytest.approx(float(raw[sampled.token_id]), abs=1e-4)


def test_logit_bias_and_penalties_steer_the_decode_loop(tiny_engine, tokenizer):
    ids = ask(tokenizer)

    def tokens(**params):
        sampling = SamplingParams(temperature=0.0, options=params)
        return [t for e in events(tiny_engine, ids, sampling=sampling, max_tokens=8) for t in e.token_ids]

    plain = tokens()
    assert len(set(plain)) == 1, "the random model repeats one token (a newline, which the prompt has too)"
    forced = tokenizer.convert_tokens_to_ids("Ġhello")
    assert tokens(logit_bias=((forced, 100.0),)) == [forced] * 8
    penalized = tokens(frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized[0] == plain[0], "frequency and presence count the output only"
    assert len(set(penalized)) == len(penalized)
    assert tokens(repetition_penalty=2.0)[0] != plain[0], "repetition_penalty counts the prompt too"


# ---- through a real server on the tiny model: validation, the OpenAPI document, /metrics ------------

ASK = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0.8, "seed": 5}
# Each processor's fields set away from neutral, as a client would.
SETTINGS = {
    "repetition_penalty": {"repetition_penalty": 1.2},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "dry": {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", "Hi"]},
    "logit_bias": {"logit_bias": {"5": -100}},
    "min_p": {"min_p": 0.05},
    "top_n_sigma": {"top_n_sigma": 1.5},
    "typical_p": {"typical_p": 0.9},
    "xtc": {"xtc_probability": 0.5, "xtc_threshold": 0.05},
}
BAD = [
    ({"typical_p": 0}, "typical_p must be above 0"),
    ({"typical_p": 1.5}, "typical_p must be between 0 and 1"),
    ({"top_n_sigma": -1}, "top_n_sigma must be between 0 and 100"),
    ({"top_n_sigma": "2"}, "top_n_sigma must be a number"),
    ({"xtc_probability": 1.5}, "xtc_probability must be between 0 and 1"),
    ({"xtc_threshold": 0.6}, "xtc_threshold must be between 0 and 0.5"),
    ({"xtc_threshold": None, "xtc_probability": [0.5]}, "xtc_probability must be a number"),
    ({"dry_multiplier": -0.5}, "dry_multiplier must be between 0 and 100"),
    ({"dry_base": 1}, "dry_base must be above 1"),
    ({"dry_allowed_length": 0}, "dry_allowed_length must be at least 1"),
    ({"dry_allowed_length": 1.5}, "dry_allowed_length must be an integer"),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers must be an array of at most 16 strings of 1 to 20 characters"),
    ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers must be an array"),
    ({"dry_sequence_breakers": ["x"] * 17}, "dry_sequence_breakers must be an array"),
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with servers.running("--checkpoint-path", tiny_checkpoint) as running:
        yield running


def post(server, body: dict) -> servers.Reply:
    return servers.request(server.url, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})


@pytest.mark.parametrize("fields, message", BAD, ids=[message for _, message in BAD])
def test_bad_values_are_400_naming_the_field(server, fields, message):
    reply = post(server, {**ASK, **fields})
    assert reply.status == 400 and message in reply.json()["detail"], reply.body


def test_each_processor_runs_is_documented_and_counted(server):
    assert sorted(SETTINGS) == sorted(processor.name for processor in processors.PROCESSORS), "every processor is tried"
    document = servers.request(server.url, "GET", "/openapi.json").json()
    documented = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name, fields in SETTINGS.items():
        reply = post(server, {**ASK, **fields})
        assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.body
        assert all(field in documented for field in fields)
    metrics = servers.request(server.url, "GET", "/metrics").body.decode()
    for name in SETTINGS:
        assert f'tornchat_request_options_total{{option="{name}"}} 1.0' in metrics
