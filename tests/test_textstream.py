"""Incremental detokenization and stop-string hold-back, on SmolLM2's real tokenizer."""
import pytest

from tornchat.engine.textstream import Detokenizer, Outbox, StopMatcher
from tornchat.engine.types import TokenLogprob


@pytest.mark.parametrize("text", ["你好，世界！这是一个测试。", "emoji 🙂👍🏽 and 🇫🇷 flags", "naïve café — ünïcödé", "  spaces   kept\nand\tnewlines"])
def test_detokenizer_streams_exact_text_without_broken_characters(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_holds_partial_utf8_until_complete(tokenizer):
    ids = tokenizer("🙂", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits the emoji
    detok = Detokenizer(tokenizer)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🙂"


def test_detokenizer_keeps_only_the_special_tokens_asked_for(marker_tokenizer):
    tok = marker_tokenizer
    ids = tok('Hi<|im_end|><|python_tag|>{"a": 1}[TOOL_CALLS]<|endoftext|> bye', add_special_tokens=False)["input_ids"]
    tag = tok.convert_tokens_to_ids("<|python_tag|>")
    assert tag in ids and tok.convert_tokens_to_ids("[TOOL_CALLS]") in ids  # each marker one special token
    kept = Detokenizer(tok, frozenset({tag}))
    assert "".join(kept.push(i) for i in ids) == 'Hi<|python_tag|>{"a": 1} bye'
    skipped = Detokenizer(tok)
    assert "".join(skipped.push(i) for i in ids) == tok.decode(ids, skip_special_tokens=True) == 'Hi{"a": 1} bye'


def test_tokens_without_text_still_send_their_logprobs(tokenizer):
    """A reply whose last tokens write no text (skipped special tokens, half a character) ends with an event
    that carries their ids and logprobs: a stream's logprobs count what its usage counts."""
    events = []
    outbox = Outbox(tokenizer, frozenset(), (), events.append)
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    half_emoji = tokenizer("🙂", add_special_tokens=False)["input_ids"][0]
    hi = tokenizer("Hi", add_special_tokens=False)["input_ids"]
    ids = hi + [special, half_emoji]
    for i in ids:
        outbox.push(i, TokenLogprob(token_id=i, logprob=-1.0))
        if i == hi[-1]:
            outbox.send()
    outbox.close(hit_stop_string=False)
    assert "".join(e.text for e in events) == "Hi"
    assert [i for e in events for i in e.token_ids] == ids
    assert [lp.token_id for e in events for lp in e.logprobs] == ids


def feed(matcher, pieces):
    out, hit = [], False
    for piece in pieces:
        text, hit = matcher.push(piece)
        out.append(text)
        if hit:
            break
    return out, hit


def test_stop_string_split_across_pieces_is_never_emitted():
    out, hit = feed(StopMatcher(("STOP",)), ["hello S", "T", "OP and more"])
    assert hit
    assert "".join(out) == "hello "
    assert out == ["hello ", "", ""]


def test_hold_back_only_what_could_start_a_stop_string():
    matcher = StopMatcher(("\n\nUser:",))
    assert matcher.push("abc\n") == ("abc", False)  # "\n" may begin the stop string
    assert matcher.push("x") == ("\nx", False)  # no longer can: released at once
    assert matcher.push("plain") == ("plain", False)


def test_earliest_of_several_stop_strings_wins_and_flush_releases_held_text():
    out, hit = feed(StopMatcher(("world", "lo w")), ["hello world"])
    assert hit and "".join(out) == "hel"
    matcher = StopMatcher(("xyz",))
    assert matcher.push("abcx") == ("abc", False)
    assert matcher.flush() == "x"


def test_empty_stop_strings_are_ignored():
    assert StopMatcher(("",)).push("text") == ("text", False)
