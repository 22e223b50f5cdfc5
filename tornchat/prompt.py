"""Messages in, prompt token ids out, through the tokenizer's chat template.

Templates render here, in a Jinja environment made as transformers makes its own (the same filters,
globals and sandbox, the messages prepared the same way), so a prompt is the text transformers'
``apply_chat_template`` gives (tests/test_prompt.py holds the two equal on real templates) without
importing transformers for it: a GGUF's tokenizer comes without it (``weights.gguf_tokenizer``).
"""
import datetime
import functools
import json

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For checkpoints without a chat template: ChatML, which most small chat
# models were tuned on or at least tolerate.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The names a message's reasoning goes by; templates read the first (most) or the second (gpt-oss).
REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True,
           template_kwargs: dict | None = None) -> str:
    """The prompt text for messages, ending with the assistant's generation prompt unless told otherwise.

    ``template_kwargs`` are variables for the template (a request's
    ``chat_template_kwargs``, ``enable_thinking``); templates ignore those they do not read. The
    tokenizer's special tokens (``bos_token``...) are variables too, as transformers gives them.
    """
    template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
    variables = {**tokenizer.special_tokens_map, **(template_kwargs or {})}
    return compiled(template).render(messages=[template_message(m) for m in messages], tools=tools or None,
                                     documents=None, add_generation_prompt=generation_prompt, **variables)


def template_message(message: dict) -> dict:
    """A message as transformers hands it to a template: without the keys whose value is None (templates test
    a key's presence: a null content would render as "None"), its reasoning under both names templates read."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[name] for name in REASONING_NAMES if name in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


@functools.lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    """A chat template compiled once, in a sandbox (templates come with checkpoints: untrusted code)."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                               namespace=TemplateNamespace)
    return environment.from_string(template)


class Generation(Extension):
    """``{% generation %}...{% endgeneration %}``, which templates written for training mark the assistant's
    text with: rendered as what it encloses."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message: str):
    """A template's refusal (roles out of order, say): the server answers it as a bad request."""
    raise jinja2.TemplateError(message)


def tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """JSON as templates expect it: Jinja's own filter would escape HTML characters and sort the keys."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class TemplateDict:
    """``dict`` in a template: makes dicts, without the type's other attributes."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args) -> dict:
        return dict.fromkeys(*args)


class TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses names starting with an underscore, which could reach Python's internals."""

    def __init__(*args, **kwargs):  # Namespace's own signature, so that a template may set a name "self"
        self, attributes = args[0], dict(*args[1:], **kwargs)
        for name in attributes:
            TemplateNamespace.check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value) -> None:
        TemplateNamespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def encode(tokenizer, text: str) -> list[int]:
    """Token ids for rendered prompt text, with exactly one BOS where the model wants one.

    Chat templates usually write the BOS themselves; tokenizing with special
    tokens added on top would double it.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def stop_token_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """Ids that end a turn: the tokenizer's EOS, the generation config's, and ChatML's end marker."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return frozenset(ids)
