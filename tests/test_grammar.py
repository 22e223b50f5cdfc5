"""Grammar-constrained decoding: the llguidance mask, and the decode loop held to it.

The generation tests run a random-weight model at temperature 1: left to
itself it writes noise, so every reply that parses and validates does so
because of the grammar.
"""
import copy
import json

import jsonschema
import llguidance.hf
import pytest
import torch
from llguidance import LLMatcher
from transformers import AutoTokenizer

from tornchat import checkpoint, functions, prompt
from tornchat.engine import GenerationRequest, SamplingParams
from tornchat.engine import grammar as grammar_module
from tornchat.engine.grammar import (ANY_TEXT, Compiler, Grammar, GrammarError, json_value, literal, schema_error,
                                     token_pieces, vocabulary)
from tornchat.functions import Choice, Format
from tornchat.weights import gguf_file

import gguf_files
from fixtures import chat_templates
from test_functions import TOOLS_TEMPLATE, run, summary
from test_gguf_tokenizer import LLAMA3

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
ALARM = {
    "name": "set_alarm",
    "parameters": {
        "type": "object",
        "properties": {"weekdays": {"type": "boolean"}, "tone": {"enum": ["beep", "chime"]}},
        "required": ["weekdays", "tone"],
        "additionalProperties": False,
    },
}
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, ALARM)}
FORECAST = {
    "type": "object",
    "properties": {"temps": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, "sunny": {"type": "boolean"}},
    "required": ["temps", "sunny"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return Compiler(tokenizer)


def test_the_vocabulary_is_built_at_the_first_grammar_and_once(tokenizer, monkeypatch):
    built = []
    monkeypatch.setattr(grammar_module, "vocabulary", lambda t: built.append(t) or vocabulary(t))
    lazy = Compiler(tokenizer)
    assert built == []  # a server whose requests ask for no grammar never holds it
    lazy.compile('start: "yes" | "no"')
    lazy.compile(f"start: {json_value(WEATHER['parameters'])}")
    assert built == [tokenizer]


@pytest.mark.parametrize("kind", ["embedded", "llama3", "sentencepiece"])
def test_llguidance_reads_the_vocabulary_as_from_the_tokenizers_json(kind, tmp_path):
    """Built from the tokens' pieces (byte-level vocabularies), llguidance's view of the vocabulary is the one it
    builds from transformers' tokenizer of the file: each token's bytes, which are special, the end token, how a text is
    tokenized. A SentencePiece vocabulary, whose encoding puts a space before a text, is left to the JSON."""
    path = {"embedded": checkpoint.default_gguf_path,
            "llama3": lambda: gguf_files.write_tokenizer(tmp_path / "llama3.gguf", **LLAMA3),
            "sentencepiece": lambda: gguf_files.write_tokenizer(tmp_path / "sp.gguf", **gguf_files.sentencepiece_vocabulary())}[kind]()
    tokenizer = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(path))
    assert (token_pieces(tokenizer) is None) == (kind == "sentencepiece")
    ours = vocabulary(tokenizer)
    theirs = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    assert ours.vocab_size == theirs.vocab_size == len(tokenizer) and ours.eos_tokens == theirs.eos_tokens
    every = range(len(tokenizer))
    assert [ours.decode_bytes([i]) for i in every] == [theirs.decode_bytes([i]) for i in every]
    assert [i for i in every if ours.is_special_token(i)] == [i for i in every if theirs.is_special_token(i)]
    for text in ["Hello world, 42 ü 😀\n\n  x", " a <think> b", "\x00\xff{\"k\": [1, 2]}", tokenizer.eos_token + "x"]:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text), text
    for lark in ["start: " + ANY_TEXT, "start: " + json_value(FORECAST)]:  # any text: special tokens' spellings too
        masks = [allowed(Grammar(LLMatcher(llg, LLMatcher.grammar_from_lark(lark), log_level=0), len(tokenizer)),
                         len(tokenizer)) for llg in (ours, theirs)]
        assert torch.equal(*masks) and 0 < int(masks[0].sum()) < len(tokenizer)


def test_a_byte_level_vocabulary_that_puts_a_space_before_a_text_is_left_to_the_json():
    from tokenizers import pre_tokenizers

    tokenizer = copy.deepcopy(checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(checkpoint.default_gguf_path())))
    assert token_pieces(tokenizer) is not None
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert token_pieces(tokenizer) is None


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def allowed(grammar, vocab: int) -> torch.Tensor:
    grammar.fill_mask()
    return grammar.apply(torch.zeros(vocab)).isfinite()


# ---- the mask ---------------------------------------------------------------------


def test_mask_follows_the_schema_token_by_token(compiler, tokenizer):
    grammar = compiler.compile(f"start: {json_value(WEATHER['parameters'])}")
    text = '{"city": "Paris", "days": 3}'
    tokens = ids(tokenizer, text)
    for i, token in enumerate(tokens):
        mask = allowed(grammar, len(tokenizer))
        assert mask[token], f"{tokenizer.decode(tokens[: i + 1])!r} is on the grammar's path"
        assert 0 < int(mask.sum()) < len(tokenizer)
        assert grammar.consume(token) == (i == len(tokens) - 1), "complete exactly at the closing brace"


def test_mask_caps_whitespace_and_bounds(compiler, tokenizer):
    grammar = compiler.compile(f"start: {json_value(WEATHER['parameters'])}")
    for token in ids(tokenizer, '{"city": "Paris", "days":'):
        grammar.consume(token)
    mask = allowed(grammar, len(tokenizer))
    assert mask[tokenizer.convert_tokens_to_ids("Ġ")], "one space after the colon"
    newline = ids(tokenizer, "\n")[0]
    assert not mask[newline], "no newlines inside the JSON"
    grammar.consume(tokenizer.convert_tokens_to_ids("Ġ"))
    mask = allowed(grammar, len(tokenizer))
    assert mask[ids(tokenizer, "3")[0]] and not mask[ids(tokenizer, "9")[0]], "days is 1..7"


def test_apply_masks_rows_past_the_vocabulary(compiler, tokenizer):
    grammar = compiler.compile('start: "yes" | "no"')
    grammar.fill_mask()
    logits = grammar.apply(torch.zeros(len(tokenizer) + 64))
    assert logits[len(tokenizer) :].eq(float("-inf")).all()
    assert {tokenizer.decode([t]) for t in logits.isfinite().nonzero()[:, 0].tolist()} >= {"yes", "no"}


def test_a_token_outside_the_grammar_raises(compiler, tokenizer):
    grammar = compiler.compile('start: "yes"')
    with pytest.raises(GrammarError):
        grammar.consume(ids(tokenizer, "no")[0])


@pytest.mark.parametrize(
    "schema, error",
    [
        ({"type": "object"}, None),
        ({"type": "foo"}, "Invalid type"),
        ({"properties": {"a": {"$ref": "#/defs/x"}}}, "does not exist"),
        ({"properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}, "look-around"),
    ],
)
def test_schema_error_names_the_problem(schema, error):
    message = schema_error(schema)
    assert (message is None) if error is None else (error in message)


def test_a_bad_grammar_raises(compiler):
    with pytest.raises(GrammarError):
        compiler.compile("start: %json " + json.dumps({"type": 3}))


def test_literal_is_exact(compiler, tokenizer):
    grammar = compiler.compile("start: " + literal('say "hi"\n'))
    for token in ids(tokenizer, 'say "hi"\n')[:-1]:
        assert not grammar.consume(token)
    assert grammar.consume(ids(tokenizer, 'say "hi"\n')[-1])


# ---- the decode loop under a grammar ----------------------------------------------


def generate(engine, compiler, plan, seed, max_tokens=120, logit_bias=()):
    request = GenerationRequest(
        prompt.encode(engine.tokenizer, plan.prompt),
        sampling=SamplingParams(temperature=1.0, seed=seed, options={"logit_bias": logit_bias}),
        max_tokens=max_tokens,
        stop=plan.stops,
        grammar=compiler.compile(plan.grammar) if plan.grammar else None,
        keep_special=plan.keep,
    )
    events = list(engine.generate(request))
    return "".join(e.text for e in events), events[-1]


@pytest.mark.parametrize("seed", range(3))
def test_random_model_writes_valid_json_and_stops(tiny_engine, compiler, seed):
    plan = functions.plan(tiny_engine.tokenizer, ASK, [], fmt=Format("json_schema", FORECAST, "forecast"))
    assert "Answer with one JSON object that matches this JSON schema (forecast)" in plan.prompt
    text, last = generate(tiny_engine, compiler, plan, seed)
    jsonschema.validate(json.loads(text), FORECAST)
    assert last.finish_reason == "stop" and "\n" not in text


def test_format_instructions_join_the_system_message(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}] + ASK
    plan = functions.plan(tokenizer, messages, [], fmt=Format("json_schema", FORECAST, "forecast"))
    assert plan.prompt.count("<|im_start|>system") == 1
    assert "Be brief.\n\nAnswer with one JSON object that matches this JSON schema (forecast):\n" + json.dumps(FORECAST) in plan.prompt
    assert functions.plan(tokenizer, messages, [], fmt=Format("text")) == functions.plan(tokenizer, messages, [])


def test_json_object_is_one_object(tiny_engine, compiler):
    plan = functions.plan(tiny_engine.tokenizer, ASK, [], fmt=Format("json_object"))
    text, last = generate(tiny_engine, compiler, plan, seed=7, max_tokens=200)
    if last.finish_reason == "stop":  # a free object may be long; cut off, it is still a prefix of one
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def assert_calls_valid(plan, text, offered):
    calls = summary(run(plan.parser, [text]))["calls"]
    assert calls, f"no call in {text!r}"
    for call in calls:
        assert call["name"] in offered
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    return calls


@pytest.mark.parametrize("choice", [Choice("named", "set_alarm"), Choice("required")])
@pytest.mark.parametrize("seed", range(2))
def test_forced_react_calls_parse_and_validate(tiny_engine, compiler, choice, seed):
    plan = functions.plan(tiny_engine.tokenizer, ASK, [WEATHER, ALARM], choice)
    text, last = generate(tiny_engine, compiler, plan, seed)
    calls = assert_calls_valid(plan, text, SCHEMAS)
    assert last.finish_reason == "stop"
    if choice.mode == "named":
        assert [c["name"] for c in calls] == ["set_alarm"]


@pytest.fixture(scope="module")
def tools_engine(tiny_model, tokenizer):
    """The tiny model behind a chat template that knows tools (the native <tool_call> style)."""
    from conftest import make_engine

    tools_tokenizer = copy.copy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_TEMPLATE
    engine = make_engine(tiny_model, tools_tokenizer)
    yield engine
    engine.close()


@pytest.mark.parametrize("choice", [Choice("named", "get_weather"), Choice("required")])
@pytest.mark.parametrize("seed", range(2))
def test_forced_native_calls_parse_and_validate(tools_engine, compiler, choice, seed):
    plan = functions.plan(tools_engine.tokenizer, ASK, [WEATHER, ALARM], choice)
    text, last = generate(tools_engine, compiler, plan, seed)
    assert_calls_valid(plan, text, SCHEMAS)
    assert last.finish_reason == "stop" and text.endswith("</tool_call>")


@pytest.fixture(scope="module")
def marker_model(marker_tokenizer):
    from conftest import tiny_llama

    return tiny_llama(len(marker_tokenizer))


def marker_engine(model, marker_tokenizer, template: str):
    """The tiny model behind a template whose tool-call markers are special tokens of its vocabulary."""
    from conftest import make_engine

    tok = copy.copy(marker_tokenizer)
    tok.chat_template = getattr(chat_templates, template)
    return make_engine(model, tok)


@pytest.mark.parametrize("seed", range(2))
def test_auto_call_after_a_special_marker_parses_and_validates(marker_model, marker_tokenizer, marker_compiler, seed):
    """With "auto", a model that writes Llama's <|python_tag|> token (here pushed by a logit bias) makes a call."""
    engine = marker_engine(marker_model, marker_tokenizer, "LLAMA_3_1")
    try:
        plan = functions.plan(engine.tokenizer, ASK, [WEATHER, ALARM])
        tag = marker_tokenizer.convert_tokens_to_ids("<|python_tag|>")
        text, last = generate(engine, marker_compiler, plan, seed, logit_bias=((tag, 100.0),))
    finally:
        engine.close()
    assert text.startswith("<|python_tag|>{") and last.finish_reason == "stop"
    assert len(assert_calls_valid(plan, text, SCHEMAS)) == 1
    assert summary(run(plan.parser, [text]))["content"] == ""


@pytest.mark.parametrize("seed", range(2))
def test_required_call_with_special_markers_parses_and_validates(marker_model, marker_tokenizer, marker_compiler, seed):
    """Mistral Small 3.2's calls are name[ARGS]{...}, [ARGS] a special token the grammar makes the model write."""
    engine = marker_engine(marker_model, marker_tokenizer, "MISTRAL_SMALL_3_2")
    try:
        plan = functions.plan(engine.tokenizer, ASK, [WEATHER, ALARM], Choice("required"))
        text, _ = generate(engine, marker_compiler, plan, seed)
    finally:
        engine.close()
    assert "[ARGS]{" in text
    assert_calls_valid(plan, text, SCHEMAS)


def test_auto_call_is_constrained_once_it_starts(compiler, tokenizer):
    """With "auto" the text is free until ``Action:``; from there only an offered call fits."""
    plan = functions.plan(tokenizer, ASK, [WEATHER, ALARM])
    grammar = compiler.compile(plan.grammar)
    for token in ids(tokenizer, " any words at all\nAction:"):
        assert allowed(grammar, len(tokenizer))[token]
        assert not grammar.consume(token)
    mask = allowed(grammar, len(tokenizer))
    assert mask[ids(tokenizer, " get")[0]] and not mask[ids(tokenizer, " search")[0]]


def test_auto_native_call_is_constrained_once_it_starts(compiler, tokenizer):
    tools_tokenizer = copy.copy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_TEMPLATE
    plan = functions.plan(tools_tokenizer, ASK, [WEATHER, ALARM])
    grammar = compiler.compile(plan.grammar)
    for token in ids(tokenizer, "Let me check.<tool_call>\n"):
        grammar.consume(token)
    texts = [tokenizer.decode([t]) for t in allowed(grammar, len(tokenizer)).nonzero()[:, 0].tolist()]
    assert texts and all(text.startswith("{") for text in texts), "the block holds a call's JSON"
