"""The stop-check kernel (through Triton's interpreter) against the plain-Python matcher and decoded text."""
import os

import torch

# Compiled kernel on a GPU; elsewhere Triton's interpreter runs it on CPU
# tensors. The interpreter is chosen at @triton.jit, so before kernel imports.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

from tornchat.kernels import stopcheck_triton as kernel  # noqa: E402
from tornchat.kernels.stopcheck import build_stop_table, stop_check, stop_hit_reference, token_bytes  # noqa: E402

TOY_VOCAB = (
    b"s", b"t", b"o", b"p", b"st", b"op", b"sto", b"pper", b"las", b"topper",
    b"opera", b"to", b"pped", b"xstopy", b"", b"a", b"ps", b"\xc3", b"\xa9", b"\xc3\xa9!",
)  # fmt: skip


def windows(table, rows, vocab_size, seed):
    """Random windows, some starting with -1 padding (the first tokens of a generation)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        pad = rng.choice([0, 0, 0, 1, table.window - 1])
        out.append([-1] * pad + [rng.randrange(vocab_size) for _ in range(table.window - pad)])
    return torch.tensor(out, device=DEVICE)


def test_kernel_agrees_with_the_matcher_on_random_streams():
    table = build_stop_table(TOY_VOCAB, ["stop", "pp", "é!", "sts"], eos_ids=[14], device=DEVICE)
    window = windows(table, 250, len(TOY_VOCAB), seed=0)
    expected = [stop_hit_reference(row, table) for row in window.tolist()]
    assert 0.1 < sum(expected) / len(expected) < 0.9  # both outcomes well represented
    assert kernel.stop_check(window, table).tolist() == expected


def test_matcher_examples():
    table = build_stop_table(TOY_VOCAB, ["stop"], eos_ids=[15])
    ids = {piece: i for i, piece in enumerate(TOY_VOCAB)}

    def hit(*pieces):
        return stop_hit_reference([-1] * 2 + [ids[p] for p in pieces], table)

    # Overhangs off either end, and a stop string inside one token, all match...
    assert hit(b"st", b"op") and hit(b"las", b"topper") and hit(b"s", b"to", b"pped") and hit(b"xstopy")
    # ...an empty token in between changes nothing...
    assert hit(b"st", b"", b"op")
    # ...but not once the stop string lies wholly before the newest token, or across padding.
    assert not hit(b"st", b"op", b"opera") and not stop_hit_reference([ids[b"st"], -1, ids[b"op"]], table)
    assert hit(b"a") is True  # EOS


@pytest.mark.parametrize("stops", [["Observation:"], ["\n\nUser", "END", "é"], [" the", "stop here"]])
def test_kernel_and_matcher_find_stop_strings_in_real_tokenizations(tokenizer, stops):
    """On SmolLM2 tokenizations, both flag exactly the tokens whose decoded text completes a stop string."""
    vocab = token_bytes(tokenizer)
    table = build_stop_table(vocab, stops, [tokenizer.eos_token_id], device=DEVICE)
    texts = [
        f"Thought: I need a tool.\nAction: search\nAction Input: weather{stops[0]} sunny",
        f"plain words then {stops[-1]}and more",
        "nothing here matches at all, café!",
    ]
    rows, expected = [], []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        before = ""
        for n in range(1, len(ids) + 1):
            after = tokenizer.decode(ids[:n], skip_special_tokens=True)
            # A stop string completed by token n: found in the text, but not wholly in the text before it.
            expected.append(any(after.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in stops))
            rows.append(([-1] * table.window + ids[:n])[-table.window :])
            before = after
    assert sum(expected) >= 2
    assert [stop_hit_reference(row, table) for row in rows] == expected
    assert kernel.stop_check(torch.tensor(rows, device=DEVICE), table).tolist() == expected


def test_eos_finishes_on_every_path(tokenizer):
    """The matcher for CPU tensors, the kernel directly, and whatever stop_check dispatches to on DEVICE."""
    table = build_stop_table(token_bytes(tokenizer), [], [tokenizer.eos_token_id])
    window = torch.tensor([[-1, tokenizer.eos_token_id], [tokenizer.eos_token_id, 5]])
    assert stop_check(window, table).tolist() == [True, False]
    device_table = build_stop_table(token_bytes(tokenizer), [], [tokenizer.eos_token_id], device=DEVICE)
    assert kernel.stop_check(window.to(DEVICE), device_table).tolist() == [True, False]
    assert stop_check(window.to(DEVICE), device_table).tolist() == [True, False]


def test_table_limits():
    with pytest.raises(ValueError):
        build_stop_table(TOY_VOCAB, ["a", "b", "c", "d", "e"], [])
    with pytest.raises(ValueError):
        build_stop_table(TOY_VOCAB, ["x" * 64], [])


def test_spellings_are_each_pieces_bytes_or_its_text_where_it_leaves_the_byte_alphabet():
    """The whole vocabulary translated at once gives what each id gives alone: a piece's characters as the bytes
    of the byte-level alphabet, or, where one is outside it (a special token with a space or a full-width bar),
    the token's text."""
    import copy

    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # transformers' alphabet, not ours

    from tornchat import checkpoint
    from tornchat.kernels.stopcheck import spellings
    from tornchat.weights import gguf_file

    tokenizer = copy.deepcopy(checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(checkpoint.default_gguf_path())))
    tokenizer.backend_tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                                    for token in ("<｜begin▁of▁sentence｜>", "<tool call>")])
    byte_of = {ch: byte for byte, ch in bytes_to_unicode().items()}
    expected = []
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        inside = all(ch in byte_of for ch in piece)
        expected.append(bytes(byte_of[ch] for ch in piece) if inside else tokenizer.decode([token_id]).encode())
    got = spellings(tokenizer)
    assert list(got) == expected
    assert got[-2:] == ("<｜begin▁of▁sentence｜>".encode(), b"<tool call>")
    assert got[tokenizer.convert_tokens_to_ids("Ġthe")] == b" the"
