"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole reply is one JSON object, optionally after ``<|python_tag|>``.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

The templates allow one call per assistant message (Llama 3.1's raises on
more), so there are no parallel calls. A plain-text answer cannot start with
``{`` under the "auto" grammar: in this format a reply that opens with a
brace is a call.
"""
import json
from dataclasses import dataclass

from tornchat.toolcalls.common import Format, Syntax, answer

PYTHON_TAG = "<|python_tag|>"
NOT_A_BRACE = r"/([^{](.|\n)*)?/"  # text that does not open with "{", which would be a call


@dataclass(frozen=True)
class Llama3(Syntax):
    def head(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "parameters": '

    def auto_start(self, fmt: Format) -> str:
        if fmt.json:  # the JSON answer opens with "{" too: a call must then start with the tag
            return f"start: {answer(fmt)} | {self.lark(PYTHON_TAG)} section"
        return "\n".join([
            "start: TEXT | section | call_head section",
            f"TEXT: {NOT_A_BRACE}",
            self.call_head(NOT_A_BRACE, PYTHON_TAG),
        ])



SYNTAX = Llama3("llama3", marker=PYTHON_TAG, end=None, trigger="", tail="}", bare=True)


def detect(written: str) -> Syntax | None:
    """``written``: what the template writes for an assistant message holding the probe call."""
    return SYNTAX if '"name": "probe_function"' in written and '"parameters"' in written else None
