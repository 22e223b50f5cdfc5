"""Qwen3-Coder: ``<tool_call>`` blocks of XML, one parameter per element, values as plain text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A string value is written as it is (it may span lines); any other value as
JSON. The parser turns the parameters back into a JSON object, reading a
value as JSON wherever the function's schema says it is not a string. The
grammar writes parameters in the schema's order, required ones always,
optional ones where the model wants them; a string parameter's value is
free text up to its closing tag (only an enum of strings is constrained).
"""
import json
import re
from dataclasses import dataclass

from tornchat.engine.grammar import json_value, literal
from tornchat.toolcalls.common import Syntax

FUNCTION = re.compile(r"<function=([^>\n]+)>\n?(.*?)(?:</function>|\Z)", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)(?:\n?</parameter>|\Z)", re.S)
END_PARAMETER = "\n</parameter>\n"


@dataclass(frozen=True)
class Qwen3Coder(Syntax):
    def head(self, name: str) -> str:
        return f"<function={name}>\n"

    def call_arguments(self, function: dict) -> str:
        properties = (function.get("parameters") or {}).get("properties")
        if not properties:  # no schema to follow: any parameters, as text
            any_name = literal("<parameter=") + r" /[^>\n]+/ " + literal(">\n")
            return f"({any_name} param_text)*"
        required = set((function.get("parameters") or {}).get("required") or ())
        parts = []
        for name, schema in properties.items():
            part = literal(f"<parameter={name}>\n") + " " + _value(schema)
            parts.append(part if name in required else f"({part})?")
        return " ".join(parts)

    def rules(self) -> list[str]:
        return [f"param_text[lazy]: /(.|\\n)*/ {literal(END_PARAMETER)}"]

    def read(self, block: str, functions: list[dict]) -> list[tuple[str, object]] | None:
        schemas = {f["name"]: (f.get("parameters") or {}).get("properties") or {} for f in functions}
        calls = []
        for function in FUNCTION.finditer(block):
            name = function[1].strip()
            properties = schemas.get(name, {})
            calls.append((name, {p[1].strip(): _parse(p[2], properties.get(p[1].strip())) for p in PARAMETER.finditer(function[2])}))
        return calls or None


def _is_text(schema: dict | None) -> bool:
    return schema is None or schema.get("type") == "string" or ("enum" in schema and all(isinstance(v, str) for v in schema["enum"]))


def _value(schema: dict) -> str:
    """Lark for one parameter's value and its closing tag."""
    if "enum" in schema and _is_text(schema):
        return "(" + " | ".join(literal(v + END_PARAMETER) for v in schema["enum"]) + ")"
    if _is_text(schema):
        return "param_text"
    return f"{json_value(schema)} {literal(END_PARAMETER)}"


def _parse(text: str, schema: dict | None):
    if _is_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # not the JSON the schema wants: the model's text, for the client to judge


SYNTAX = Qwen3Coder(
    "qwen3-coder", marker="<tool_call>", end="</tool_call>", trigger="<tool_call>\n", tail="</function>\n", close="</tool_call>", again="\n"
)


def detect(written: str) -> Syntax | None:
    """``written``: what the template writes for an assistant message holding the probe call."""
    return SYNTAX if "<function=probe_function>" in written else None
