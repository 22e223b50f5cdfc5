"""Thinking kept apart from the answer: the splitter on real templates' renders, the prompt side, and the
budget through the engine (a tiny random model, whose greedy text is forced where a test needs a tag)."""
import copy
import dataclasses

import pytest
import torch

from fixtures import chat_templates
from tornchat import functions, prompt, reasoning
from tornchat.engine import GenerationRequest, SamplingParams, processors, thinking
from tornchat.engine.thinking import CLOSING, Splitter
from tornchat.engine.types import Thinking

# Seeded sampling: the random model's greedy text is newlines only; the seed keys each token by its index, so a
# reply the budget cuts short shares its first tokens with the uncut one.
SEEDED = SamplingParams(temperature=1.0, seed=3)
SCRIPTED = dataclasses.replace(SEEDED, options={"scripted": 1.0})  # runs scripted()'s processor
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT, ANSWER = "The user asks for a capital.\nFrance's is Paris.", "Paris."


def split(text: str, inside: bool, cuts=()) -> tuple[str, str]:
    splitter, out, start = Splitter(inside), [], 0
    for cut in [*cuts, len(text)]:
        out += splitter.push(text[start:cut])
        start = cut
    out += splitter.finish()
    return "".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content")


@pytest.fixture(scope="module")
def templated(tokenizer):
    tokenizers = {}
    for name in ("QWEN_3", "QWEN_3_THINKING", "QWEN_2_5"):
        tok = copy.copy(tokenizer)
        tok.chat_template = getattr(chat_templates, name)
        tokenizers[name] = tok
    return tokenizers


def written_reply(tok, kwargs=None) -> tuple[str, str]:
    """The generation prompt, and what the template writes for the assistant's thinking turn after it."""
    asked = prompt.render(tok, ASK, template_kwargs=kwargs)
    turn = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    answered = prompt.render(tok, [*ASK, turn], generation_prompt=False, template_kwargs=kwargs)
    assert answered.startswith(asked.rstrip("<think>\n"))
    return asked, answered[len(asked):].removesuffix("<|im_end|>\n")


@pytest.mark.parametrize("name", ["QWEN_3", "QWEN_3_THINKING"])
def test_the_reply_a_template_writes_splits_back_into_thinking_and_answer_at_every_cut(templated, name):
    asked, reply = written_reply(templated[name])
    inside = reasoning.thinking(asked, True, True, None).inside
    assert inside == (name == "QWEN_3_THINKING")
    assert split(reply, inside) == (THOUGHT, ANSWER)
    for cut in range(len(reply) + 1):  # every tag, and the whitespace around it, cut in two
        assert split(reply, inside, [cut]) == (THOUGHT, ANSWER)
    assert split(reply, inside, range(len(reply))) == (THOUGHT, ANSWER)  # a character at a time


def test_replies_that_do_not_think_are_all_answer():
    assert split("Paris <think> is a word.", False) == ("", "Paris <think> is a word.")
    assert split("  <thi", False) == ("", "  <thi")  # cut off while it could still have been the tag
    assert split("<think>\nStill going</thi", False) == ("Still going</thi", "")  # cut off while thinking
    assert split("\n\n<think>\n\n</think>\n\nHi", False) == ("", "Hi")


def test_templates_that_think_and_their_switch(templated):
    assert reasoning.template_thinks(templated["QWEN_3"]) and reasoning.template_thinks(templated["QWEN_3_THINKING"])
    assert not reasoning.template_thinks(templated["QWEN_2_5"])
    tok = templated["QWEN_3"]
    on = prompt.render(tok, ASK, template_kwargs=reasoning.template_kwargs(True, True, {}))
    off = prompt.render(tok, ASK, template_kwargs=reasoning.template_kwargs(True, False, {}))
    assert off == on + "<think>\n\n</think>\n\n"
    assert reasoning.thinking(on, True, True, 7) == Thinking(False, 7)
    assert reasoning.thinking(off, True, False, 7) is None  # the template closed it: all answer
    # A template that opens the thinking whatever it is told: off means closed at once.
    opened = prompt.render(templated["QWEN_3_THINKING"], ASK)
    assert reasoning.thinking(opened, True, False, 7) == Thinking(True, 0)
    assert reasoning.thinking(opened, False, True, 7) is None
    assert reasoning.tighter(None, 5, 3) == 3 and reasoning.tighter(None, None) is None


def test_earlier_thinking_reaches_the_template_only_where_it_places_it(templated):
    tok = templated["QWEN_3"]
    earlier = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    later = [*ASK, earlier, {"role": "user", "content": "And Spain?"}]
    assert THOUGHT not in functions.plan(tok, later, []).prompt  # an earlier turn's thinking is dropped
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    call = {**earlier, "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    loop = [*ASK, call, {"role": "tool", "content": "Sunny", "tool_call_id": "c1"}]
    assert THOUGHT in functions.plan(tok, loop, [weather]).prompt  # the current tool loop keeps it


def test_a_call_written_while_thinking_is_no_call(templated):
    tok = templated["QWEN_3"]
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    plan = functions.plan(tok, ASK, [weather])
    parser = reasoning.Parser(Thinking(False), plan.parser)
    text = ('<think>\nMaybe <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>?\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    pieces = [p for ch in text for p in parser.push(ch)] + parser.finish()
    assert "Rome" in "".join(p.text for p in pieces if p.kind == "reasoning")
    assert [p.text for p in pieces if p.kind == "name"] == ["get_weather"]
    assert "Paris" in "".join(p.text for p in pieces if p.kind == "arguments")


# ---- through the engine -------------------------------------------------------------


def scripted(tokenizer, text: str) -> processors.Processor:
    """A logits processor that makes the reply start with text, token by token; the model goes on from there.
    It runs where a request sets its field "scripted" (SCRIPTED)."""
    script = tokenizer(text, add_special_tokens=False)["input_ids"]

    def force(logits, *, scripted, history):
        step = len(history.output_ids)
        if step >= len(script):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[script[step]] = 0.0
        return forced

    field = processors.Field("scripted", processors.NUMBER, 0.0, "the test's script")
    return processors.Processor("scripted", (field,), processors.BEFORE_MASK, force, needs=("history",))


def tag(tokenizer) -> list[int]:
    """The tokens of CLOSING up to the end of its tag."""
    return tokenizer(CLOSING.rstrip(), add_special_tokens=False)["input_ids"]


def generate(engine, thinking_spec, max_tokens=40, sampling=SEEDED):
    ids = prompt.encode(engine.tokenizer, prompt.render(engine.tokenizer, ASK))
    events = list(engine.generate(GenerationRequest(ids, sampling, max_tokens=max_tokens, thinking=thinking_spec)))
    tokens = [t for e in events for t in e.token_ids]
    return tokens, "".join(e.text for e in events), events[-1]


def test_budget_closes_the_thinking_after_exactly_n_tokens_and_an_answer_follows(tiny_engine, tokenizer):
    free, free_text, _ = generate(tiny_engine, Thinking(inside=True))
    assert "</think>" not in free_text  # the random model never closes it itself
    closing = tokenizer(CLOSING, add_special_tokens=False)["input_ids"]
    for budget in (0, 5):
        tokens, text, last = generate(tiny_engine, Thinking(inside=True, budget=budget))
        assert tokens[:budget] == free[:budget]  # the model's own thinking, up to the budget
        assert tokens[budget:budget + len(closing)] == closing
        assert len(tokens) > budget + len(closing) and last.finish_reason == "length"
        assert last.usage.reasoning_tokens == budget + len(tag(tokenizer))  # the "\n\n" after the tag is the answer's
        thought, answer = split(text, inside=True)
        assert thought == tokenizer.decode(free[:budget], skip_special_tokens=True).strip()
        assert answer and answer == text.split("</think>", 1)[1].lstrip()


def test_budget_counts_from_the_opening_tag_the_model_writes(tiny_engine, tokenizer, monkeypatch):
    opening = "<think>\nHmm"  # "<", "think", ">": the tag itself is cut across three tokens
    monkeypatch.setattr(processors, "PROCESSORS", (*processors.PROCESSORS, scripted(tokenizer, opening)))
    tokens, text, last = generate(tiny_engine, Thinking(inside=False, budget=3), sampling=SCRIPTED)
    opened = len(tokenizer("<think>", add_special_tokens=False)["input_ids"])
    closing = tokenizer(CLOSING, add_special_tokens=False)["input_ids"]
    assert tokens[opened + 3:opened + 3 + len(closing)] == closing
    thought, answer = split(text, inside=False)
    assert thought.startswith("Hmm") and answer
    assert last.usage.reasoning_tokens == opened + 3 + len(tag(tokenizer))


def test_no_budget_and_no_thinking_leave_the_reply_alone(tiny_engine, tokenizer, monkeypatch):
    plain, plain_text, plain_last = generate(tiny_engine, None)
    tokens, text, last = generate(tiny_engine, Thinking(inside=False, budget=0))  # never opens: nothing to close
    assert (tokens, text) == (plain, plain_text) and last.usage.reasoning_tokens == 0 == plain_last.usage.reasoning_tokens
    script = "<think>\nShort.\n</think>\n\nAnswer"
    monkeypatch.setattr(processors, "PROCESSORS", (*processors.PROCESSORS, scripted(tokenizer, script)))
    tokens, text, last = generate(tiny_engine, Thinking(inside=False, budget=50), sampling=SCRIPTED)
    assert text.startswith(script) and split(text, inside=False)[0] == "Short."
    assert last.usage.reasoning_tokens == len(tokenizer("<think>\nShort.\n</think>", add_special_tokens=False)["input_ids"])


def test_thinking_module_is_the_one_splitter():
    assert thinking.Splitter is Splitter and reasoning.Splitter is Splitter
