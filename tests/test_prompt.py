"""Chat templates rendered by ``prompt.render`` against transformers' ``apply_chat_template``: the same text for
the public models' templates and the conversations the server hands them (tools, calls, results, reasoning,
null contents, template variables), the same refusals, and the sandbox's limits."""
import copy

import jinja2
import pytest
from transformers import AutoTokenizer

from tornchat import checkpoint, prompt
from tornchat.weights import gguf_file

from fixtures import chat_templates

TEMPLATES = ["LLAMA_3_1", "MISTRAL_V03", "MISTRAL_SMALL_3_2", "QWEN_2_5", "QWEN_3", "QWEN_3_CODER", "QWEN_3_THINKING"]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call12345", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hello"}], None, {}),
    "system and turns": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and 3*3? 😀\n"}], None, {}),
    "tools offered": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER], {}),
    "a call and its result": ([{"role": "user", "content": "Weather in Paris?"},
                               {"role": "assistant", "content": None, "tool_calls": [CALL]},
                               {"role": "tool", "tool_call_id": "call12345", "name": "weather", "content": "sunny, 21 C"}],
                              [WEATHER], {}),
    "reasoning kept": ([{"role": "user", "content": "Think."}, {"role": "assistant", "content": "Done.",
                                                                  "reasoning_content": "Let me see."},
                        {"role": "user", "content": "Again?"}], None, {}),
    "thinking off": ([{"role": "user", "content": "Quick one."}], None, {"enable_thinking": False}),
    "a variable of its own": ([{"role": "user", "content": "Hi"}], None, {"custom_note": "x", "bos_token": "<B>"}),
}


@pytest.fixture(scope="module")
def pair():
    """(ours, transformers') tokenizers of the embedded model."""
    path = checkpoint.default_gguf_path()
    return checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(path)), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def theirs_or_error(tokenizer, messages, tools, kwargs, generation_prompt=True):
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)
    except jinja2.TemplateError as exc:
        return f"refused: {exc}"


def ours_or_error(tokenizer, messages, tools, kwargs, generation_prompt=True):
    try:
        return prompt.render(tokenizer, messages, tools, generation_prompt=generation_prompt, template_kwargs=kwargs)
    except jinja2.TemplateError as exc:
        return f"refused: {exc}"


@pytest.mark.parametrize("template", TEMPLATES + [None])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_a_chat_renders_as_transformers_renders_it(pair, template, conversation):
    ours, theirs = (copy.copy(tokenizer) for tokenizer in pair)
    if template is not None:
        ours.chat_template = theirs.chat_template = getattr(chat_templates, template)
    messages, tools, kwargs = CONVERSATIONS[conversation]
    for generation_prompt in (True, False):
        expected = theirs_or_error(theirs, copy.deepcopy(messages), tools, kwargs, generation_prompt)
        assert ours_or_error(ours, messages, tools, kwargs, generation_prompt) == expected


def test_a_tokenizer_without_a_chat_template_gets_chatml():
    class Bare:
        special_tokens_map = {"eos_token": "</s>"}

    assert prompt.render(Bare(), [{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_environment_has_transformers_globals_and_tags(pair):
    """Namespaces, dict(), tojson's arguments, loop controls and training templates' generation blocks, refusals."""
    ours, theirs = (copy.copy(tokenizer) for tokenizer in pair)
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% set ns.n = ns.n + 1 %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
                "{{ ns.n }} {{ dict(a=1, b=[2]) | tojson(indent=1, sort_keys=true) }} {{ dict.fromkeys(['k']) | tojson }}"
                "{{ {'é': '<&>'} | tojson }}{{ bos_token }}{% if messages | length > 3 %}"
                "{{ raise_exception('too many: ' + messages | length | string) }}{% endif %}")
    ours.chat_template = theirs.chat_template = template
    for count in (3, 4):
        messages = [{"role": "user", "content": str(i)} for i in range(count)]
        assert ours_or_error(ours, messages, None, {}) == theirs_or_error(theirs, messages, None, {})
    assert ours_or_error(ours, messages, None, {}) == "refused: too many: 4"


@pytest.mark.parametrize("template", ["{% set ns = namespace(_hidden=1) %}", "{% set ns = namespace() %}{% set ns._x = 1 %}",
                                      "{{ messages.__class__.__mro__ }}", "{% set x = messages.append(1) %}"])
def test_the_sandbox_refuses_what_could_reach_python(pair, template):
    ours = copy.copy(pair[0])
    ours.chat_template = template
    with pytest.raises(jinja2.exceptions.SecurityError):
        prompt.render(ours, [{"role": "user", "content": "hi"}])


def test_messages_are_not_changed_by_rendering(pair):
    messages = copy.deepcopy(CONVERSATIONS["a call and its result"][0] + CONVERSATIONS["reasoning kept"][0][1:2])
    before, ours = copy.deepcopy(messages), copy.copy(pair[0])
    ours.chat_template = chat_templates.QWEN_3
    assert "<think>\nLet me see.\n</think>" in prompt.render(ours, messages)
    assert messages == before
