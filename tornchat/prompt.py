"""Messages in, prompt token ids out, through the tokenizer's chat template."""

# For checkpoints without a chat template: ChatML, which most small chat
# models were tuned on or at least tolerate.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True,
           template_kwargs: dict | None = None) -> str:
    """The prompt text for messages, ending with the assistant's generation prompt unless told otherwise.

    ``template_kwargs`` are variables for the template (a request's
    ``chat_template_kwargs``, ``enable_thinking``); templates ignore those they do not read.
    """
    template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
    kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )


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
