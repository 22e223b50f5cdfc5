"""One answer per request: how many sends of the same request give its first send's text, by path.

Against a tornchat server (--speculate lookup, two KV slots, so that a
prompt sent again later has usually lost its slot): each of twelve prompts
is sent cold, again, streamed, with its own reply as the `prediction`
(drafts verified in one forward), after a longer conversation that shares
its prefix (the slot cut back to it), four times at once, and seeded at
temperature 0.8 three times (plain, streamed, after the longer
conversation). The test tests/test_server_one_answer.py asserts the same
paths on the embedded model; this counts them on any model and any
instruction-set path (--isa sets TORNCHAT_ISA for the server), as the "One
answer per request" issue reports them.

    python -m bench.one_answer [--checkpoint-path FILE.gguf] [--isa avx2] [--threads 2]

Prints one line per prompt and the total; the CPU it ran on comes first.
"""
import argparse
import sys
import threading

import openai

from bench import servers
from tornchat.engine.cpu import describe

PROMPTS = [
    "Give me a short tip for learning to cook.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain why the sky is blue in one sentence.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Name a famous painting and its painter.",
    "What does a compiler do?",
    "Suggest a name for a grey cat.",
    "Why do leaves change colour in autumn?",
    # Longer than one 512-token prefill chunk: a cold send prefills two chunks, a cached one none of them.
    "Summarize this list in one sentence: " + " ".join(f"item {i} is a red box on shelf {i % 7}." for i in range(70)),
    "Which shelf holds item 9? " + " ".join(f"Item {i} sits on shelf {i % 5}." for i in range(90)),
]
MAX_TOKENS = 24
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
SERVER_FLAGS = ("--speculate", "lookup", "--kv-slots", "2")


def ask(client: openai.OpenAI, messages: list[dict], **options) -> str:
    options = {"temperature": 0, "max_tokens": MAX_TOKENS, **options}
    reply = client.chat.completions.create(model="m", messages=messages, **options)
    return reply.choices[0].message.content


def streamed(client: openai.OpenAI, messages: list[dict], **options) -> str:
    options = {"temperature": 0, "max_tokens": MAX_TOKENS, **options}
    stream = client.chat.completions.create(model="m", messages=messages, stream=True, **options)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def concurrently(client: openai.OpenAI, messages: list[dict], count: int) -> list[str]:
    texts = [None] * count

    def send(i: int) -> None:
        texts[i] = ask(client, messages)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return texts


def sends(client: openai.OpenAI, prompt: str) -> tuple[dict[str, str], dict[str, str]]:
    """One prompt through every path: (greedy texts, seeded texts), each by path, the first send's first."""
    messages = [{"role": "user", "content": prompt}]
    first = ask(client, messages)
    greedy = {
        "cold": first,
        "again": ask(client, messages),
        "streamed": streamed(client, messages),
        "with its reply as the prediction": ask(client, messages, prediction={"type": "content", "content": first}),
    }
    longer = messages + [{"role": "assistant", "content": first}, {"role": "user", "content": "Say it again."}]
    ask(client, longer)  # the slot now holds a longer conversation with the same prefix
    greedy["after a longer conversation"] = ask(client, messages)
    greedy |= {f"at once, {i + 1} of 4": text for i, text in enumerate(concurrently(client, messages, 4))}
    seeded = {"seeded": ask(client, messages, **SEEDED), "seeded, streamed": streamed(client, messages, **SEEDED)}
    ask(client, longer)
    seeded["seeded, after a longer conversation"] = ask(client, messages, **SEEDED)
    return greedy, seeded


def differing(texts: dict[str, str]) -> list[str]:
    """The paths whose text is not the first path's."""
    first = next(iter(texts.values()))
    return [path for path, text in texts.items() if text != first]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-path", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--isa", help="the block kernels' instruction-set path (TORNCHAT_ISA), e.g. avx2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    flags = [*SERVER_FLAGS, "--threads", str(args.threads)]
    if args.checkpoint_path:
        flags += ["--checkpoint-path", args.checkpoint_path]
    print(f"CPU: {describe()}\nmodel: {args.checkpoint_path or 'the embedded model'}, path: {args.isa or 'the best'}")
    equal = total = 0
    with servers.running(*flags, env={"TORNCHAT_ISA": args.isa} if args.isa else None) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
        for prompt in PROMPTS:
            greedy, seeded = sends(client, prompt)
            wrong = differing(greedy) + differing(seeded)
            count = len(greedy) + len(seeded)
            equal, total = equal + count - len(wrong), total + count
            print(f"{prompt[:40]!r}: {count - len(wrong)} of {count}" + (f" (differ: {', '.join(wrong)})" if wrong else ""),
                  flush=True)
    print(f"\n{equal} of {total} sends gave their first send's text ({100 * equal / total:.0f}%)")
    return 0 if equal == total else 1


if __name__ == "__main__":
    sys.exit(main())
