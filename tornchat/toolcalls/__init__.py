"""Tool calls in the model's own format, read from its chat template.

One module per format, each a ``Syntax`` (the texts that frame a call, and
how a block of generated text reads back as calls) from which its grammar
and parser are built, and a ``detect`` that recognizes the format in what a
template writes for a call. ``react`` is the fallback for templates that
write none.

Detection works as llama.cpp's template-driven chat parser does: render the
template for a conversation with and without an assistant message holding a
probe call, and look at what the template added for it. To add a format,
write its module and list it in FORMATS.
"""
import dataclasses
import functools

from jinja2 import TemplateError

from tornchat import prompt
from tornchat.engine.textstream import special_tokens
from tornchat.toolcalls import hermes, llama3, mistral, qwen3_coder
from tornchat.toolcalls.common import Syntax

# Tried in order, the first match wins: Qwen3-Coder's calls are <tool_call> blocks too, of XML rather than JSON.
FORMATS = (qwen3_coder, hermes, mistral, llama3)

PROBE_TOOLS = [{
    "type": "function",
    "function": {
        "name": "probe_function",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"probe_argument": {"type": "string"}}, "required": ["probe_argument"]},
    },
}]
PROBE_ASK = {"role": "user", "content": "Probe."}
PROBE_CALL = {
    "role": "assistant",
    "content": "",
    # Nine letters and digits: Mistral's templates reject any other id.
    "tool_calls": [{"id": "probe0001", "type": "function",
                    "function": {"name": "probe_function", "arguments": {"probe_argument": "probe_value"}}}],
}


def detect(tokenizer) -> Syntax | None:
    """The tool-call format the tokenizer's chat template writes, or None (ReAct) if it writes none we know.

    Its ``special`` names the markers this tokenizer has as special tokens.
    """
    template = getattr(tokenizer, "chat_template", None)
    return _detect(tokenizer, template) if template else None


# The template is part of the key because a tokenizer's template can be swapped (the tests do).
@functools.lru_cache(maxsize=16)
def _detect(tokenizer, template: str) -> Syntax | None:
    written = written_call(tokenizer)
    syntax = next((syntax for module in FORMATS if (syntax := module.detect(written))), None)
    if syntax is None:
        return None
    special = special_tokens(tokenizer)
    found = tuple((marker, special[marker]) for marker in syntax.markers() if marker in special)
    return dataclasses.replace(syntax, special=found) if found else syntax


def written_call(tokenizer) -> str:
    """What the template adds to the prompt for an assistant message holding the probe call ("" if it cannot)."""
    try:
        asked = prompt.render(tokenizer, [PROBE_ASK], PROBE_TOOLS)
        answered = prompt.render(tokenizer, [PROBE_ASK, PROBE_CALL], PROBE_TOOLS, generation_prompt=False)
    except (TemplateError, TypeError, ValueError, KeyError):  # the template has no place for calls
        return ""
    common = 0
    while common < min(len(asked), len(answered)) and asked[common] == answered[common]:
        common += 1
    return answered[common:]
