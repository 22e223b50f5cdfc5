"""Logits processors: what the decode loop does to the logits between the forward and the sampler.

Each processor is one record in PROCESSORS: its name, its request fields
(kind, range, neutral value, one line of doc), its stage, its function and
what of the row's Context the function needs.
Validation (server/validate.py), the OpenAPI document (server/openapi.py),
the /metrics labels (server/metrics.py) and the Chooser (choose.py) read
the records; adding a processor is its function and its record here, its
tests, and its fields' rows in docs/api.md (a test holds them to the
records' doc lines).

A function is ``f(logits, **fields, **needs) -> logits``: ``logits`` are the
fp32 logits [V] of the next token, ``fields`` the values of its request
fields (the neutral one where the request left a field out), ``needs`` what
it declares of the row's Context (the history, the tokenizer, the
temperature, the seed and the token's index in the reply). It returns new
logits and never writes into the ones it got: the decode loop may still
read them. A processor none of whose fields a request sets away from neutral
does not run, so a request that sets nothing pays nothing.

Stages, in the Chooser's order, after the forward and the log-probabilities
the reply reports (those are of the raw logits):

- BEFORE_MASK: penalties and biases, which move logits.
- (the grammar mask, where a request constrains its output)
- AFTER_MASK: truncations, defined on the tempered distribution
  ``softmax(logits / temperature)``: they must see the mask (applied before
  it, one could leave only tokens the grammar then forbids), and greedy rows
  skip them: a greedy request asks for the most likely token, whatever they
  would keep of the rest (XTC would even drop it).
- then the sampler (kernels/sampling.py): temperature, top-k, top-p, draw.
"""
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tornchat.engine.types import SamplingParams
from tornchat.kernels.sampling import GREEDY_TEMPERATURE
from tornchat.kernels.stopcheck import spellings

BEFORE_MASK, AFTER_MASK = "before the grammar mask", "after the grammar mask"
# DRY follows a repeat back this far at most (as text-generation-webui): bounds its work a step, and the penalty.
DRY_LONGEST_MATCH = 50
# Kinds of request field: how validation reads one and how the OpenAPI document describes it.
NUMBER, INTEGER, STRINGS, BIAS = "number", "integer", "strings", "bias"  # BIAS: {"token id": number}, ids below the vocabulary's size


@dataclass(frozen=True)
class Field:
    """One request field: what validation accepts, what the OpenAPI document says, which value asks for nothing."""

    name: str
    kind: str
    neutral: object  # leaves the logits as they are; also the value where the request does not give the field
    doc: str
    low: float | None = None  # NUMBER, INTEGER: the least value (None: no bound); BIAS: the least bias
    high: float | None = None  # NUMBER, INTEGER: the largest; BIAS: the largest bias; STRINGS: how many
    above_low: bool = False  # low itself is not allowed
    longest: int | None = None  # STRINGS: characters in each


@dataclass(frozen=True)
class Processor:
    name: str  # the /metrics label
    fields: tuple[Field, ...]
    stage: str  # BEFORE_MASK or AFTER_MASK
    apply: Callable[..., torch.Tensor]  # (logits, **field values, **needs) -> logits
    needs: tuple[str, ...] = ()  # Context attributes passed as keywords

    def values(self, options: dict) -> dict | None:
        """Each field's value where the request sets one of them away from neutral, else None."""
        values = {f.name: options.get(f.name, f.neutral) for f in self.fields}
        return values if any(values[f.name] != f.neutral for f in self.fields) else None


class History:
    """The ids a processor may look at. Tensors over them are built on first use, then kept current."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self._counts: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        if self._counts is not None:
            self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True

    def output_counts(self, logits: torch.Tensor) -> torch.Tensor:
        """How often each id occurs in the output: fp32 [V] on logits' device."""
        if self._counts is None:
            ids = torch.tensor(self.output_ids, dtype=torch.int64)
            self._counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.device, torch.float32)
        return self._counts

    def seen(self, logits: torch.Tensor) -> torch.Tensor:
        """Whether each id occurs in the prompt or the output: bool [V] on logits' device."""
        if self._seen is None:
            self._seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            self._seen[torch.tensor(self.prompt_ids + self.output_ids, dtype=torch.int64, device=logits.device)] = True
        return self._seen


@dataclass
class Context:
    """What a processor may declare it needs, for the row being chosen."""

    history: History
    tokenizer: object
    temperature: float
    seed: int  # the request's, or the one drawn for it: what the sampler's randomness is keyed by
    index: int = 0  # the token's position in the reply; the Chooser sets it for each row


# ---- before the grammar mask ------------------------------------------------------------


def repetition_penalty(logits: torch.Tensor, *, repetition_penalty: float, history: History) -> torch.Tensor:
    """HF's and llama.cpp's: a seen token's logit is divided by the penalty if positive, multiplied if not."""
    penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
    return torch.where(history.seen(logits), penalized, logits)


def frequency_penalty(logits: torch.Tensor, *, frequency_penalty: float, history: History) -> torch.Tensor:
    """OpenAI's: minus the penalty per occurrence in the output."""
    return logits - history.output_counts(logits) * frequency_penalty


def presence_penalty(logits: torch.Tensor, *, presence_penalty: float, history: History) -> torch.Tensor:
    """OpenAI's: minus the penalty once if the token occurs in the output."""
    return logits - (history.output_counts(logits) > 0).float() * presence_penalty


def logit_bias(logits: torch.Tensor, *, logit_bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's: the bias added to the token's logit (-100 bans it in practice, 100 all but forces it)."""
    return logits + _dense_bias(logit_bias, logits.shape[-1], logits.device)


@functools.lru_cache(maxsize=4)  # one request's bias, built once rather than every step
def _dense_bias(pairs: tuple[tuple[int, float], ...], vocab: int, device: torch.device) -> torch.Tensor:
    bias = torch.zeros(vocab, dtype=torch.float32)
    for token, value in pairs:
        if token < vocab:  # an id of the tokenizer's that the model has no logit for can never be sampled anyway
            bias[token] += value
    return bias.to(device)


def dry(logits: torch.Tensor, *, dry_multiplier: float, dry_base: float, dry_allowed_length: int,
        dry_sequence_breakers: tuple[str, ...], history: History, tokenizer) -> torch.Tensor:
    """DRY, "Don't Repeat Yourself" (koboldcpp, text-generation-webui, llama.cpp).

    Where the text so far ends with a sequence that occurred before, the
    token that followed it then would extend the repeat: its logit loses
    multiplier x base^(length - allowed_length) for a repeat of length >=
    allowed_length (the longest, where several precede the same token). A
    repeat is not followed across a token whose text holds a sequence
    breaker, nor into one.
    """
    if dry_multiplier == 0.0:
        return logits
    breakers = _breaking_ids(tokenizer, tuple(dry_sequence_breakers))
    ids = history.prompt_ids + history.output_ids
    end = len(ids) - 1
    if end < 1 or ids[end] in breakers:
        return logits
    longest: dict[int, int] = {}  # token -> the longest repeat it would extend
    for i in range(end):
        following = ids[i + 1]
        if ids[i] != ids[end] or following in breakers or following >= logits.shape[-1]:
            continue
        length = 1  # ids[i] is the last token again; how far back does the match go?
        while (length < DRY_LONGEST_MATCH and length <= i and ids[i - length] == ids[end - length]
               and ids[end - length] not in breakers):
            length += 1
        if length >= dry_allowed_length and length > longest.get(following, 0):
            longest[following] = length
    if not longest:
        return logits
    tokens = torch.tensor(list(longest), device=logits.device)
    # Past fp32's range (a long repeat, a large base) the penalty is inf: the token is banned.
    penalties = [dry_multiplier * dry_base ** (length - dry_allowed_length) for length in longest.values()]
    return logits.index_add(0, tokens, torch.tensor(penalties, dtype=logits.dtype, device=logits.device), alpha=-1)


@functools.lru_cache(maxsize=8)  # per tokenizer and list of breakers: a pass over the vocabulary
def _breaking_ids(tokenizer, breakers: tuple[str, ...]) -> frozenset[int]:
    """The ids whose text holds one of the breakers."""
    needles = [breaker.encode() for breaker in breakers]
    return frozenset(i for i, text in enumerate(spellings(tokenizer)) if any(needle in text for needle in needles))


# ---- after the grammar mask: truncations of softmax(logits / temperature) ----------------


def min_p(logits: torch.Tensor, *, min_p: float, temperature: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the top one's: in logits, below max + temperature * log(min_p).

    min_p never drops the most likely token.
    """
    threshold = logits.max() + temperature * math.log(min_p)
    # NaN compares False: a NaN maximum (which the sampler treats as -inf) drops nothing.
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_n_sigma(logits: torch.Tensor, *, top_n_sigma: float) -> torch.Tensor:
    """Top-nσ (Tang et al.; llama.cpp's top-n-sigma): keep tokens whose logit is at least max - n x std.

    Mean, standard deviation (of the population) and max are over the finite
    logits (the mask's -inf left out). Dividing by the temperature scales all
    three alike, so the raw logits give the same tokens.
    """
    finite = torch.isfinite(logits)
    count = finite.sum()
    mean = torch.where(finite, logits, 0.0).sum() / count
    std = (torch.where(finite, logits - mean, 0.0).square().sum() / count).sqrt()
    top = torch.where(finite, logits, float("-inf")).max()
    # No finite logit: the threshold is NaN, which compares False and drops nothing.
    return logits.masked_fill(logits < top - top_n_sigma * std, float("-inf"))


def typical_p(logits: torch.Tensor, *, typical_p: float, temperature: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; HF's TypicalLogitsWarper).

    Tokens ordered by how far their surprisal -log p is from the entropy, the
    nearest first; those are kept until they hold typical_p of the probability.
    """
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum()  # 0 x -inf (masked tokens) is NaN: they add nothing
    distance = (-log_probs - entropy).abs()
    nearest, order = torch.sort(distance)
    held = probs[order].cumsum(0)
    last = (held < typical_p).sum().clamp(max=logits.shape[-1] - 1)  # a tensor: no wait for the device
    return logits.masked_fill(distance > nearest[last], float("-inf"))


def xtc(logits: torch.Tensor, *, xtc_probability: float, xtc_threshold: float, temperature: float, seed: int,
        index: int) -> torch.Tensor:
    """XTC, Exclude Top Choices (text-generation-webui, llama.cpp).

    With probability xtc_probability, where two or more tokens have
    probability >= xtc_threshold, all of them but the least probable are
    dropped (of those as probable, the lowest id is kept). The draw is keyed by
    the seed and the token's index in the reply, as the sampler's is, so a
    speculative verify's rows exclude what steps would.
    """
    if _draw(seed, index) >= xtc_probability:
        return logits
    probs = torch.softmax(logits / temperature, dim=-1)
    top = (probs >= xtc_threshold) & (probs > 0)  # a masked token is never a choice, whatever the threshold
    least = torch.where(top, probs, float("inf")).argmin()  # with one top token, that one: nothing is dropped
    return logits.masked_fill(top.index_fill(0, least.view(1), False), float("-inf"))


def _draw(seed: int, index: int) -> float:
    """Uniform in [0, 1), from (seed, index) alone: SplitMix64's finalizer over the two mixed."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x2545F4914F6CDD1D) % (1 << 64)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return ((x ^ (x >> 31)) >> 11) / (1 << 53)


# ---- the records, in the order each stage runs them ----------------------------------------

PROCESSORS: tuple[Processor, ...] = (
    # Over the prompt's and the output's tokens: the prompt includes the chat template's own, as in HF and llama.cpp.
    Processor(
        "repetition_penalty",
        (Field("repetition_penalty", NUMBER, 1.0, "HF / llama.cpp: the logit of every token already in the prompt or the "
               "output is divided by it (multiplied, if negative); 1 is off", low=0.0, high=10.0, above_low=True),),
        BEFORE_MASK, repetition_penalty, needs=("history",),
    ),
    Processor(
        "frequency_penalty",
        (Field("frequency_penalty", NUMBER, 0.0, "OpenAI: subtracted from a token's logit once per time it occurs in "
               "the output", low=-2.0, high=2.0),),
        BEFORE_MASK, frequency_penalty, needs=("history",),
    ),
    Processor(
        "presence_penalty",
        (Field("presence_penalty", NUMBER, 0.0, "OpenAI: subtracted once from the logit of every token that occurs in "
               "the output", low=-2.0, high=2.0),),
        BEFORE_MASK, presence_penalty, needs=("history",),
    ),
    Processor(
        "dry",
        (
            Field("dry_multiplier", NUMBER, 0.0, "DRY (Don't Repeat Yourself): a token that would extend a repeat of the text's "
                  "end, of length >= `dry_allowed_length`, loses multiplier x base^(length - `dry_allowed_length`) "
                  "from its logit; 0 is off",
                  low=0.0, high=100.0),
            Field("dry_base", NUMBER, 1.75, "DRY: the penalty grows by this factor per token of repeat past "
                  "`dry_allowed_length`; 1.75 if not given", low=1.0, high=10.0, above_low=True),
            Field("dry_allowed_length", INTEGER, 2, "DRY: repeats this long go unpenalized; 2 if not given", low=1),
            Field("dry_sequence_breakers", STRINGS, ("\n", ":", '"', "*"), "DRY: a repeat is not followed across a "
                  "token whose text holds one of these; `[\"\\n\", \":\", \"\\\"\", \"*\"]` if not given", high=16, longest=20),
        ),
        BEFORE_MASK, dry, needs=("history", "tokenizer"),
    ),
    # Last before the mask, so that a bias has the last word.
    Processor(
        "logit_bias",
        (Field("logit_bias", BIAS, (), "added to those tokens' logits (-100 bans a token in practice, 100 forces "
               "it); ids from 0 to the vocabulary's size - 1", low=-100.0, high=100.0),),
        BEFORE_MASK, logit_bias,
    ),
    # The truncations in llama.cpp's order (its top-k and top-p are the sampler's here, after them).
    Processor(
        "top_n_sigma",
        (Field("top_n_sigma", NUMBER, 0.0, "top-nσ: keep the tokens whose logit is at least the largest minus this many "
               "standard deviations of the finite logits; 0 is off", low=0.0, high=100.0),),
        AFTER_MASK, top_n_sigma,
    ),
    Processor(
        "typical_p",
        (Field("typical_p", NUMBER, 1.0, "locally typical sampling: keep the tokens whose surprisal is nearest the "
               "entropy until they hold this much probability (after temperature); 1 is off",
               low=0.0, high=1.0, above_low=True),),
        AFTER_MASK, typical_p, needs=("temperature",),
    ),
    Processor(
        "min_p",
        (Field("min_p", NUMBER, 0.0, "drop tokens whose probability (after temperature) is below `min_p` times the "
               "most likely token's", low=0.0, high=1.0),),
        AFTER_MASK, min_p, needs=("temperature",),
    ),
    Processor(
        "xtc",
        (
            Field("xtc_probability", NUMBER, 0.0, "XTC: the chance, at each token, that the top choices are excluded; "
                  "0 is off", low=0.0, high=1.0),
            Field("xtc_threshold", NUMBER, 0.1, "XTC: the top choices are the tokens at least this probable (after "
                  "temperature); where there are two or more, all but the least probable are excluded; 0.1 if not given",
                  low=0.0, high=0.5),
        ),
        AFTER_MASK, xtc, needs=("temperature", "seed", "index"),
    ),
)


def chosen(params: SamplingParams, stage: str) -> tuple[tuple[Processor, dict], ...]:
    """The stage's processors that the request sets, each with its fields' values: what the Chooser runs per row."""
    if stage == AFTER_MASK and (params.temperature < GREEDY_TEMPERATURE or params.top_k == 1):
        return ()
    return tuple((p, values) for p in PROCESSORS if p.stage == stage and (values := p.values(params.options)) is not None)


def run(processors: tuple[tuple[Processor, dict], ...], logits: torch.Tensor, context: Context) -> torch.Tensor:
    for processor, values in processors:
        logits = processor.apply(logits, **values, **{need: getattr(context, need) for need in processor.needs})
    return logits
