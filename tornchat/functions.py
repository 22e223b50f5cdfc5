"""Function calling: the prompt that offers functions, and the parser and grammar for the reply.

A chat template that writes tool calls in a format ``tornchat.toolcalls``
knows (Hermes/Qwen, Llama 3, Mistral, Qwen3-Coder) gets the tools through
``prompt.render``, and the model answers in that format. Any other template
gets a ReAct prompt (``tornchat.toolcalls.react``).

Forcing a call ends the prompt with the start of the call, so the model only
writes what is left: the arguments for a named function, the name and
arguments for "required".

Every plan that can produce a call or must produce JSON carries a grammar
(``tornchat.engine.grammar``) for the text after the prompt: a forced call's
name is one of the functions offered and its arguments follow that
function's ``parameters`` schema; with "auto", once the model starts a call
the same holds; ``response_format`` JSON constrains the reply (or the ReAct
final answer) to its schema, which the prompt also shows the model.

The parsers are incremental: they turn generated text into ``Piece``s of
content, call name and call arguments as it arrives, holding back only what
is still ambiguous. A whole reply is the same pieces concatenated, so a
stream and a non-streamed reply always agree.
"""
import json

from tornchat import prompt, toolcalls
from tornchat.toolcalls import react
from tornchat.toolcalls.common import NO_PARAMETERS, Choice, Format, Piece, Plan, Syntax, answer, calls, instruct

__all__ = ["Choice", "Format", "Piece", "Plan", "plan"]


def plan(tokenizer, messages: list[dict], functions: list[dict], choice: Choice = Choice(), fmt: Format = Format(),
         template_kwargs: dict | None = None) -> Plan:
    """Prompt text, extra stop strings, a parser and a grammar for one request.

    ``messages`` are validated dicts: role, content (a string), and
    function_call ({name, arguments}) / tool_calls / tool_call_id /
    reasoning_content where present. ``functions`` are definitions: name,
    description, parameters. ``template_kwargs`` go to the chat template
    (not to the ReAct prompt, which writes its own turns).
    """
    offered = functions if choice.mode != "none" else []
    syntax = toolcalls.detect(tokenizer)
    if syntax is not None:
        return _native_plan(syntax, tokenizer, messages, offered, choice, fmt, template_kwargs)
    if not offered and not any(calls(m) or m["role"] in ("function", "tool") for m in messages):
        turns = [_turn(m) for m in messages]
        if not fmt.json:
            return Plan(prompt.render(tokenizer, turns, template_kwargs=template_kwargs), (), None)
        text = prompt.render(tokenizer, instruct(turns, fmt.instructions()), template_kwargs=template_kwargs)
        return Plan(text, (), None, f"start: {answer(fmt)}")
    return react.plan(tokenizer, messages, offered, choice, fmt)


def _turn(message: dict) -> dict:
    """A message as the template reads it; an assistant's earlier thinking goes along, for templates that place it."""
    turn = {"role": message["role"], "content": message["content"]}
    if message.get("reasoning_content"):
        turn["reasoning_content"] = message["reasoning_content"]
    return turn


def _native_plan(syntax: Syntax, tokenizer, messages: list[dict], functions: list[dict], choice: Choice, fmt: Format,
                 template_kwargs: dict | None) -> Plan:
    # Parameters always, as OpenAI reads a function without them: some templates (Qwen3-Coder's) read them unguarded.
    tools = [{"type": "function", "function": {**f, "parameters": f.get("parameters") or NO_PARAMETERS}} for f in functions] or None
    rendered = _native_messages(messages, syntax)
    if fmt.json:
        rendered = instruct(rendered, fmt.instructions())
    text = prompt.render(tokenizer, rendered, tools, template_kwargs=template_kwargs)
    if not functions:
        return Plan(text, (), None, f"start: {answer(fmt)}" if fmt.json else None)
    keep = frozenset(token for _, token in syntax.special)
    return Plan(text + syntax.opening(choice), (), syntax.parser(functions, choice), syntax.grammar(functions, choice, fmt), keep)


def _native_messages(messages: list[dict], syntax: Syntax) -> list[dict]:
    """Messages in the shape tool-aware templates expect: tool_calls with object arguments, role tool.

    Every call gets an id and every result the id of its call (a legacy
    ``function`` message names none: it answers the oldest call not yet
    answered), since some templates (Mistral's) refuse calls without them.
    """
    rendered, unanswered = [], []
    for message in messages:
        role, content = message["role"], message["content"]
        if made := calls(message):
            ids = [c["id"] or f"call_{len(rendered)}_{i}" for i, c in enumerate(made)]
            unanswered = list(ids)
            tool_calls = [
                {"id": syntax.call_id(i), "type": "function", "function": {"name": c["name"], "arguments": _as_object(c["arguments"])}}
                for i, c in zip(ids, made)
            ]
            rendered.append({**_turn(message), "tool_calls": tool_calls})
        elif role in ("function", "tool"):
            call_id = message.get("tool_call_id") or (unanswered[0] if unanswered else f"call_{len(rendered)}")
            if call_id in unanswered:
                unanswered.remove(call_id)
            extra = {"name": message["name"]} if message.get("name") else {}
            rendered.append({"role": "tool", "content": content, "tool_call_id": syntax.call_id(call_id), **extra})
        else:
            rendered.append(_turn(message))
    return rendered


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
