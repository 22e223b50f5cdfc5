"""ReAct: the fallback for chat templates that write no tool-call format we know.

The functions go into the system message as a ReAct prompt (Thought /
Action / Action Input / Observation), with ``Observation:`` as an extra stop
string; past calls and their results are rewritten as a ReAct transcript
inside the assistant's turn, so any template renders them. A forced call
ends the prompt with the start of the call: ``Action: NAME`` and
``Action Input:`` for a named one, ``Action:`` for "required". With "auto"
the text is free until an ``Action:`` line; from there the name must be an
offered one and the arguments must fit its schema.
"""
import json

from tornchat import prompt
from tornchat.engine.grammar import ANY_TEXT, literal
from tornchat.toolcalls.common import Choice, Format, Piece, Plan, Tail, answer, arguments, calls, instruct, named

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


# ---- ReAct prompt -----------------------------------------------------------------


def plan(tokenizer, messages: list[dict], functions: list[dict], choice: Choice, fmt: Format) -> Plan:
    turns = _react_turns(messages)
    if functions:
        turns = instruct(turns, REACT_INSTRUCTIONS.format(
            tools="\n\n".join(_describe(f) for f in functions), names=", ".join(f["name"] for f in functions)
        ))
    if fmt.json:
        turns = instruct(turns, fmt.instructions())
    # A conversation that ends with a function result continues the
    # assistant's turn (the next line after an Observation) instead of
    # opening a new one.
    open_turn = turns.pop()["content"] + "\n" if messages[-1]["role"] in ("function", "tool") else ""
    text = prompt.render(tokenizer, turns) + open_turn
    stops = (OBSERVATION,)
    if choice.mode == "named" and functions:
        grammar = f"start: {literal(' ')} {arguments(named(functions, choice.name))}"
        return Plan(f"{text}{ACTION} {choice.name}\n{ACTION_INPUT}", stops, ReActParser("arguments", choice.name), grammar)
    names = tuple(f["name"] for f in functions)
    if choice.mode == "required" and functions:
        return Plan(text + ACTION, stops, ReActParser("name", names=names), f"start: {_react_calls(functions)}")
    if functions or open_turn:
        return Plan(text + THOUGHT, stops, ReActParser("thought", names=names), _react_grammar(functions, fmt))
    return Plan(text, (), None, f"start: {answer(fmt)}" if fmt.json else None)


def _react_calls(functions: list[dict]) -> str:
    """After ``Action:``: an offered name, then ``Action Input:`` and arguments that fit its schema."""
    return " | ".join(literal(" " + f["name"] + "\n" + ACTION_INPUT + " ") + " " + arguments(f) for f in functions)


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
        starts.append(f"answer_head {answer(fmt)}")
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
        if role == "assistant" and calls(message):
            if not reasoning:
                turns.append({"role": "assistant", "content": ""})
            lines = [f"{THOUGHT} {content.strip()}"] if content.strip() else []
            lines += [f"{ACTION} {call['name']}\n{ACTION_INPUT} {call['arguments']}" for call in calls(message)]
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
        self.tail = Tail()
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
