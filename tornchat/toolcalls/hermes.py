"""Hermes / Qwen2.5 / Qwen3: each call is a ``<tool_call>`` block holding one JSON object.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are several blocks, one per line.
"""
import json
from dataclasses import dataclass

from tornchat.toolcalls.common import Syntax


@dataclass(frozen=True)
class Hermes(Syntax):
    def head(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "arguments": '



SYNTAX = Hermes(
    "hermes", marker="<tool_call>", end="</tool_call>", trigger="<tool_call>\n", tail="}", close="\n</tool_call>", again="\n"
)


def detect(written: str) -> Syntax | None:
    """``written``: what the template writes for an assistant message holding the probe call."""
    return SYNTAX if "<tool_call>" in written and '"probe_function"' in written else None
