"""Structured outputs on the embedded model: do forced calls and response_format replies parse and validate?

Through the real server and the OpenAI SDK:

- 3 function schemas (strings, bounded integers, arrays, booleans, enums),
  each forced by name and, all three offered, by tool_choice "required", at
  temperature 0 and 1.0 (several seeds): how many calls name an offered
  function and have arguments that parse and validate against its schema.
- 4 response_format json_schema schemas (nested objects, enums, arrays of
  integers, booleans) at temperature 0 and 1.0: how many replies parse and
  validate, and whether the streamed reply equals the plain one (same seed).
  Each setting is sent three times: plain, plain again and streamed. The
  first finds the KV slot cold; the other two both find the slot the first
  left (the whole prompt cached), so "streamed = plain" compares like with
  like, and "warm = cold" shows what KV reuse alone changes.

Then, in this process, the grammar's cost per token on this CPU: filling the
mask, applying it to the logits and consuming the token, replayed over the
replies above; set against the server's decode time per token. And decode
tokens/s through the server with a JSON schema active against none, in turns
(same prompt, temperature 1.0, streamed; tokens after the first over the
time they took).

    python -m bench.structured [--seeds 3] [--out bench/results/structured.json]
    python -m bench.structured --speed-only [--rounds 5]
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import openai
import torch

from bench import servers
from bench.common import rate_after_first, write_results

from tornchat import checkpoint
from tornchat.engine.cpu import describe
from tornchat.engine.grammar import Compiler, json_value

FUNCTIONS = [
    {
        "name": "book_flight",
        "description": "Book a flight between two cities",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "maxLength": 24},
                "destination": {"type": "string", "maxLength": 24},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"enum": ["economy", "business", "first"]},
            },
            "required": ["origin", "destination", "passengers", "cabin"],
            "additionalProperties": False,
        },
    },
    {
        "name": "set_thermostat",
        "description": "Set the heating",
        "parameters": {
            "type": "object",
            "properties": {
                "celsius": {"type": "integer", "minimum": 10, "maximum": 30},
                "eco": {"type": "boolean"},
                "rooms": {"type": "array", "items": {"enum": ["kitchen", "bedroom", "office"]}, "minItems": 1, "maxItems": 3},
            },
            "required": ["celsius", "eco", "rooms"],
            "additionalProperties": False,
        },
    },
    {
        "name": "send_message",
        "description": "Send a text message",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"type": "string", "maxLength": 24},
                "text": {"type": "string", "maxLength": 80},
                "urgent": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            },
            "required": ["to", "text", "urgent"],
            "additionalProperties": False,
        },
    },
]
ASKS = {
    "book_flight": "Book me a flight from Paris to Rome for two people.",
    "set_thermostat": "Make the kitchen warmer, 22 degrees please.",
    "send_message": "Tell Anna I will be late tonight.",
}
FORMATS = {
    "person (nested objects)": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "review (enums)": {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]}, "stars": {"enum": [1, 2, 3, 4, 5]}},
        "required": ["sentiment", "stars"],
        "additionalProperties": False,
    },
    "primes (array of integers)": {
        "type": "object",
        "properties": {"primes": {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 100}, "minItems": 1, "maxItems": 5}},
        "required": ["primes"],
        "additionalProperties": False,
    },
    "facts (booleans)": {
        "type": "object",
        "properties": {"sky_is_blue": {"type": "boolean"}, "fish_can_fly": {"type": "boolean"}, "water_is_wet": {"type": "boolean"}},
        "required": ["sky_is_blue", "fish_can_fly", "water_is_wet"],
        "additionalProperties": False,
    },
}
FORMAT_ASKS = {
    "person (nested objects)": "Invent a person and their address.",
    "review (enums)": "Review this: the food was great but the service slow.",
    "primes (array of integers)": "List a few prime numbers.",
    "facts (booleans)": "Answer: is the sky blue, can fish fly, is water wet?",
}
MAX_TOKENS = 96


def valid(arguments: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def settings(seeds: int) -> list[tuple[float, int | None]]:
    return [(0.0, None)] + [(1.0, seed) for seed in range(seeds)]


def function_rows(client, seeds: int) -> tuple[list[dict], list[str]]:
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    schemas = {f["name"]: f["parameters"] for f in FUNCTIONS}
    rows, replies = [], []
    for function in FUNCTIONS:
        name = function["name"]
        for mode, choice in (("named", {"type": "function", "function": {"name": name}}), ("required", "required")):
            for temperature in (0.0, 1.0):
                runs = [s for s in settings(seeds) if s[0] == temperature]
                ok, examples, started, tokens = 0, [], time.perf_counter(), 0
                for _, seed in runs:
                    reply = client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": ASKS[name]}], tools=tools, tool_choice=choice,
                        temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                    )
                    tokens += reply.usage.completion_tokens
                    calls = reply.choices[0].message.tool_calls or []
                    good = len(calls) == 1 and calls[0].function.name in schemas and (mode == "required" or calls[0].function.name == name)
                    good = good and valid(calls[0].function.arguments, schemas[calls[0].function.name])
                    ok += good
                    if calls:
                        examples.append(f"{calls[0].function.name}({calls[0].function.arguments})")
                        replies.append(calls[0].function.arguments)
                rows.append({"function": name, "choice": mode, "temperature": temperature, "valid": ok, "calls": len(runs),
                             "example": examples[0] if examples else "", "tokens_per_s": tokens / (time.perf_counter() - started)})
                print(rows[-1], flush=True)
    return rows, replies


def format_rows(client, seeds: int) -> tuple[list[dict], list[str]]:
    rows, replies = [], []
    for title, schema in FORMATS.items():
        for temperature in (0.0, 1.0):
            runs = [s for s in settings(seeds) if s[0] == temperature]
            ok = same = reused_same = 0
            examples = []
            for _, seed in runs:
                request = dict(
                    model="m", messages=[{"role": "user", "content": FORMAT_ASKS[title]}], temperature=temperature,
                    seed=seed if seed is not None else 0, max_tokens=MAX_TOKENS,
                    response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}},
                )
                cold = client.chat.completions.create(**request).choices[0].message.content
                content = client.chat.completions.create(**request).choices[0].message.content
                chunks = client.chat.completions.create(**request, stream=True)
                streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                ok += valid(content, schema)
                same += streamed == content
                reused_same += content == cold
                examples.append(content)
                replies.append(content)
            rows.append({"schema": title, "temperature": temperature, "valid": ok, "replies": len(runs),
                         "streamed_equal": same, "warm_equals_cold": reused_same, "example": examples[0]})
            print(rows[-1], flush=True)
    return rows, replies


SPEED_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 300}}},
                "required": ["notes"]}


def reply_rate(client, **extra) -> float:
    """Tokens/s of one streamed reply after its first token."""
    first = usage = None
    stream = client.chat.completions.create(
        model="gpt-3.5-turbo", messages=[{"role": "user", "content": "Write many short notes about the history of bicycles."}],
        max_tokens=128, temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        usage = chunk.usage or usage
    return rate_after_first(usage.completion_tokens, first, time.perf_counter())


def schema_speed(client, rounds: int) -> dict:
    """Median decode tokens/s with SPEED_SCHEMA as response_format against none, the two in turns."""
    constrained = {"response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": SPEED_SCHEMA}}}
    plain, schema = [], []
    for _ in range(rounds):
        plain.append(reply_rate(client))
        schema.append(reply_rate(client, **constrained))
    result = {"rounds": rounds, "plain_tok_s": round(statistics.median(plain), 1),
              "schema_tok_s": round(statistics.median(schema), 1)}
    result["ratio"] = round(result["schema_tok_s"] / result["plain_tok_s"], 3)
    return result


def fastest(work, times: int = 3) -> float:
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def mask_cost(plans_and_texts: list[tuple[str, str]]) -> dict:
    """Median microseconds per token to fill the mask, apply it to fp32 logits and consume the token.

    A grammar's first mask is timed apart: llguidance builds lexer states as it meets them. Applying
    is timed three times per token and the fastest kept: this machine is shared, and a time slice
    lost to another process is not the mask's cost. Filling is timed once (a second fill of the
    same state could be served from llguidance's caches).
    """
    loaded = checkpoint.load(str(checkpoint.resolve(None)))
    tokenizer = loaded.tokenizer
    compiler = Compiler(tokenizer)
    vocab = loaded.model.config.vocab_size
    fill, apply, consume, first = [], [], [], []
    for lark, text in plans_and_texts:
        grammar = compiler.compile(lark)
        logits = torch.randn(vocab)
        for i, token in enumerate(tokenizer(text, add_special_tokens=False)["input_ids"]):
            filled = fastest(grammar.fill_mask, 1)
            applied = fastest(lambda: grammar.apply(logits))
            t0 = time.perf_counter()
            done = grammar.consume(token)
            consumed = time.perf_counter() - t0
            if i == 0:
                first.append(filled + applied + consumed)
                continue
            fill.append(filled)
            apply.append(applied)
            consume.append(consumed)
            if done:
                break
    us = lambda xs: round(statistics.median(xs) * 1e6, 1)  # noqa: E731
    total = [a + b + c for a, b, c in zip(fill, apply, consume)]
    return {"tokens": len(fill), "fill_us": us(fill), "apply_us": us(apply), "consume_us": us(consume), "total_us": us(total),
            "p99_total_us": round(sorted(total)[int(0.99 * (len(total) - 1))] * 1e6, 1), "first_token_us": us(first),
            "grammars": len(first), "vocab": vocab}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="temperature-1.0 runs per row (temperature 0 runs once)")
    parser.add_argument("--out", default="bench/results/structured.json")
    parser.add_argument("--calls-from", help="take the function-call rows from this earlier result instead of rerunning them")
    parser.add_argument("--mask-only", help="take all rows and replies from this earlier result; time the mask only")
    parser.add_argument("--speed-only", action="store_true", help="only decode tokens/s with a schema against none")
    parser.add_argument("--rounds", type=int, default=5, help="turns of the speed comparison")
    args = parser.parse_args()
    if args.speed_only:
        with servers.running() as server:
            client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=600)
            print(describe(), schema_speed(client, args.rounds))
        return
    if args.mask_only:
        earlier = json.loads(Path(args.mask_only).read_text())
        calls, call_texts, formats, format_texts = (earlier[k] for k in ("calls", "call_texts", "formats", "format_texts"))
    else:
        with servers.running() as server:
            client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=600)
            if args.calls_from:
                earlier = json.loads(Path(args.calls_from).read_text())
                calls, call_texts = earlier["calls"], earlier.get("call_texts", [])  # older results kept no texts to replay
            else:
                calls, call_texts = function_rows(client, args.seeds)
            formats, format_texts = format_rows(client, args.seeds)
            speed = schema_speed(client, args.rounds)
    # Replay each reply under its schema's grammar.
    replay = [(f"start: {json_value(f['parameters'])}", text) for f in FUNCTIONS for text in call_texts if valid(text, f["parameters"])]
    replay += [(f"start: {json_value(s)}", text) for s in FORMATS.values() for text in format_texts if valid(text, s)]
    cost = mask_cost(replay)
    print(cost)
    result = {"cpu": describe(), "calls": calls, "formats": formats, "mask": cost, "call_texts": call_texts,
              "format_texts": format_texts, "speed": None if args.mask_only else speed}
    write_results(Path(args.out), result)
    print_tables(result)


def print_tables(result: dict) -> None:
    print(f"\n{result['cpu']}\n")
    print("| function | choice | temperature | valid / calls | example arguments |\n|---|---|---|---|---|")
    for r in result["calls"]:
        print(f"| `{r['function']}` | {r['choice']} | {r['temperature']:g} | {r['valid']} / {r['calls']} | `{r['example']}` |")
    print("\n| response_format schema | temperature | valid / replies | streamed = plain | warm = cold | example |\n|---|---|---|---|---|---|")
    for r in result["formats"]:
        n = r["replies"]
        print(f"| {r['schema']} | {r['temperature']:g} | {r['valid']} / {n} | {r['streamed_equal']} / {n} | {r['warm_equals_cold']} / {n} | `{r['example']}` |")
    m = result["mask"]
    print(f"\nmask per token (median of {m['tokens']}, vocabulary {m['vocab']}): fill {m['fill_us']} us, "
          f"apply {m['apply_us']} us, consume {m['consume_us']} us, total {m['total_us']} us (p99 {m['p99_total_us']} us); "
          f"a grammar's first token: {m['first_token_us']} us (median of {m['grammars']})")
    if result.get("speed"):
        v = result["speed"]
        print(f"decode with a JSON schema active: {v['schema_tok_s']} tok/s against {v['plain_tok_s']} without "
              f"({v['ratio']:.2f}x; median of {v['rounds']} turns each)")


if __name__ == "__main__":
    main()
