"""Tool calls in each model family's own format, against renders of the real chat templates (tests/fixtures)."""
import copy

import pytest

from fixtures import chat_templates
from test_functions import run, summary
from test_grammar import WEATHER  # city: a string of at most 12 characters; days: 1 to 7
from tornchat import functions, toolcalls
from tornchat.engine.grammar import Compiler, GrammarError
from tornchat.engine.textstream import Detokenizer
from tornchat.functions import Choice, Format

NOTE = {
    "name": "take_note",
    "description": "Write a note down",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
}
OFFERED = [WEATHER, NOTE]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days, and note it."}]
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
NOTED = {"name": "take_note", "arguments": '{"text": "Paris: sunny"}'}

# template fixture -> the format detected in it
TEMPLATES = {
    "LLAMA_3_1": "llama3",
    "MISTRAL_V03": "mistral",
    "MISTRAL_SMALL_3_2": "mistral-args",
    "QWEN_2_5": "hermes",
    "QWEN_3": "hermes",
    "QWEN_3_CODER": "qwen3-coder",
}

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
HERMES_NOTE = '<tool_call>\n{"name": "take_note", "arguments": {"text": "Paris: sunny"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
MISTRAL_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
MISTRAL_NOTE = '{"name": "take_note", "arguments": {"text": "Paris: sunny"}}'
CODER_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
CODER_NOTE = "<tool_call>\n<function=take_note>\n<parameter=text>\nParis: sunny\n</parameter>\n</function>\n</tool_call>"

# (template, what the model writes after the generation prompt, what the client gets)
REPLIES = [
    ("QWEN_2_5", HERMES_CALL, {"content": "", "calls": [PARIS]}),
    ("QWEN_2_5", f"{HERMES_CALL}\n{HERMES_NOTE}", {"content": "", "calls": [PARIS, NOTED]}),
    ("QWEN_2_5", f"Let me check.\n{HERMES_CALL}", {"content": "Let me check.", "calls": [PARIS]}),
    ("QWEN_2_5", "It is sunny in Paris.", {"content": "It is sunny in Paris.", "calls": []}),
    ("QWEN_3", f"<think>\nTwo calls.\n</think>\n\n{HERMES_CALL}\n{HERMES_NOTE}", {"content": "<think>\nTwo calls.\n</think>", "calls": [PARIS, NOTED]}),
    ("LLAMA_3_1", LLAMA_CALL, {"content": "", "calls": [PARIS]}),
    ("LLAMA_3_1", f"<|python_tag|>{LLAMA_CALL}", {"content": "", "calls": [PARIS]}),
    ("LLAMA_3_1", f"Let me look that up.<|python_tag|>{LLAMA_CALL}", {"content": "Let me look that up.", "calls": [PARIS]}),
    ("LLAMA_3_1", "It is {sunny} in Paris.", {"content": "It is {sunny} in Paris.", "calls": []}),
    ("LLAMA_3_1", '{"name": "unknown", "parameters": {}}', {"content": '{"name": "unknown", "parameters": {}}', "calls": []}),
    ("MISTRAL_V03", f"[TOOL_CALLS] [{MISTRAL_CALL}]", {"content": "", "calls": [PARIS]}),
    ("MISTRAL_V03", f"[TOOL_CALLS] [{MISTRAL_CALL}, {MISTRAL_NOTE}]", {"content": "", "calls": [PARIS, NOTED]}),
    ("MISTRAL_V03", f"Checking. [TOOL_CALLS] [{MISTRAL_CALL}]", {"content": "Checking.", "calls": [PARIS]}),
    ("MISTRAL_V03", "[TOOL_CALLS] oops", {"content": "[TOOL_CALLS] oops", "calls": []}),
    ("MISTRAL_SMALL_3_2", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', {"content": "", "calls": [PARIS]}),
    (
        "MISTRAL_SMALL_3_2",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]take_note[ARGS]{"text": "Paris: sunny"}',
        {"content": "", "calls": [PARIS, NOTED]},
    ),
    ("MISTRAL_SMALL_3_2", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', {"content": "Checking.", "calls": [PARIS]}),
    ("QWEN_3_CODER", CODER_CALL, {"content": "", "calls": [PARIS]}),
    ("QWEN_3_CODER", f"{CODER_CALL}\n{CODER_NOTE}", {"content": "", "calls": [PARIS, NOTED]}),
    ("QWEN_3_CODER", f"I will check the weather first.\n\n{CODER_CALL}", {"content": "I will check the weather first.", "calls": [PARIS]}),
    (  # a string value spans lines as written; a value the schema says is an integer is read as JSON
        "QWEN_3_CODER",
        "<tool_call>\n<function=take_note>\n<parameter=text>\nline one\nline two\n</parameter>\n</function>\n</tool_call>",
        {"content": "", "calls": [{"name": "take_note", "arguments": '{"text": "line one\\nline two"}'}]},
    ),
]


@pytest.fixture(scope="module")
def templated(tokenizer):
    """A tokenizer per template fixture: the test vocabulary behind that model's chat template."""
    return with_templates(tokenizer, TEMPLATES)


def with_templates(tokenizer, names) -> dict:
    tokenizers = {}
    for name in names:
        tok = copy.copy(tokenizer)
        tok.chat_template = getattr(chat_templates, name)
        tokenizers[name] = tok
    return tokenizers


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return Compiler(tokenizer)


@pytest.mark.parametrize("name, expected", TEMPLATES.items())
def test_detection_picks_the_templates_format(templated, name, expected):
    assert toolcalls.detect(templated[name]).name == expected


def test_a_template_without_calls_gets_react(tokenizer):
    assert toolcalls.detect(tokenizer) is None  # SmolLM2's ChatML template writes no calls
    assert functions.plan(tokenizer, ASK, OFFERED).stops == ("Observation:",)


def test_probe_call_as_each_template_writes_it(templated):
    assert toolcalls.written_call(templated["LLAMA_3_1"]).startswith('{"name": "probe_function", "parameters": {"probe_argument": ')
    assert toolcalls.written_call(templated["MISTRAL_V03"]).startswith('[TOOL_CALLS] [{"name": "probe_function", "arguments": ')
    assert toolcalls.written_call(templated["QWEN_3_CODER"]).startswith("<tool_call>\n<function=probe_function>\n<parameter=")


@pytest.mark.parametrize("name, text, expected", REPLIES)
def test_parser_reads_the_models_calls(templated, name, text, expected):
    parser = lambda: functions.plan(templated[name], ASK, OFFERED).parser  # noqa: E731
    assert summary(run(parser(), [text])) == expected
    assert summary(run(parser(), list(text))) == expected, "one character at a time"
    for cut in range(1, len(text)):
        assert summary(run(parser(), [text[:cut], text[cut:]])) == expected, f"split at {cut}"


@pytest.mark.parametrize("choice", [Choice("named", "get_weather"), Choice("required")])
@pytest.mark.parametrize("name", TEMPLATES)
def test_forced_calls_read_back_through_the_plan(templated, name, choice):
    """The prompt writes the start of a forced call; what the model writes after it reads as that call."""
    opening = toolcalls.detect(templated[name]).opening(choice)
    plan = functions.plan(templated[name], ASK, OFFERED, choice)
    written = _call_text(name)
    assert plan.prompt.endswith(opening) and written.startswith(opening)
    assert summary(run(plan.parser, [written[len(opening) :]])) == {"content": "", "calls": [PARIS]}


def _call_text(name: str) -> str:
    """The get_weather call as the model of this template writes it, from the start of the reply."""
    return {
        "LLAMA_3_1": LLAMA_CALL,
        "MISTRAL_V03": f"[TOOL_CALLS] [{MISTRAL_CALL}]",
        "MISTRAL_SMALL_3_2": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        "QWEN_2_5": HERMES_CALL,
        "QWEN_3": HERMES_CALL,
        "QWEN_3_CODER": CODER_CALL,
    }[name]


HISTORY = ASK + [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_7"},
    {"role": "assistant", "content": "Sunny all week."},
    {"role": "user", "content": "Note it."},
]

# template -> what its render of HISTORY holds for the call and for its result
RENDERED_HISTORY = {
    "LLAMA_3_1": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}<|eot_id|>', '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>'),
    "MISTRAL_V03": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "{id}"}]', '[TOOL_RESULTS] {"content": sunny, "call_id": "{id}"}[/TOOL_RESULTS]'),
    "MISTRAL_SMALL_3_2": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "[TOOL_RESULTS]sunny[/TOOL_RESULTS]"),
    "QWEN_2_5": (f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>", "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>"),
    "QWEN_3": (f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>", "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>"),
    "QWEN_3_CODER": (f"<|im_start|>assistant\n{CODER_CALL}<|im_end|>", "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<|im_end|>"),
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_history_with_calls_and_results_renders_through_the_template(templated, name):
    plan = functions.plan(templated[name], HISTORY, OFFERED)
    call_id = toolcalls.detect(templated[name]).call_id("call_7")
    call, result = (text.replace("{id}", call_id) for text in RENDERED_HISTORY[name])
    assert call in plan.prompt and result in plan.prompt
    assert plan.prompt.index(call) < plan.prompt.index(result) < plan.prompt.index("Note it.")
    assert "Action:" not in plan.prompt and plan.stops == ()


def test_mistral_ids_keep_calls_and_results_paired(templated):
    """Mistral's templates take nine-character ids; a legacy function message answers the call before it."""
    legacy = ASK + [
        {"role": "assistant", "content": "", "function_call": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
        {"role": "function", "content": "sunny", "name": "get_weather"},
    ]
    prompt = functions.plan(templated["MISTRAL_V03"], legacy, OFFERED).prompt
    call_id = prompt.split('"id": "', 1)[1][:9]
    assert call_id.isalnum() and f'"call_id": "{call_id}"' in prompt


def accepts(compiler, tokenizer, lark: str, text: str) -> bool:
    """Whether the grammar takes text whole: every token allowed, and complete at its end."""
    grammar = compiler.compile(lark)
    try:
        for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
            grammar.consume(token)
    except GrammarError:
        return False
    return grammar.matcher.is_accepting()


# template -> (a well-formed reply with text and calls, a call to a function not offered, arguments against the schema)
GRAMMAR_CASES = {
    "QWEN_2_5": (
        f"Let me check.<tool_call>\n{HERMES_CALL[12:]}\n{HERMES_NOTE}",
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n</tool_call>',
    ),
    "LLAMA_3_1": (
        f"Let me look that up.<|python_tag|>{LLAMA_CALL}",
        '{"name": "search", "parameters": {}}',
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": "three"}}',
    ),
    "MISTRAL_V03": (
        f"[TOOL_CALLS] [{MISTRAL_CALL}, {MISTRAL_NOTE}]",
        '[TOOL_CALLS] [{"name": "search", "arguments": {}}]',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ),
    "MISTRAL_SMALL_3_2": (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]take_note[ARGS]{"text": "x"}',
        '[TOOL_CALLS]search[ARGS]{}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3, "extra": 1}',
    ),
    "QWEN_3_CODER": (
        f"I will check.\n{CODER_CALL}\n{CODER_NOTE}",
        "<tool_call>\n<function=search>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
    ),
}
GRAMMAR_CASES["QWEN_3"] = GRAMMAR_CASES["QWEN_2_5"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_auto_grammar_takes_text_and_calls_and_refuses_bad_calls(templated, compiler, tokenizer, name):
    good, unoffered, wrong = GRAMMAR_CASES[name]
    lark = functions.plan(templated[name], ASK, OFFERED).grammar
    assert accepts(compiler, tokenizer, lark, good)
    assert accepts(compiler, tokenizer, lark, "It is sunny.")
    assert not accepts(compiler, tokenizer, lark, unoffered)
    assert not accepts(compiler, tokenizer, lark, wrong)


@pytest.mark.parametrize("name", TEMPLATES)
def test_forced_grammars_hold_the_call_to_its_schema(templated, compiler, tokenizer, name):
    syntax = toolcalls.detect(templated[name])
    written, (_, unoffered, wrong) = _call_text(name), GRAMMAR_CASES[name]
    required = functions.plan(templated[name], ASK, OFFERED, Choice("required")).grammar
    after = len(syntax.opening(Choice("required")))
    assert accepts(compiler, tokenizer, required, written[after:])
    assert not accepts(compiler, tokenizer, required, unoffered[after:])
    assert not accepts(compiler, tokenizer, required, wrong[after:])
    named = functions.plan(templated[name], ASK, OFFERED, Choice("named", "get_weather")).grammar
    after = len(syntax.opening(Choice("named", "get_weather")))
    assert accepts(compiler, tokenizer, named, written[after:])
    assert not accepts(compiler, tokenizer, named, wrong[after:])


def test_llama_json_answer_and_calls_share_the_brace(templated, compiler, tokenizer):
    """With a JSON response_format the answer opens with "{": a Llama call must then open with its tag."""
    lark = functions.plan(templated["LLAMA_3_1"], ASK, OFFERED, fmt=Format("json_object")).grammar
    assert accepts(compiler, tokenizer, lark, '{"answer": "sunny"}')
    assert accepts(compiler, tokenizer, lark, f"<|python_tag|>{LLAMA_CALL}")


def test_qwen3_coder_function_without_a_schema_takes_any_parameters(templated, compiler, tokenizer):
    ping = {"name": "ping"}
    plan = functions.plan(templated["QWEN_3_CODER"], ASK, [ping])
    reply = "<tool_call>\n<function=ping>\n<parameter=host>\nexample.com\n</parameter>\n</function>\n</tool_call>"
    assert accepts(compiler, tokenizer, plan.grammar, reply)
    assert summary(run(plan.parser, [reply]))["calls"] == [{"name": "ping", "arguments": '{"host": "example.com"}'}]


def test_mistral_array_may_hold_the_other_layouts_marker_in_a_string(templated):
    reply = '[TOOL_CALLS] [{"name": "take_note", "arguments": {"text": "[ARGS]"}}]'
    parser = functions.plan(templated["MISTRAL_V03"], ASK, OFFERED).parser
    assert summary(run(parser, [reply]))["calls"] == [{"name": "take_note", "arguments": '{"text": "[ARGS]"}'}]


# ---- markers that are special tokens in the model's tokenizer ----------------------

# template -> a reply whose markers are special tokens in that model's tokenizer, what it reads as, the markers
SPECIAL_REPLIES = {
    "LLAMA_3_1": (f"Let me look that up.<|python_tag|>{LLAMA_CALL}", {"content": "Let me look that up.", "calls": [PARIS]}, ("<|python_tag|>",)),
    "MISTRAL_V03": (f"[TOOL_CALLS] [{MISTRAL_CALL}, {MISTRAL_NOTE}]", {"content": "", "calls": [PARIS, NOTED]}, ("[TOOL_CALLS]",)),
    "MISTRAL_SMALL_3_2": (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]take_note[ARGS]{"text": "Paris: sunny"}',
        {"content": "Checking.", "calls": [PARIS, NOTED]},
        ("[TOOL_CALLS]", "[ARGS]"),
    ),
}


@pytest.fixture(scope="module")
def marker_templated(marker_tokenizer):
    """Llama's and Mistral's templates over a vocabulary that has their markers as special tokens."""
    return with_templates(marker_tokenizer, SPECIAL_REPLIES)


def test_only_special_token_markers_are_kept(templated, marker_templated):
    assert all(functions.plan(tok, ASK, OFFERED).keep == frozenset() for tok in templated.values())
    for name, (_, _, markers) in SPECIAL_REPLIES.items():
        tok = marker_templated[name]
        assert functions.plan(tok, ASK, OFFERED).keep == {tok.convert_tokens_to_ids(m) for m in markers}
        assert functions.plan(tok, ASK, OFFERED, Choice("none")).keep == frozenset(), "no calls: nothing to read"


@pytest.mark.parametrize("name", SPECIAL_REPLIES)
def test_special_token_markers_reach_the_parser(marker_templated, name):
    """Token ids through the text stream and the parser, as the server runs them, streamed or whole."""
    tok = marker_templated[name]
    reply, expected, _ = SPECIAL_REPLIES[name]
    plan = functions.plan(tok, ASK, OFFERED)
    ids = tok(reply, add_special_tokens=False)["input_ids"]
    assert plan.keep <= set(ids), "each marker is one special token"
    detok = Detokenizer(tok, plan.keep)
    streamed = [detok.push(token) for token in ids]
    assert summary(run(plan.parser, streamed)) == expected
    assert summary(run(functions.plan(tok, ASK, OFFERED).parser, ["".join(streamed)])) == expected
    skipping = Detokenizer(tok)  # every special token skipped: the calls are lost
    assert summary(run(functions.plan(tok, ASK, OFFERED).parser, [skipping.push(token) for token in ids]))["calls"] != expected["calls"]


def test_a_special_marker_before_no_call_is_not_shown(marker_templated):
    """Llama's built-in tools follow <|python_tag|> too: not an offered call, so text, without the special token."""
    tok = marker_templated["LLAMA_3_1"]
    plan = functions.plan(tok, ASK, OFFERED)
    detok = Detokenizer(tok, plan.keep)
    streamed = [detok.push(token) for token in tok('<|python_tag|>brave_search.call(query="Paris")', add_special_tokens=False)["input_ids"]]
    assert summary(run(plan.parser, streamed)) == {"content": 'brave_search.call(query="Paris")', "calls": []}


@pytest.mark.parametrize("name", SPECIAL_REPLIES)
def test_grammars_write_special_markers_as_those_tokens(marker_templated, marker_compiler, marker_tokenizer, tokenizer, name):
    tok = marker_templated[name]
    good, unoffered, wrong = GRAMMAR_CASES[name]
    auto = functions.plan(tok, ASK, OFFERED).grammar
    assert all(f"<[{token}]>" in auto for token in functions.plan(tok, ASK, OFFERED).keep)
    assert accepts(marker_compiler, marker_tokenizer, auto, good)
    assert accepts(marker_compiler, marker_tokenizer, auto, "It is sunny.")
    assert not accepts(marker_compiler, marker_tokenizer, auto, unoffered)
    assert not accepts(marker_compiler, marker_tokenizer, auto, wrong)
    syntax = toolcalls.detect(tok)
    for choice in (Choice("required"), Choice("named", "get_weather")):
        lark = functions.plan(tok, ASK, OFFERED, choice).grammar
        written = _call_text(name)[len(syntax.opening(choice)) :]
        assert accepts(marker_compiler, marker_tokenizer, lark, written)
        if "[ARGS]" in written:  # the plain vocabulary spells the marker in text tokens, which the model would not write
            assert not accepts(marker_compiler, tokenizer, lark, written)


def test_llama_json_answer_or_special_tag_call(marker_templated, marker_compiler, marker_tokenizer):
    lark = functions.plan(marker_templated["LLAMA_3_1"], ASK, OFFERED, fmt=Format("json_object")).grammar
    assert accepts(marker_compiler, marker_tokenizer, lark, '{"answer": "sunny"}')
    assert accepts(marker_compiler, marker_tokenizer, lark, f"<|python_tag|>{LLAMA_CALL}")
