"""Logits processors: what the decode loop does to the logits between the forward and the sampler.

A processor is one function ``f(logits, params, history) -> logits``:
``logits`` are the fp32 logits [V] of the next token, ``params`` the
request's SamplingParams, ``history`` the prompt's and the sampled token ids.
It returns new logits (never writes into the ones it got: the decode loop
may still read them) or the same tensor where its parameters ask for
nothing, so a request that sets none of them pays for nothing. PROCESSORS
runs them in order; to add one, write the function here and append it.

The order, after the forward and the log-probabilities the reply reports
(those are of the raw logits):

1. repetition_penalty: every token seen in the prompt or the output
2. frequency_penalty, presence_penalty: the output's tokens
3. logit_bias
4. (the grammar mask, where a request constrains its output)
5. min_p (``truncate``), then the sampler: temperature, top-k, top-p.

min_p sits with the sampler's truncation because it is defined on the
tempered distribution, and must see the grammar's mask: applied before it,
it could leave only tokens the grammar then forbids.
"""
import functools
import math
from collections.abc import Callable

import torch

from tornchat.engine.types import SamplingParams
from tornchat.kernels.sampling import GREEDY_TEMPERATURE


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


Processor = Callable[[torch.Tensor, SamplingParams, History], torch.Tensor]


def repetition_penalty(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """HF's and llama.cpp's: a seen token's logit is divided by the penalty if positive, multiplied if not."""
    penalty = params.repetition_penalty
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(history.seen(logits), penalized, logits)


def frequency_and_presence_penalty(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """OpenAI's: minus frequency_penalty per occurrence in the output, minus presence_penalty once if it occurs."""
    if params.frequency_penalty == 0.0 and params.presence_penalty == 0.0:
        return logits
    counts = history.output_counts(logits)
    return logits - counts * params.frequency_penalty - (counts > 0).float() * params.presence_penalty


def logit_bias(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """OpenAI's: the bias added to the token's logit (-100 bans it in practice, 100 all but forces it)."""
    if not params.logit_bias:
        return logits
    return logits + _dense_bias(params.logit_bias, logits.shape[-1], logits.device)


@functools.lru_cache(maxsize=4)  # one request's bias, built once rather than every step
def _dense_bias(pairs: tuple[tuple[int, float], ...], vocab: int, device: torch.device) -> torch.Tensor:
    bias = torch.zeros(vocab, dtype=torch.float32)
    for token, value in pairs:
        if token < vocab:  # an id of the tokenizer's that the model has no logit for can never be sampled anyway
            bias[token] += value
    return bias.to(device)


PROCESSORS: tuple[Processor, ...] = (repetition_penalty, frequency_and_presence_penalty, logit_bias)


def apply(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    for processor in PROCESSORS:
        logits = processor(logits, params, history)
    return logits


def truncate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """min_p: drop tokens whose probability under softmax(logits / temperature) is below min_p x the top one's.

    In logits: drop those below max + temperature * log(min_p). Greedy rows
    are left alone; min_p never drops the most likely token.
    """
    if params.min_p == 0.0 or params.temperature < GREEDY_TEMPERATURE or params.top_k == 1:
        return logits
    threshold = logits.max() + params.temperature * math.log(params.min_p)
    # NaN compares False: a NaN maximum (which the sampler treats as -inf) drops nothing.
    return logits.masked_fill(logits < threshold, float("-inf"))
