"""What every tool-call format shares: the request's choices, the pieces a parser emits, and the
machinery a native format is described to (``Syntax``): its grammar and its incremental parser.

A native format is the way a model family writes calls after its chat
template's generation prompt. ``Syntax`` holds the texts that frame a call
(a section of calls opens with ``trigger``; each call is ``head(name)``, its
arguments, ``tail``; calls in one section are joined by ``separator``; the
section ends with ``close``; further sections follow after ``again``) and
the format's module supplies ``read``, which turns one block of generated
text back into calls. The grammar and the parser are built from those, so
the two cannot disagree about what a call looks like.

Where the model's tokenizer has a marker as a special token (Llama's
``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``), ``detect`` records it in
``special``: the grammar then writes that token, the text stream keeps it
for the parser (``Plan.keep``), and text shown to the user leaves it out as
it does any special token.
"""
import json
from dataclasses import dataclass

from tornchat.engine.grammar import ANY_TEXT, json_value, literal

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
    parser: object | None  # push(text) / finish() -> list[Piece]; None: all generated text is content
    grammar: str | None = None  # Lark text (tornchat.engine.grammar) for everything generated; None: free
    keep: frozenset[int] = frozenset()  # special tokens the parser reads, so the text stream must not skip them


def answer(fmt: Format) -> str:
    """Lark for a reply in response_format's JSON."""
    return json_value(fmt.schema or ANY_OBJECT)


def arguments(function: dict) -> str:
    """Lark for a call's arguments: one JSON object valid against the function's parameters."""
    return json_value(function.get("parameters") or NO_PARAMETERS)


def named(functions: list[dict], name: str) -> dict:
    return next(f for f in functions if f["name"] == name)


def instruct(turns: list[dict], instructions: str) -> list[dict]:
    """Turns with instructions at the end of the system message (one is added if there is none)."""
    if turns[0]["role"] == "system":
        return [{**turns[0], "content": turns[0]["content"] + "\n\n" + instructions}, *turns[1:]]
    return [{"role": "system", "content": instructions}, *turns]


def calls(message: dict) -> list[dict]:
    """An assistant message's calls as [{id, name, arguments}], legacy or tools form."""
    if message.get("function_call"):
        return [{"id": None, **message["function_call"]}]
    return [{"id": call.get("id"), **call["function"]} for call in message.get("tool_calls") or ()]


def json_call(value) -> tuple[str, object] | None:
    """(name, arguments) from a call written as a JSON object; Llama says "parameters", the rest "arguments"."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value["name"], value.get("arguments", value.get("parameters", {}))


def one_json_value(text: str):
    """The JSON value that is all of text (whitespace aside); ValueError if there is anything else."""
    value, end = json.JSONDecoder().raw_decode(text.strip())
    if text.strip()[end:]:
        raise ValueError("text after the JSON value")
    return value


@dataclass(frozen=True)
class Syntax:
    """How one model family writes tool calls (see the module docstring); the grammar and the parser follow."""

    name: str
    marker: str  # what opens a block of calls in generated text ("" for none)
    end: str | None  # what ends a block; None: it runs to the next marker or the end of the reply
    trigger: str  # the text that starts a section of calls, marker included
    tail: str  # after a call's arguments
    separator: str | None = None  # between calls inside one section; None: one call per section
    close: str = ""  # after a section's last call
    again: str | None = None  # between sections; None: one section per reply (the format has no parallel calls)
    bare: bool = False  # a reply that opens with "{" is a call without any marker (Llama)
    special: tuple[tuple[str, int], ...] = ()  # (marker, token id) for the markers the tokenizer has as special tokens

    def markers(self) -> tuple[str, ...]:
        """The texts that frame calls which a tokenizer may have as single special tokens."""
        return tuple(text for text in (self.marker, self.end) if text)

    def lark(self, text: str) -> str:
        """Lark for exactly this text, its special-token markers as those tokens."""
        return literal(text, dict(self.special))

    def visible(self, text: str) -> str:
        """Generated text as the user sees it: special-token markers left out, like every other special token."""
        for marker, _ in self.special:
            text = text.replace(marker, "")
        return text

    def call_head(self, text: str, opening: str) -> str:
        """The Lark rule for free text (``text``: a terminal or regex) up to ``opening``, which starts calls."""
        if any(opening.startswith(marker) for marker, _ in self.special):
            # Free text cannot hold a special token, so the token ends it without a lazy lexeme (which could not hold it).
            return f"call_head: {text} {self.lark(opening)}"
        return f"call_head[lazy]: {text} {self.lark(opening)}"

    def head(self, name: str) -> str:
        """A call's text up to its arguments."""
        raise NotImplementedError

    def call_arguments(self, function: dict) -> str:
        """Lark for a call's arguments."""
        return arguments(function)

    def rules(self) -> list[str]:
        """Lark rules that call_arguments refers to."""
        return []

    def call_id(self, call_id: str) -> str:
        """A call id as the template accepts it (Mistral's insist on nine letters and digits)."""
        return call_id

    def opening(self, choice: Choice) -> str:
        """What the prompt writes of a forced call, so that the model writes only the rest."""
        if choice.mode == "named":
            return self.trigger + self.head(choice.name)
        return self.trigger if choice.mode == "required" else ""

    def grammar(self, functions: list[dict], choice: Choice, fmt: Format) -> str:
        """Lark for the text after the prompt (and after ``opening``)."""
        if choice.mode == "named":
            start = f"start: {self.call_arguments(named(functions, choice.name))} {self.lark(self.tail + self.close)}"
            return "\n".join([start, *self.rules()])
        one = " | ".join(f"{self.lark(self.head(f['name']))} {self.call_arguments(f)} {self.lark(self.tail)}" for f in functions)
        joined = "call" if self.separator is None else f"call ({self.lark(self.separator)} call)*"
        more = "" if self.again is None else f" ({self.lark(self.again + self.trigger)} section)*"
        rules = [f"call: {one}", f"section: {joined} {self.lark(self.close)}{more}", *self.rules()]
        if choice.mode == "required":
            return "\n".join(["start: section", *rules])
        return "\n".join([self.auto_start(fmt), *rules])

    def auto_start(self, fmt: Format) -> str:
        """With "auto": free text (or the JSON answer) unless the trigger opens calls; from there they are constrained."""
        return "\n".join([
            f"start: {answer(fmt) if fmt.json else 'TEXT'} | call_head section",
            f"TEXT: {ANY_TEXT}",
            self.call_head("TEXT", self.trigger),
        ])

    def parser(self, functions: list[dict], choice: Choice) -> "BlockParser":
        opened = self.opening(choice)
        if choice.mode == "auto":
            return BlockParser(self, functions)
        if self.marker and opened.startswith(self.marker):
            return BlockParser(self, functions, opened[len(self.marker) :], self.marker, choice.name)
        return BlockParser(self, functions, opened, "", choice.name)

    def read(self, block: str, functions: list[dict]) -> list[tuple[str, object]] | None:
        """The calls (name, arguments as text or a JSON value) one block holds; None if it holds none.

        Most formats write a block as one JSON object with the name and the arguments.
        """
        try:
            call = json_call(one_json_value(block))
        except ValueError:
            return None
        return None if call is None else [call]


class Tail:
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


class BlockParser:
    """Generated text with blocks of calls -> content and call pieces, for any ``Syntax``.

    Text outside blocks is content. A block becomes calls when it ends (its
    text is only readable whole); one that does not read as calls to offered
    functions is shown as the text the model wrote. ``opened`` is the block
    text the prompt already wrote (a forced call; ``shown`` the marker it
    opened with) and ``forced`` the function it names: if the model is cut
    off before the call reads, its text is still returned as the arguments.
    """

    def __init__(self, syntax: Syntax, functions: list[dict], opened: str | None = None, shown: str = "", forced: str | None = None):
        self.syntax = syntax
        self.functions = functions
        self.inside = opened is not None
        self.block = opened or ""  # the part of the block the prompt wrote
        self.shown = shown  # the marker that opened the block, shown again if it is not a call
        self.forced = forced
        self.pending = ""
        self.started = False  # anything but whitespace has been generated
        self.index = 0
        self.tail = Tail()

    def push(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while True:
            if not self.started and self.syntax.bare and not self.inside and self.pending.strip():
                self.started = True
                if self.pending.lstrip().startswith("{"):
                    self.inside = True
            if self.inside:
                found = self._block_end()
                if found is None:
                    break
                end, skip = found
                pieces += self._calls(self.pending[:end])
                self.pending = self.pending[end + skip :]
            else:
                start = self.pending.find(self.syntax.marker) if self.syntax.marker else -1
                if start < 0:
                    keep = _partial_suffix(self.pending, self.syntax.marker)
                    pieces.append(Piece("content", self.tail.push(self.pending[: len(self.pending) - keep])))
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                pieces.append(Piece("content", self.tail.push(self.pending[:start])))
                self.pending = self.pending[start + len(self.syntax.marker) :]
                self.inside, self.shown, self.started = True, self.syntax.marker, True
        return [piece for piece in pieces if piece.text]

    def finish(self) -> list[Piece]:
        pieces = self.push("")
        if self.inside:
            pieces += self._calls(self.pending, ended=False)  # the block runs to the end of the reply
        elif self.pending:
            pieces.append(Piece("content", self.tail.push(self.pending)))
        self.pending = ""
        return [piece for piece in pieces if piece.text]

    def _block_end(self) -> tuple[int, int] | None:
        """Where the open block ends in pending and how much of it the end marker takes; None: not yet."""
        if self.syntax.end is not None:
            end = self.pending.find(self.syntax.end)
            return None if end < 0 else (end, len(self.syntax.end))
        end = self.pending.find(self.syntax.marker) if self.syntax.marker else -1
        return None if end < 0 else (end, 0)  # the next block's marker stays for the next block

    def _calls(self, generated: str, ended: bool = True) -> list[Piece]:
        text, self.block, self.inside = self.block + generated, "", False
        forced, self.forced = self.forced, None
        offered = {f["name"] for f in self.functions}
        read = self.syntax.read(text, self.functions)
        if not read or any(name not in offered for name, _ in read):
            if not forced:  # not calls we can read: show what the model wrote
                closing = self.syntax.end if ended and self.syntax.end else ""
                return [Piece("content", self.tail.push(self.syntax.visible(f"{self.shown}{generated}{closing}")))]
            # Cut off before the call was whole: the forced name is known; the model's text is its arguments.
            trimmed = generated.strip().removesuffix(self.syntax.close.strip()).rstrip()
            read = [(forced, trimmed.removesuffix(self.syntax.tail.strip()).rstrip())]
        pieces = []
        for name, args in read:
            written = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            pieces += [Piece("name", name, self.index), Piece("arguments", written, self.index)]
            self.index += 1
        return pieces


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
