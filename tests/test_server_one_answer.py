"""One answer per request: the same greedy or seeded request gives the same text whatever path it takes.

Against the real server on the embedded model, with speculation on, the paths of bench/one_answer.py (which
counts them on any model and instruction-set path): each prompt is sent cold, again (its prompt now in a KV
slot, only the last token prefilled), streamed, with its own reply as the `prediction` (drafts verified in
one forward), after a longer conversation that shares its prefix (the slot cut back to it), four times at
once (decoded together), and seeded at temperature 0.8 three times. Every row of the model is computed by
kernels that give it the same bits however it arrives (csrc/blocks/, csrc/attention.cpp), so these texts
are equal by construction; a difference is a bug, on any CPU.
"""
import json

import openai
import pytest

from bench import servers
from bench.one_answer import PROMPTS, SERVER_FLAGS, ask, differing, sends


@pytest.fixture(scope="module")
def server():
    # Two KV slots for twelve prompts: a prompt sent again later has usually lost its slot, a cold send again.
    with servers.running(*SERVER_FLAGS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p[:24] for p in PROMPTS])
def test_every_path_gives_the_first_text(client, prompt):
    greedy, seeded = sends(client, prompt)
    assert greedy["cold"]
    assert differing(greedy) == [], {path: text for path, text in greedy.items()}
    assert differing(seeded) == [], {path: text for path, text in seeded.items()}


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
