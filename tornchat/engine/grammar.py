"""Grammar-constrained decoding: which tokens may come next, through llguidance.

A request's grammar is Lark text in llguidance's dialect (``%json {...}``
embeds a JSON schema) describing all the text the model may generate after
its prompt. Each decode step the matcher fills a bitmask of the tokens that
keep the text inside the grammar; the decode loop sets every other logit to
-inf before the sampler, then hands the sampled token back. When the grammar
is complete and allows nothing more, the generation ends.
"""
import copy
import functools
import json
import re

import llguidance
import numpy as np
import torch
from llguidance import LLMatcher
# numpy's helpers, not llguidance.torch's: that module imports torch._dynamo (and with it Triton) into
# every process that merely imports the engine.
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from tornchat.kernels import stopcheck

# JSON on one line as json.dumps writes it: ", " and ": " and no other
# whitespace, so that a small model cannot run away into blank lines.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_TEXT = r"/(.|\n)*/"


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot enforce, or a token outside the grammar."""


def schema_error(schema: dict) -> str | None:
    """Why llguidance cannot enforce this JSON schema (unknown type, bad $ref, unsupported keyword), or None."""
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)) or None


def json_value(schema: dict) -> str:
    """A Lark expression for one JSON value valid against schema, in JSON_STYLE."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def literal(text: str, special: dict[str, int] | None = None) -> str:
    """A Lark expression for exactly this text.

    ``special``: texts the tokenizer has as special tokens, by id. Those are
    written as the token (``<[id]>``): the tokenizer never spells a special
    token with plain-text tokens, so as text the model could not write them.
    """
    if not special:
        return json.dumps(text)
    parts = re.split("(" + "|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)) + ")", text)
    return " ".join(f"<[{special[part]}]>" if part in special else json.dumps(part) for part in parts if part) or json.dumps("")


def token_pieces(tokenizer) -> list[bytes] | None:
    """Each id's bytes as llguidance takes them (``llguidance.TokenizerWrapper``, told the special ids apart);
    None unless the tokenizer is byte-level BPE and spells a text as itself (no space put before it, as
    SentencePiece's do: llguidance's own reading strips that space from the grammar's texts)."""
    pieces = stopcheck.prompt_bytes(tokenizer)  # the slot pool's, already built; None unless byte-level
    if pieces is None or b"".join(pieces[i] for i in tokenizer.encode("a", add_special_tokens=False)) != b"a":
        return None
    return list(pieces)


class Pieces:
    """A tokenizer as ``llguidance.TokenizerWrapper`` reads one: its pieces and special ids, and encode."""

    def __init__(self, tokenizer, pieces: list[bytes]):
        self.tokens = pieces
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = [i for i, added in tokenizer.added_tokens_decoder.items() if added.special]
        self.encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")  # TokenizerWrapper tries bytes first
        return self.encode(text, add_special_tokens=False)


def vocabulary(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary. From the tokens' pieces where ``token_pieces`` reads them, in about
    half the time of llguidance parsing the tokenizer's JSON (151,936 tokens: 0.46 against 0.83 s); else
    that (without padding or truncation, which would change what llguidance thinks the tokenizer does)."""
    pieces = token_pieces(tokenizer)
    if pieces is None:
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return llguidance.LLTokenizer(backend.to_str(), eos_token=tokenizer.eos_token_id)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Pieces(tokenizer, pieces)))


class Compiler:
    """Grammars for one tokenizer. llguidance's view of the vocabulary is slow to build, so it is built once, and
    large (262,144 tokens: 62 MiB), so not before the first grammar: a server whose requests never ask for one
    never holds it."""

    def __init__(self, tokenizer):
        self.vocabulary_of = tokenizer

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return vocabulary(self.vocabulary_of)

    def compile(self, lark: str) -> "Grammar":
        matcher = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Grammar(matcher, self.tokenizer.vocab_size)


class Grammar:
    """One generation's position in its grammar, and the mask of the tokens allowed next."""

    def __init__(self, matcher: LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = allocate_token_bitmask(1, vocab_size)  # llguidance's: one bit per token
        self.allowed = torch.ones(vocab_size, dtype=torch.bool)  # one bool per token, from the last fill_mask

    def copy(self) -> "Grammar":
        """Another generation's grammar at this one's position (at the start: a fresh one, without compiling again)."""
        return Grammar(self.matcher.deep_copy(), self.vocab_size)

    def fill_mask(self) -> None:
        """Compute the allowed tokens on the CPU (llguidance drops the GIL meanwhile).

        The decode loop calls this right after queueing a forward: on CUDA the
        forward returns before its kernels finish, so the mask is computed
        while they run.
        """
        fill_next_token_bitmask(self.matcher, self.bitmask)
        # One bool per token, unpacked here by numpy on this thread, so that apply is a single torch op
        # (each torch op over the vocabulary is a parallel region, which a busy CPU makes slow).
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        self.allowed = torch.from_numpy(bits.view(np.bool_))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the tokens the grammar does not allow at -inf."""
        allowed = self.allowed[: logits.shape[-1]].to(logits.device, non_blocking=True)
        if allowed.numel() < logits.shape[-1]:  # rows past the tokenizer's vocabulary (padding) are never text
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[-1] - allowed.numel())])
        return torch.where(allowed, logits, float("-inf"))

    def consume(self, token: int) -> bool:
        """Advance past the sampled token; True when the grammar is complete and allows nothing more."""
        if not self.matcher.consume_token(token):
            raise GrammarError(self.matcher.get_error())
        return self.matcher.is_stopped()
