"""Function calling: prompts (ReAct and native tool templates) and parsing crafted model outputs."""
import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tornchat import functions, prompt, toolcalls
from tornchat.functions import Choice, Piece
from tornchat.toolcalls import hermes
from tornchat.toolcalls.react import ReActParser

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
NAMES = ("get_weather",)
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLED = ASK + [
    {"role": "assistant", "content": "", "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"role": "function", "content": "sunny, 22 C", "name": "get_weather"},
]

# A tools-aware template in the Hermes/Qwen shape, for checkpoints that have one.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def run(parser, chunks: list[str]) -> list[Piece]:
    pieces = [p for chunk in chunks for p in parser.push(chunk)]
    return pieces + parser.finish()


def summary(pieces: list[Piece]) -> dict:
    """What a client ends up with: content, and each call's name and joined arguments."""
    calls: dict[int, dict] = {}
    for p in pieces:
        if p.kind == "name":
            assert p.index not in calls, "a call is announced once"
            calls[p.index] = {"name": p.text, "arguments": ""}
        elif p.kind == "arguments":
            assert p.index in calls, "arguments come after their call's name"
            calls[p.index]["arguments"] += p.text
    content = "".join(p.text for p in pieces if p.kind == "content")
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}


REACT_CASES = [
    # (parser arguments, generated text after the prompt, expected summary)
    (
        ("thought", None, NAMES),
        ' I need the weather.\nAction: get_weather\nAction Input: {"city": "Paris"}\n',
        {"content": "", "calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]},
    ),
    (
        ("thought", None, NAMES),
        " I can answer directly.\nFinal Answer: It is sunny.\n",
        {"content": "It is sunny.", "calls": []},
    ),
    (
        ("thought", None, NAMES),
        " Hello there!\nHow are you?  \n",
        {"content": "Hello there!\nHow are you?", "calls": []},
    ),
    (  # a function nobody offered is not a call; the reply comes back as text
        ("thought", None, NAMES),
        " hmm\nAction: the tool to use\nAction Input: the weather\n",
        {"content": "hmm\nAction: the tool to use\nAction Input: the weather", "calls": []},
    ),
    (  # Action without Action Input: a call with no arguments
        ("thought", None, NAMES),
        " x\nAction: get_weather\nThought: done",
        {"content": "", "calls": [{"name": "get_weather", "arguments": "{}"}]},
    ),
    (  # forced: only the arguments are generated; text after the JSON value is ignored
        ("arguments", "get_weather", ()),
        ' {"city": "Paris", "note": "a}b \\" {"}\nThought: I will wait',
        {"content": "", "calls": [{"name": "get_weather", "arguments": '{"city": "Paris", "note": "a}b \\" {"}'}]},
    ),
    (  # forced, pretty-printed JSON across lines, labels inside it do not count
        ("arguments", "get_weather", ()),
        ' {\nThought: "x",\n  "city": [1, {"a": 2}]\n}\n\nAction: other',
        {"content": "", "calls": [{"name": "get_weather", "arguments": '{\nThought: "x",\n  "city": [1, {"a": 2}]\n}'}]},
    ),
    (  # forced but not JSON: the model's text is still returned, up to the line end
        ("arguments", "get_weather", ()),
        " city = Paris\nObservation",
        {"content": "", "calls": [{"name": "get_weather", "arguments": "city = Paris"}]},
    ),
    (  # forced, cut off before anything: still a call
        ("arguments", "get_weather", ()),
        "",
        {"content": "", "calls": [{"name": "get_weather", "arguments": "{}"}]},
    ),
    (  # forced, cut off mid-JSON: the partial text is the arguments
        ("arguments", "get_weather", ()),
        ' {"city": "Par',
        {"content": "", "calls": [{"name": "get_weather", "arguments": '{"city": "Par'}]},
    ),
    (  # required: the model picks the name
        ("name", None, NAMES),
        ' get_weather\nAction Input: {"city": "Rome"}',
        {"content": "", "calls": [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]},
    ),
    (  # after an observation, no functions offered: Action is just more text
        ("thought", None, ()),
        " I now know the final answer\nFinal Answer: Sunny, 22 C.",
        {"content": "Sunny, 22 C.", "calls": []},
    ),
]


@pytest.mark.parametrize("args, text, expected", REACT_CASES)
def test_react_parser_whole(args, text, expected):
    assert summary(run(ReActParser(*args), [text])) == expected


@pytest.mark.parametrize("args, text, expected", REACT_CASES)
def test_react_parser_one_character_at_a_time(args, text, expected):
    assert summary(run(ReActParser(*args), list(text))) == expected


@settings(max_examples=30, deadline=None)
@given(case=st.sampled_from(REACT_CASES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_react_parser_any_chunking_matches_whole(case, cuts):
    args, text, expected = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert summary(run(ReActParser(*args), chunks)) == expected


def test_react_streams_content_before_the_end():
    pieces = ReActParser("thought", None, NAMES).push(" ok\nFinal Answer: The answer is 4")
    assert "".join(p.text for p in pieces) == "The answer is 4"
    pieces = ReActParser("arguments", "get_weather").push(' {"city": ')
    assert pieces[0] == Piece("name", "get_weather")
    assert "".join(p.text for p in pieces[1:]) == '{"city":'  # the trailing space is held back


F_AND_G = [{"name": "f"}, {"name": "g"}]
TAGGED_CASES = [
    (
        Choice(),
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
        {"content": "Sure.", "calls": [{"name": "f", "arguments": '{"a": 1}'}]},
    ),
    (
        Choice(),
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>',
        {"content": "", "calls": [{"name": "f", "arguments": "{}"}, {"name": "g", "arguments": '{"b": 2}'}]},
    ),
    (
        Choice(),
        "plain text with a < sign and <tool> tags",
        {"content": "plain text with a < sign and <tool> tags", "calls": []},
    ),
    (  # a block that is not a call is shown as text
        Choice(),
        "x <tool_call>not json</tool_call>",
        {"content": "x <tool_call>not json</tool_call>", "calls": []},
    ),
    (  # nor is a call to a function nobody offered
        Choice(),
        'x <tool_call>{"name": "h", "arguments": {}}</tool_call>',
        {"content": 'x <tool_call>{"name": "h", "arguments": {}}</tool_call>', "calls": []},
    ),
    (  # forced: the prompt opened the block and named the function
        Choice("named", "f"),
        '{"a": [1, 2]}}\n</tool_call>',
        {"content": "", "calls": [{"name": "f", "arguments": '{"a": [1, 2]}'}]},
    ),
    (  # forced, unclosed and invalid: the model's text is kept as arguments
        Choice("named", "f"),
        '{"a": oops}',
        {"content": "", "calls": [{"name": "f", "arguments": '{"a": oops'}]},
    ),
]


@pytest.mark.parametrize("choice, text, expected", TAGGED_CASES)
def test_tagged_parser(choice, text, expected):
    assert summary(run(hermes.SYNTAX.parser(F_AND_G, choice), [text])) == expected
    assert summary(run(hermes.SYNTAX.parser(F_AND_G, choice), list(text))) == expected


# ---- prompts -----------------------------------------------------------------------


def test_plain_conversation_uses_the_chat_template(tokenizer):
    plan = functions.plan(tokenizer, ASK, [])
    assert plan == functions.Plan(prompt.render(tokenizer, ASK), (), None)


def test_react_prompt_offers_the_functions(tokenizer):
    plan = functions.plan(tokenizer, [{"role": "system", "content": "Be brief."}] + ASK, [WEATHER])
    assert "Be brief." in plan.prompt and "get_weather: Current weather in a city Parameters:" in plan.prompt
    assert '"required": ["city"]' in plan.prompt
    assert plan.prompt.endswith("<|im_start|>assistant\nThought:")
    assert plan.stops == ("Observation:",)
    assert plan.prompt.count("<|im_start|>system") == 1


def test_forced_call_prompt_ends_with_the_action_line(tokenizer):
    plan = functions.plan(tokenizer, ASK, [WEATHER], Choice("named", "get_weather"))
    assert plan.prompt.endswith("<|im_start|>assistant\nAction: get_weather\nAction Input:")
    assert summary(run(plan.parser, [' {"city": "Paris"}']))["calls"] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    required = functions.plan(tokenizer, ASK, [WEATHER], Choice("required"))
    assert required.prompt.endswith("<|im_start|>assistant\nAction:")


def test_choice_none_offers_nothing(tokenizer):
    plan = functions.plan(tokenizer, ASK, [WEATHER], Choice("none"))
    assert "get_weather" not in plan.prompt and plan.parser is None


def test_function_result_renders_as_the_observation(tokenizer):
    plan = functions.plan(tokenizer, CALLED, [WEATHER])
    assert plan.prompt.endswith(
        '<|im_start|>assistant\nAction: get_weather\nAction Input: {"city": "Paris"}\nObservation: sunny, 22 C\nThought:'
    )
    assert "<|im_start|>function" not in plan.prompt
    answer = summary(run(plan.parser, [" I now know the final answer\nFinal Answer: Sunny."]))
    assert answer == {"content": "Sunny.", "calls": []}


def test_tool_messages_render_like_function_messages(tokenizer):
    tool_turns = ASK + [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It rains."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    plan = functions.plan(tokenizer, tool_turns, [WEATHER])
    assert (
        "<|im_start|>assistant\nThought: Checking.\nAction: get_weather\nAction Input: {}\nObservation: rain\n"
        "Thought: I now know the final answer\nFinal Answer: It rains.<|im_end|>\n<|im_start|>user\nAnd tomorrow?"
    ) in plan.prompt


def test_history_with_calls_but_no_functions_still_renders(tokenizer):
    plan = functions.plan(tokenizer, CALLED, [])
    assert "Observation: sunny, 22 C" in plan.prompt and "Answer the user" not in plan.prompt
    assert summary(run(plan.parser, [" x\nAction: get_weather\nAction Input: {}"]))["calls"] == []


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def test_native_template_gets_the_tools(tools_tokenizer):
    assert toolcalls.detect(tools_tokenizer) is hermes.SYNTAX
    plan = functions.plan(tools_tokenizer, CALLED, [WEATHER])
    tools = json.loads(plan.prompt.split("Tools: ", 1)[1].split("<|im_end|>", 1)[0])
    assert tools == [{"type": "function", "function": WEATHER}]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in plan.prompt
    assert "<|im_start|>tool\nsunny, 22 C" in plan.prompt
    assert "Action:" not in plan.prompt and plan.stops == ()


def test_native_forced_call_opens_the_block(tools_tokenizer):
    plan = functions.plan(tools_tokenizer, ASK, [WEATHER], Choice("named", "get_weather"))
    assert plan.prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
    assert summary(run(plan.parser, ['{"city": "Oslo"}}</tool_call>']))["calls"] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    ]
