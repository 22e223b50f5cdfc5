"""One answer per request: the same greedy or seeded request gives the same text whatever path it takes.

Against the real server on the embedded model, with speculation on: each prompt is sent cold, again (its
prompt now in a KV slot, only the last token prefilled), streamed, after a longer conversation that shares
its prefix (the slot cut back to it), with its own reply as the `prediction` (drafts verified in one
forward), four times at once (queued behind each other), and seeded at temperature 0.8 twice. Every row of
the model is computed by kernels that give it the same bits however it arrives (csrc/blocks.cpp,
fused.cpp's attend), so these texts are equal by construction; a difference is a bug, on any CPU.
"""
import json
import threading

import openai
import pytest

from bench import servers

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


@pytest.fixture(scope="module")
def server():
    # Two KV slots for twelve prompts: a prompt sent again later has usually lost its slot, a cold send again.
    with servers.running("--speculate", "lookup", "--kv-slots", "2") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def ask(client, messages, **options) -> str:
    options = {"temperature": 0, "max_tokens": MAX_TOKENS, **options}
    reply = client.chat.completions.create(model="m", messages=messages, **options)
    return reply.choices[0].message.content


def streamed(client, messages, **options) -> str:
    options = {"temperature": 0, "max_tokens": MAX_TOKENS, **options}
    stream = client.chat.completions.create(model="m", messages=messages, stream=True, **options)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def concurrently(client, messages, count: int) -> list[str]:
    texts = [None] * count

    def send(i: int) -> None:
        texts[i] = ask(client, messages)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return texts


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p[:24] for p in PROMPTS])
def test_every_path_gives_the_first_text(client, server, prompt):
    messages = [{"role": "user", "content": prompt}]
    first = ask(client, messages)
    assert first
    texts = {
        "again": ask(client, messages),
        "streamed": streamed(client, messages),
        "with its reply as the prediction": ask(client, messages, prediction={"type": "content", "content": first}),
    }
    longer = messages + [{"role": "assistant", "content": first}, {"role": "user", "content": "Say it again."}]
    ask(client, longer)  # the slot now holds a longer conversation with the same prefix
    texts["after a longer conversation"] = ask(client, messages)
    texts |= {f"at once, {i + 1} of 4": text for i, text in enumerate(concurrently(client, messages, 4))}
    for path, text in texts.items():
        assert text == first, path
    seeded = [ask(client, messages, **SEEDED), streamed(client, messages, **SEEDED)]
    ask(client, longer)
    seeded.append(ask(client, messages, **SEEDED))
    assert seeded[1:] == seeded[:1] * 2


def test_a_prediction_of_the_reply_is_drafted_and_accepted(client):
    """--speculate lookup with the reply itself as the prediction: drafts from the first step, none rejected.

    How long each draft is depends on the verify costs this machine measured; that every verify drafts at
    least one token of a matching prediction does not (speculate.Drafter.propose). The first token comes
    from the prefill's logits, each verify after it then gives two tokens or more, and only one at the last
    step drafts nothing: at least (n - 2) // 2 drafts accepted in a reply of n tokens. Longer drafts at known
    costs: tests/test_speculate.py."""
    messages = [{"role": "user", "content": PROMPTS[5]}]
    first = ask(client, messages, max_tokens=48)
    reply = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=48,
                                           prediction={"type": "content", "content": first})
    details = reply.usage.completion_tokens_details
    assert reply.choices[0].message.content == first
    assert details.rejected_prediction_tokens == 0, json.dumps(reply.usage.model_dump())
    assert details.accepted_prediction_tokens >= (reply.usage.completion_tokens - 2) // 2, json.dumps(reply.usage.model_dump())
