"""Mistral: calls follow ``[TOOL_CALLS]``, in one of two layouts, whichever the template writes.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (v0.3, Nemo)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...                          (Small 3.2 and later)

The parser reads both; the grammar (and a forced call's prompt) follows the
template's. Mistral's templates insist on call ids of nine letters and digits.
"""
import hashlib
import json
from dataclasses import dataclass

from tornchat.toolcalls.common import Syntax, json_call, one_json_value

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


@dataclass(frozen=True)
class Mistral(Syntax):
    def markers(self) -> tuple[str, ...]:
        return (TOOL_CALLS,) if self.separator else (TOOL_CALLS, ARGS)

    def head(self, name: str) -> str:
        if self.separator is None:
            return name + ARGS
        return '{"name": ' + json.dumps(name) + ', "arguments": '

    def call_id(self, call_id: str) -> str:
        # The same id in, the same id out: a call and its result must keep matching.
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    def read(self, block: str, functions: list[dict]) -> list[tuple[str, object]] | None:
        try:
            if not block.strip().startswith(("[", "{")):  # name[ARGS]{...}
                name, found, rest = block.partition(ARGS)
                return [(name.strip(), one_json_value(rest))] if found else None
            value = one_json_value(block)
        except ValueError:
            return None
        read = [json_call(call) for call in (value if isinstance(value, list) else [value])]
        return None if not read or None in read else read


def detect(written: str) -> Syntax | None:
    """``written``: what the template writes for an assistant message holding the probe call."""
    if TOOL_CALLS not in written:
        return None
    if ARGS in written:
        return Mistral("mistral-args", marker=TOOL_CALLS, end=None, trigger=TOOL_CALLS, tail="", again="")
    opening = written[written.index(TOOL_CALLS) : written.index("{", written.index(TOOL_CALLS))]  # "[TOOL_CALLS] [" or "[TOOL_CALLS]["
    return Mistral("mistral", marker=TOOL_CALLS, end=None, trigger=opening, tail="}", separator=", ", close="]")
