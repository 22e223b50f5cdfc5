"""Plain data passed between the server and the engine."""
from dataclasses import dataclass, field

from tornchat.engine.grammar import Grammar


class QueueFull(Exception):
    """The FIFO of waiting requests is at its bound."""


class PromptTooLong(ValueError):
    """The prompt leaves no room for a new token under max_length or the context.

    Carries the numbers, so that each API can word the error its own way
    (agents show it to the user, and some act on it: compacting the history).
    """

    def __init__(self, prompt_tokens: int, context_length: int, max_length: int | None = None):
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.max_length = max_length
        if max_length is not None and max_length < context_length:
            limit = f"max_length {max_length} (the model's context is {context_length} tokens)"
        else:
            limit = f"the model's context of {context_length} tokens"
        super().__init__(
            f"the prompt has {prompt_tokens} tokens, which leaves no room for a reply within {limit}; "
            "shorten the conversation"
        )


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    # The logits processors' request fields (engine/processors.py) that the request sets, name -> value;
    # one left out has its neutral value. Validation keeps only values away from neutral.
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Thinking:
    """A reply that may think first (engine/thinking.py): where it starts, and how long it may think."""

    inside: bool  # the prompt ends with an opened <think>: the reply starts in the thinking
    budget: int | None = None  # thinking tokens allowed before the loop closes it; None: no bound


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # new tokens (OpenAI)
    max_length: int | None = None  # prompt + new tokens (spec); the tighter bound wins
    stop: tuple[str, ...] = ()  # up to 4 strings, matched on decoded text
    logprobs: int | None = None  # None: none computed; n: each token's logprob and the n most likely
    grammar: Grammar | None = None  # constrains the generated text (structured outputs, function calls)
    prediction_ids: list[int] = field(default_factory=list)  # text the reply is expected to repeat (drafts)
    keep_special: frozenset[int] = frozenset()  # special tokens decoded into the text (a tool-call format's markers)
    thinking: Thinking | None = None  # None: the reply is all answer, nothing to count or force


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from a KV slot instead of prefilled
    accepted_prediction_tokens: int = 0  # drafted tokens the sampler confirmed (speculation)
    rejected_prediction_tokens: int = 0  # drafted tokens it did not
    reasoning_tokens: int = 0  # of completion_tokens, those of the thinking (tags included)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token under the model's own distribution: log_softmax of the raw logits."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Event:
    """One message from the worker: new text, and on the last one the outcome.

    ``text`` is safe to show: it never holds a broken UTF-8 character or the
    start of a stop string that may still complete. The last event of a
    generation has ``finish_reason`` ("stop" or "length") and ``usage``, or
    ``error`` if the generation failed.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked
    finish_reason: str | None = None
    usage: Usage | None = None
    error: BaseException | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None
