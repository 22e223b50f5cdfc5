"""Function calling: the prompt that offers functions, and parsing the model's calls.

Two styles. A chat template that knows tools (it mentions ``tools``) gets
them through ``prompt.render`` and the model answers in its native
``<tool_call>{json}</tool_call>`` form (Qwen, Hermes). Any other template gets
a ReAct prompt (Thought / Action / Action Input / Observation) in the system
message, with ``Observation:`` as an extra stop string.

Forcing a call ends the prompt with the start of the call, so the model only
writes what is left: the arguments for a named function, the name and
arguments for "required".

Every plan that can produce a call or must produce JSON carries a grammar
(``tornchat.engine.grammar``) for the text after the prompt: a forced call's
name is one of the functions offered and its arguments follow that
function's ``parameters`` schema; with "auto", once the model starts a call
(``Action:`` or ``<tool_call>``) the same holds; ``response_format`` JSON
constrains the reply (or the ReAct final answer) to its schema, which the
prompt also shows the model.

Both parsers are incremental: they turn generated text into ``Piece``s of
content, call name and call arguments as it arrives, holding back only what
is still ambiguous. A whole reply is the same pieces concatenated, so a
stream and a non-streamed reply always agree.
"""
import json
from dataclasses import dataclass

from tornchat import prompt
from tornchat.engine.grammar import ANY_TEXT, json_value, literal

THOUGHT, ACTION, ACTION_INPUT, OBSERVATION, FINAL_ANSWER = (
    "Thought:",
    "Action:",
    "Action Input:",
    "Observation:",
    "Final Answer:",
)
REACT_LABELS = (THOUGHT, ACTION, ACTION_INPUT, FINAL_ANSWER)

REACT_INSTRUCTIONS = """Answer the user as best you can. You have access to the following tools:

{tools}

Use the following format:

Thought: think about what to do
Action: the tool to use, one of [{names}]
Action Input: the arguments of the tool, as a JSON object
Observation: the result of the tool
... (Thought/Action/Action Input/Observation can repeat)
Thought: I now know the final answer
Final Answer: the answer to the user

Begin!"""

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Piece:
    kind: str  # "content", "name" (a call starts) or "arguments" (a fragment of its JSON string)
    text: str
    index: int = 0  # which call, for models that make several at once


@dataclass(frozen=True)
class Choice:
    mode: str = "auto"  # auto | none | required | named
    name: str | None = None  # the function a "named" choice forces


@dataclass(frozen=True)
class Format:
    """response_format: "text", "json_object" or "json_schema" (with the schema and its name)."""

    type: str = "text"
    schema: dict | None = None
    name: str | None = None

    @property
    def json(self) -> bool:
        return self.type != "text"

    def instructions(self) -> str:
        """What the prompt tells the model, as OpenAI does, so that it knows what to write."""
        if self.schema is None:
            return "Answer with one JSON object."
        return f"Answer with one JSON object that matches this JSON schema ({self.name}):\n{json.dumps(self.schema)}"


@dataclass
class Plan:
    prompt: str
    stops: tuple[str, ...]  # added to the request's own stop strings
    parser: "ReActParser | TaggedParser | None"  # None: all generated text is content
    grammar: str | None = None  # Lark text (tornchat.engine.grammar) for everything generated; None: free


def supports_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def plan(tokenizer, messages: list[dict], functions: list[dict], choice: Choice = Choice(), fmt: Format = Format()) -> Plan:
    """Prompt text, extra stop strings, a parser and a grammar for one request.

    ``messages`` are validated dicts: role, content (a string), and
    function_call ({name, arguments}) / tool_calls / tool_call_id where
    present. ``functions`` are definitions: name, description, parameters.
    """
    offered = functions if choice.mode != "none" else []
    if supports_tools(tokenizer):
        return _native_plan(tokenizer, messages, offered, choice, fmt)
    if not offered and not any(_calls(m) or m["role"] in ("function", "tool") for m in messages):
        turns = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not fmt.json:
            return Plan(prompt.render(tokenizer, turns), (), None)
        return Plan(prompt.render(tokenizer, _instruct(turns, fmt.instructions())), (), None, f"start: {_answer(fmt)}")
    return _react_plan(tokenizer, messages, offered, choice, fmt)


def _instruct(turns: list[dict], instructions: str) -> list[dict]:
    """Turns with instructions at the end of the system message (one is added if there is none)."""
    if turns[0]["role"] == "system":
        return [{**turns[0], "content": turns[0]["content"] + "\n\n" + instructions}, *turns[1:]]
    return [{"role": "system", "content": instructions}, *turns]


def _answer(fmt: Format) -> str:
    return json_value(fmt.schema or ANY_OBJECT)


def _arguments(function: dict) -> str:
    return json_value(function.get("parameters") or NO_PARAMETERS)


def _named(functions: list[dict], name: str) -> dict:
    return next(f for f in functions if f["name"] == name)


def _calls(message: dict) -> list[dict]:
    """An assistant message's calls as [{id, name, arguments}], legacy or tools form."""
    if message.get("function_call"):
        return [{"id": None, **message["function_call"]}]
    return [{"id": call.get("id"), **call["function"]} for call in message.get("tool_calls") or ()]


# ---- ReAct prompt -----------------------------------------------------------------


def _react_plan(tokenizer, messages: list[dict], functions: list[dict], choice: Choice, fmt: Format) -> Plan:
    turns = _react_turns(messages)
    if functions:
        turns = _instruct(turns, REACT_INSTRUCTIONS.format(
            tools="\n\n".join(_describe(f) for f in functions), names=", ".join(f["name"] for f in functions)
        ))
    if fmt.json:
        turns = _instruct(turns, fmt.instructions())
    # A conversation that ends with a function result continues the
    # assistant's turn (the next line after an Observation) instead of
    # opening a new one.
    open_turn = turns.pop()["content"] + "\n" if messages[-1]["role"] in ("function", "tool") else ""
    text = prompt.render(tokenizer, turns) + open_turn
    stops = (OBSERVATION,)
    if choice.mode == "named" and functions:
        grammar = f"start: {literal(' ')} {_arguments(_named(functions, choice.name))}"
        return Plan(f"{text}{ACTION} {choice.name}\n{ACTION_INPUT}", stops, ReActParser("arguments", choice.name), grammar)
    names = tuple(f["name"] for f in functions)
    if choice.mode == "required" and functions:
        return Plan(text + ACTION, stops, ReActParser("name", names=names), f"start: {_react_calls(functions)}")
    if functions or open_turn:
        return Plan(text + THOUGHT, stops, ReActParser("thought", names=names), _react_grammar(functions, fmt))
    return Plan(text, (), None, f"start: {_answer(fmt)}" if fmt.json else None)


def _react_calls(functions: list[dict]) -> str:
    """After ``Action:``: an offered name, then ``Action Input:`` and arguments that fit its schema."""
    return " | ".join(literal(" " + f["name"] + "\n" + ACTION_INPUT + " ") + " " + _arguments(f) for f in functions)


def _react_grammar(functions: list[dict], fmt: Format) -> str | None:
    """After ``Thought:``: free lines, until an ``Action:`` line starts a call or a final answer in fmt."""
    if not (functions or fmt.json):
        return None
    rules = [f"TEXT: {ANY_TEXT}"]
    starts = []
    if functions:
        rules += ["call_head[lazy]: TEXT " + literal("\n" + ACTION), f"call: {_react_calls(functions)}"]
        starts.append("call_head call")
    if fmt.json:
        rules.append("answer_head[lazy]: TEXT " + literal("\n" + FINAL_ANSWER + " "))
        starts.append(f"answer_head {_answer(fmt)}")
    else:
        starts.append("TEXT")
    return "\n".join([f"start: {' | '.join(starts)}", *rules])


def _describe(function: dict) -> str:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    parts = [f"{function['name']}:", function.get("description") or "", "Parameters:", json.dumps(parameters)]
    return " ".join(part for part in parts if part)


def _react_turns(messages: list[dict]) -> list[dict]:
    """Messages as system/user/assistant turns for any chat template.

    An assistant's calls, their results and the answer that follows are one
    assistant turn, written the way a ReAct transcript reads.
    """
    turns: list[dict] = []
    reasoning = False  # the last turn is an assistant turn still inside Thought/Action/Observation
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant" and _calls(message):
            if not reasoning:
                turns.append({"role": "assistant", "content": ""})
            lines = [f"{THOUGHT} {content.strip()}"] if content.strip() else []
            lines += [f"{ACTION} {call['name']}\n{ACTION_INPUT} {call['arguments']}" for call in _calls(message)]
            _append(turns[-1], lines)
            reasoning = True
        elif role in ("function", "tool") and reasoning:
            _append(turns[-1], [f"{OBSERVATION} {content}"])
        elif role == "assistant" and reasoning:
            _append(turns[-1], [f"{THOUGHT} I now know the final answer", f"{FINAL_ANSWER} {content}"])
            reasoning = False
        else:
            turns.append({"role": role if role in ("system", "user", "assistant") else "user", "content": content})
            reasoning = False
    return turns


def _append(turn: dict, lines: list[str]) -> None:
    turn["content"] = "\n".join(text for text in (turn["content"], *lines) if text)


# ---- ReAct parsing ----------------------------------------------------------------


class _Tail:
    """Passes text on, minus leading whitespace and holding back trailing whitespace (maybe the end)."""

    def __init__(self):
        self.started = False
        self.held = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class _ValueEnd:
    """Finds where a JSON value being written ends: its closing bracket, or the line's end for a bare value."""

    def __init__(self):
        self.started = False
        self.bare = False
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def end_of(self, text: str) -> int | None:
        """Index just past the value's last character within text, or None if it goes on."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started, self.bare = True, ch not in "{["
            if self.bare:
                if ch == "\n":
                    return i
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ReActParser:
    """Generated ReAct text -> content and call pieces.

    Labels count only at the start of a line. Thought lines are hidden; the
    text after ``Final Answer:`` is content; ``Action:`` names the call and
    ``Action Input:`` starts its arguments, which end where their JSON value
    ends (anything after is ignored). An Action naming a function that was
    not offered is no call. A reply with neither a call nor a final answer
    (the model ignored the format) is returned whole as content at the end.
    """

    def __init__(self, section: str = "thought", name: str | None = None, names: tuple[str, ...] = ()):
        self.section = section  # thought | final | name | arguments | done
        self.names = names  # the functions offered; an Action naming another is not a call
        self.name = name
        self.name_text = ""
        self.announced = False  # the name piece has gone out
        self.pending = ""  # text at a line start that may still become a label
        self.line_start = False  # the prompt ends mid-line, right after a label
        self.raw = ""  # all generated text: the reply when the model ignored the format
        self.content_sent = False
        self.tail = _Tail()
        self.value = _ValueEnd()

    def push(self, text: str) -> list[Piece]:
        pieces = [self._announce()] if self.section == "arguments" and not self.announced else []
        self.raw += text
        self.pending += text
        while self.pending and self.section != "done":
            if self.line_start and self._labels_count():
                label = next((lb for lb in REACT_LABELS if self.pending.startswith(lb)), None)
                if label is None and any(lb.startswith(self.pending) for lb in REACT_LABELS):
                    break  # may still become a label
                self.line_start = False
                if label is not None:
                    self.pending = self.pending[len(label) :]
                    pieces += self._enter(label)
                    continue
            end = self.pending.find("\n") + 1 or len(self.pending)
            line, self.pending = self.pending[:end], self.pending[end:]
            self.line_start = line.endswith("\n")
            pieces += self._text(line)
        return [piece for piece in pieces if piece.text]

    def finish(self) -> list[Piece]:
        self.line_start = False  # what is pending can no longer become a label
        pieces = self.push("")
        if self.section == "name" and self.name is None:
            self._end_name()
        if self.name is not None:
            if not self.announced:
                pieces.append(self._announce())
            if not self.value.started:
                pieces.append(Piece("arguments", "{}"))
        elif not self.content_sent and self.raw.strip():
            pieces.append(Piece("content", self.raw.strip()))
        return pieces

    def _labels_count(self) -> bool:
        return self.section != "final" and not (self.section == "arguments" and self.value.started)

    def _enter(self, label: str) -> list[Piece]:
        if self.section == "thought":
            self.section = {FINAL_ANSWER: "final", ACTION: "name" if self.names else "thought"}.get(label, "thought")
            return []
        if self.section == "name" and self.name is not None and label == ACTION_INPUT:
            self.section = "arguments"
            return [self._announce()]
        self.section = "done"  # any other label ends the one call a turn may make
        return []

    def _text(self, line: str) -> list[Piece]:
        if self.section == "name":
            self.name_text += line
            if line.endswith("\n"):
                self._end_name()
        elif self.section == "final":
            if shown := self.tail.push(line):
                self.content_sent = True
                return [Piece("content", shown)]
        elif self.section == "arguments":
            end = self.value.end_of(line)
            if end is not None:
                line, self.section = line[:end], "done"
            return [Piece("arguments", self.tail.push(line))]
        return []

    def _end_name(self) -> None:
        name = self.name_text.strip()
        self.name = name if name in self.names else None
        if self.name is None:
            self.section = "thought"

    def _announce(self) -> Piece:
        self.announced = True
        return Piece("name", self.name)


# ---- native tool calls ------------------------------------------------------------


def _native_plan(tokenizer, messages: list[dict], functions: list[dict], choice: Choice, fmt: Format) -> Plan:
    tools = [{"type": "function", "function": f} for f in functions] or None
    rendered = _native_messages(messages)
    if fmt.json:
        rendered = _instruct(rendered, fmt.instructions())
    text = prompt.render(tokenizer, rendered, tools)
    close = literal("\n" + TOOL_CALL_CLOSE)
    if not functions:
        return Plan(text, (), None, f"start: {_answer(fmt)}" if fmt.json else None)
    if choice.mode == "named":
        start = _call_start(choice.name)
        grammar = f"start: {_arguments(_named(functions, choice.name))} {literal('}')} {close}"
        return Plan(f"{text}{TOOL_CALL_OPEN}\n{start}", (), TaggedParser(start, choice.name), grammar)
    calls = " | ".join(f"{literal(_call_start(f['name']))} {_arguments(f)} {literal('}')}" for f in functions)
    if choice.mode == "required":
        return Plan(f"{text}{TOOL_CALL_OPEN}\n", (), TaggedParser(""), f"start: ({calls}) {close}")
    # auto: free text (or the JSON answer) unless a <tool_call> block opens; then the calls are constrained.
    grammar = "\n".join([
        f"start: {_answer(fmt) if fmt.json else 'TEXT'} | (call_head ({calls}) {close})+",
        f"TEXT: {ANY_TEXT}",
        "call_head[lazy]: TEXT " + literal(TOOL_CALL_OPEN + "\n"),
    ])
    return Plan(text, (), TaggedParser(), grammar)


def _call_start(name: str) -> str:
    """A tool call's JSON up to its arguments, as the prompt writes it for a forced call."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _native_messages(messages: list[dict]) -> list[dict]:
    """Messages in the shape tool-aware templates expect: tool_calls with object arguments, role tool."""
    rendered = []
    for message in messages:
        role, content = message["role"], message["content"]
        if calls := _calls(message):
            tool_calls = [
                {"id": c["id"] or f"call_{i}", "type": "function", "function": {"name": c["name"], "arguments": _as_object(c["arguments"])}}
                for i, c in enumerate(calls)
            ]
            rendered.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
        elif role in ("function", "tool"):
            extra = {key: message[key] for key in ("name", "tool_call_id") if message.get(key)}
            rendered.append({"role": "tool", "content": content, **extra})
        else:
            rendered.append({"role": role, "content": content})
    return rendered


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class TaggedParser:
    """Generated text with ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks -> pieces.

    Text outside blocks is content. A block becomes a call when it closes
    (its JSON is only parsable whole). ``opened`` is the start of a block the
    prompt already wrote (a forced call); ``name`` the function it forces.
    """

    def __init__(self, opened: str | None = None, name: str | None = None):
        self.inside = opened is not None
        self.block = opened or ""
        self.forced_name = name
        self.pending = ""
        self.index = 0
        self.tail = _Tail()

    def push(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while True:
            if self.inside:
                end = self.pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                pieces += self._call(self.pending[:end])
                self.pending = self.pending[end + len(TOOL_CALL_CLOSE) :]
            else:
                start = self.pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self.pending, TOOL_CALL_OPEN)
                    pieces.append(Piece("content", self.tail.push(self.pending[: len(self.pending) - keep])))
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                pieces.append(Piece("content", self.tail.push(self.pending[:start])))
                self.pending = self.pending[start + len(TOOL_CALL_OPEN) :]
                self.inside = True
        return [piece for piece in pieces if piece.text]

    def finish(self) -> list[Piece]:
        pieces = self.push("")
        if self.inside:
            pieces += self._call(self.pending)  # the model stopped before closing the block
        elif self.pending:
            pieces.append(Piece("content", self.tail.push(self.pending)))
        self.pending = ""
        return [piece for piece in pieces if piece.text]

    def _call(self, generated: str) -> list[Piece]:
        text, self.block, self.inside = self.block + generated, "", False
        name, forced, self.forced_name = self.forced_name, self.forced_name, None
        try:
            call = json.loads(text)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            if not forced:  # not a call we can read: show what the model wrote
                return [Piece("content", self.tail.push(f"{TOOL_CALL_OPEN}{generated}{TOOL_CALL_CLOSE}"))]
            arguments = generated.strip()  # the forced name is known; keep the model's text as its arguments
            if arguments.endswith("}"):
                arguments = arguments[:-1].rstrip()  # the brace that closes the call object
        index, self.index = self.index, self.index + 1
        return [Piece("name", name, index), Piece("arguments", arguments, index)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
