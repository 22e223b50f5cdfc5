"""Grammar-constrained decoding: which tokens may come next, through llguidance.

A request's grammar is Lark text in llguidance's dialect (``%json {...}``
embeds a JSON schema) describing all the text the model may generate after
its prompt. Each decode step the matcher fills a bitmask of the tokens that
keep the text inside the grammar; the decode loop sets every other logit to
-inf before the sampler, then hands the sampled token back. When the grammar
is complete and allows nothing more, the generation ends.
"""
import json

import llguidance.hf
import torch
from llguidance import LLMatcher
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

# JSON on one line as json.dumps writes it: ", " and ": " and no other
# whitespace, so that a small model cannot run away into blank lines.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_TEXT = r"/(.|\n)*/"

# Bit i of a mask word, as int32 (bit 31 is the sign bit).
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot enforce, or a token outside the grammar."""


def schema_error(schema: dict) -> str | None:
    """Why llguidance cannot enforce this JSON schema (unknown type, bad $ref, unsupported keyword), or None."""
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)) or None


def json_value(schema: dict) -> str:
    """A Lark expression for one JSON value valid against schema, in JSON_STYLE."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def literal(text: str) -> str:
    """A Lark string literal for exactly this text."""
    return json.dumps(text)


class Compiler:
    """Grammars for one tokenizer. llguidance's view of the vocabulary takes about 0.5 s to build, so once."""

    def __init__(self, tokenizer):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)

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
        # Pinned where CUDA is present, so the copy to the device does not wait for the host.
        self.bitmask = allocate_token_bitmask(1, vocab_size)
        self.bits = _BITS  # moved to the logits' device once

    def fill_mask(self) -> None:
        """Compute the allowed tokens on the CPU (llguidance drops the GIL meanwhile).

        The decode loop calls this right after queueing a forward: on CUDA the
        forward returns before its kernels finish, so the mask is computed
        while they run.
        """
        fill_next_token_bitmask(self.matcher, self.bitmask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the tokens the grammar does not allow at -inf."""
        if self.bits.device != logits.device:
            self.bits = _BITS.to(logits.device)
        # The copy is ordered before the sampler's kernels; the sampled token's readback then waits for both,
        # so the next fill_mask never overwrites words still on their way.
        words = self.bitmask[0].to(logits.device, non_blocking=True)
        allowed = (words[:, None] & self.bits).ne(0).flatten()[: min(self.vocab_size, logits.shape[-1])]
        if allowed.numel() < logits.shape[-1]:  # rows past the tokenizer's vocabulary (padding) are never text
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[-1] - allowed.numel())])
        return logits.masked_fill(~allowed, float("-inf"))

    def consume(self, token: int) -> bool:
        """Advance past the sampled token; True when the grammar is complete and allows nothing more."""
        if not self.matcher.consume_token(token):
            raise GrammarError(self.matcher.get_error())
        return self.matcher.is_stopped()
