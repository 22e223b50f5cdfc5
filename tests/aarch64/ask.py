"""serve.sh's requests to a tornchat server, under qemu or not (python3's standard library only): one answer per
request (greedy: plain, again from its KV slot, and streamed; seeded: twice), two more greedy questions, a structured
output, a forced tool call and a bad field's 400. Prints the replies' texts as JSON (the same on every CPU); exits 1
where a check fails.

    python3 ask.py PORT
"""
import json
import sys
import time
import urllib.error
import urllib.request

BASE = f"http://127.0.0.1:{sys.argv[1]}"
COOK = [{"role": "user", "content": "Give me a short tip for learning to cook"}]


def post(body: dict, stream: bool = False):
    request = urllib.request.Request(f"{BASE}/v1/chat/completions", json.dumps({"model": "m", **body}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as reply:
        if not stream:
            return json.load(reply)
        deltas = [json.loads(line[6:]) for line in reply.read().decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])


def text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


for _ in range(900):  # a first start under qemu: minutes
    try:
        urllib.request.urlopen(f"{BASE}/v1/models", timeout=5).close()
        break
    except (urllib.error.URLError, OSError):
        time.sleep(1)
else:
    sys.exit("the server did not start")

failures = []
greedy = text(post({"messages": COOK, "temperature": 0, "max_tokens": 24}))
again = text(post({"messages": COOK, "temperature": 0, "max_tokens": 24}))
streamed = post({"messages": COOK, "temperature": 0, "max_tokens": 24, "stream": True}, stream=True)
if not greedy or again != greedy or streamed != greedy:
    failures.append(f"greedy {greedy!r}, again {again!r}, streamed {streamed!r}")
plain = [text(post({"messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 24}))
         for question in ("What is the capital of France?", "Explain recursion in one sentence.")]
haiku = {"messages": [{"role": "user", "content": "Write a haiku"}], "temperature": 0.8, "seed": 7, "max_tokens": 16}
seeded = [text(post(haiku)) for _ in range(2)]
if seeded[0] != seeded[1]:
    failures.append(f"seeded {seeded}")
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
person = text(post({"messages": [{"role": "user", "content": "Give a person's name and age as JSON"}],
                    "temperature": 0, "max_tokens": 40,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}))
parsed = json.loads(person)
if set(parsed) != {"name", "age"} or not isinstance(parsed["name"], str) or not isinstance(parsed["age"], int):
    failures.append(f"structured {person!r}")
tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
message = post({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "temperature": 0,
                "max_tokens": 40, "tools": [tool], "tool_choice": "required"})["choices"][0]["message"]
calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
if not calls or calls[0][0] != "get_weather" or not isinstance(calls[0][1].get("city"), str):
    failures.append(f"tool calls {message}")
try:
    post({"messages": COOK, "temperature": "hot"})
    failures.append("temperature 'hot' accepted")
except urllib.error.HTTPError as error:
    if error.code != 400 or "temperature" not in error.read().decode():
        failures.append(f"temperature 'hot': {error.code}")

print(json.dumps({"greedy": greedy, "plain": plain, "seeded": seeded[0], "structured": person, "tool_calls": calls}, indent=1))
for failure in failures:
    print("FAILED:", failure, file=sys.stderr)
sys.exit(1 if failures else 0)
