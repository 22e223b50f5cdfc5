"""Stop checks on the device: did the newest token finish the row?

A row is finished when its newest token is an EOS id, or when a stop string
occurs in the bytes of the generated tokens and that occurrence ends inside
the newest token (so the check after every token catches each stop string
exactly once, at the token that completes it). The host still trims the text
at the stop string; this flag only lets a GPU decode loop run several steps
between host synchronisations.

The kernel input is a window of the last ``table.window`` generated ids per
row, left-padded with -1 (nothing before the first generated token counts).
The table is built once per request from the tokenizer (transformers'
StopStringCriteria idea, in bitmasks): with j = bytes of stop string s
already matched from its end, and b a token's bytes,

- final[s, b]: bit j (1 <= j < len(s)) if b starts with the last j bytes of
  s; bit 0 if s lies wholly inside b, or b is an EOS id;
- cont[s, b]: bit j if b is the len(b) bytes of s just before its last j
  bytes and does not reach the start of s (then j becomes j + len(b));
- done[s, b]: bit j if b ends with the first len(s) - j bytes of s.

A token with no bytes (a special token) passes every j through unchanged.

Walking back from the newest token, the set of possible j is one int64.
"""
import bisect
import functools
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tornchat.kernels import dispatch

MAX_STOP_STRINGS = 4
MAX_STOP_BYTES = 63  # one bit per matched length in an int64


@dataclass(frozen=True)
class StopTable:
    vocab: tuple[bytes, ...]  # bytes of each token id, as the host's text sees them
    stops: tuple[bytes, ...]
    eos_ids: frozenset[int]
    final: torch.Tensor  # [max(1, len(stops)), V] int64
    cont: torch.Tensor  # [same] int64
    done: torch.Tensor  # [same] int64
    length: torch.Tensor  # [V] int32, bytes per token
    window: int  # ids per row the check needs: a stop string spans at most this many tokens


@functools.lru_cache(maxsize=4)
def token_bytes(tokenizer) -> tuple[bytes, ...]:
    """Bytes each id adds to the text the host decodes (skip_special_tokens=True): b"" for special tokens."""
    special = set(tokenizer.all_special_ids)
    return tuple(b"" if token_id in special else spelled for token_id, spelled in enumerate(spellings(tokenizer)))


def prompt_bytes(tokenizer) -> tuple[bytes, ...] | None:
    """Bytes each id stands for in rendered prompt text, special tokens as their own text.

    None unless the tokenizer is byte-level: elsewhere one id decoded alone
    may not spell exactly what it adds in context (SentencePiece spaces).
    """
    return spellings(tokenizer) if _byte_level_decoder(tokenizer) is not None else None


OUTSIDE = "\U0010ffff"  # stands for a character outside the byte-level alphabet


class _Latin1(dict):
    """str.translate's table: each byte-level alphabet character to the latin-1 character of its byte, any
    other to OUTSIDE."""

    def __missing__(self, code: int) -> str:
        return OUTSIDE


@functools.lru_cache(maxsize=4)
def spellings(tokenizer) -> tuple[bytes, ...]:
    """The bytes each id spells alone: its piece's bytes in a byte-level alphabet, else (special tokens with
    other characters, other tokenizers) its text decoded alone."""
    pieces = [piece or "" for piece in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
    byte_decoder = _byte_level_decoder(tokenizer)
    if byte_decoder is None:
        return tuple(tokenizer.decode([i], skip_special_tokens=False).encode() if piece else b""
                     for i, piece in enumerate(pieces))
    # The whole vocabulary in one translation and one encoding, not character by character in Python (a
    # 262,144-token vocabulary: 0.24 s, on a start's path).
    mapped = "".join(pieces).translate(_Latin1({ord(ch): chr(byte) for ch, byte in byte_decoder.items()}))
    spelled = mapped.encode("latin-1", errors="replace")
    ends = list(itertools.accumulate(map(len, pieces)))
    vocab = [spelled[end - len(piece) : end] for piece, end in zip(pieces, ends)]
    for at in {bisect.bisect_right(ends, match.start()) for match in re.finditer(OUTSIDE, mapped)}:
        vocab[at] = tokenizer.decode([at], skip_special_tokens=False).encode()
    return tuple(vocab)


def _byte_level_decoder(tokenizer) -> dict[str, int] | None:
    """GPT-2 style byte-level BPE spells each byte as one printable character; None for other tokenizers."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or "ByteLevel" not in repr(decoder):
        return None
    from tornchat.weights.gguf_tokenizer import bytes_to_unicode

    return {ch: byte for byte, ch in bytes_to_unicode().items()}


def _masks(vocab: Sequence[bytes], stop: bytes) -> tuple[list[int], list[int], list[int]]:
    n = len(stop)
    final, cont, done = [0] * len(vocab), [0] * len(vocab), [0] * len(vocab)
    stop_bytes = set(stop)
    for token_id, b in enumerate(vocab):
        m = len(b)
        if not m:  # adds no text: the match passes through unchanged
            cont[token_id] = (1 << n) - 2
            continue
        f = 1 if stop in b else 0
        if b[0] in stop_bytes:
            for j in range(1, min(m, n - 1) + 1):
                if b.startswith(stop[n - j :]):
                    f |= 1 << j
        final[token_id] = f
        if b[-1] not in stop_bytes:
            continue
        start = stop.find(b, 1)
        while start >= 0:
            if start + m < n:  # leaves n - start - m >= 1 matched bytes after b
                cont[token_id] |= 1 << (n - start - m)
            start = stop.find(b, start + 1)
        for rest in range(1, min(m, n - 1) + 1):
            if b.endswith(stop[:rest]):
                done[token_id] |= 1 << (n - rest)
    return final, cont, done


@functools.lru_cache(maxsize=16)
def _tables(vocab: tuple[bytes, ...], stops: tuple[bytes, ...], eos_ids: frozenset[int]):
    rows = [_masks(vocab, stop) for stop in stops] or [([0] * len(vocab), [0] * len(vocab), [0] * len(vocab))]
    final, cont, done = (torch.tensor([r[i] for r in rows], dtype=torch.int64) for i in range(3))
    for token_id in eos_ids:
        final[:, token_id] |= 1
    length = torch.tensor([len(b) for b in vocab], dtype=torch.int32)
    return final, cont, done, length


def build_stop_table(vocab: tuple[bytes, ...], stops: Sequence[str], eos_ids, device="cpu") -> StopTable:
    """The per-request table: at most 4 stop strings of at most 63 UTF-8 bytes each."""
    encoded = tuple(dict.fromkeys(s.encode() for s in stops if s))
    if len(encoded) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_BYTES for s in encoded):
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_BYTES} bytes each")
    eos = frozenset(int(t) for t in eos_ids)
    final, cont, done, length = _tables(vocab, encoded, eos)
    return StopTable(
        vocab=vocab,
        stops=encoded,
        eos_ids=eos,
        final=final.to(device),
        cont=cont.to(device),
        done=done.to(device),
        length=length.to(device),
        window=max((len(s) for s in encoded), default=1),
    )


def stop_hit_reference(window: Sequence[int], table: StopTable) -> bool:
    """Plain-Python matcher on one row's window of ids (-1 = before the first generated token)."""
    ids = list(window)
    if not ids or ids[-1] < 0:
        return False
    if ids[-1] in table.eos_ids:
        return True
    if -1 in ids:
        ids = ids[len(ids) - ids[::-1].index(-1) :]
    text = b"".join(table.vocab[t] for t in ids)
    newest_start = len(text) - len(table.vocab[ids[-1]])
    # An occurrence must end inside the newest token: start + len(s) > newest_start.
    return any(text.find(s, max(0, newest_start - len(s) + 1)) >= 0 for s in table.stops)


def stop_check(window: torch.Tensor, table: StopTable) -> torch.Tensor:
    """Finished flags [B] bool for windows [B, table.window] of int64 ids, on the window's device.

    CUDA tensors (or TORNCHAT_TRITON_INTERPRET=1) take the Triton kernel,
    which needs no host synchronisation; elsewhere the plain-Python matcher.
    """
    if dispatch.use_triton(window):
        return dispatch.triton_module("stopcheck_triton").stop_check(window, table)
    return torch.tensor([stop_hit_reference(row, table) for row in window.tolist()], dtype=torch.bool)
