"""From a row of logits to the next token: the one place a researcher changes how a token is chosen.

In order, per row: the log-probabilities the reply reports (of the raw
logits, only when asked), the logits processors that run before the grammar
mask (penalties, biases: processors.py), the grammar mask (structured
outputs, tool calls), the processors that run after it (truncations such as
min_p: they must not keep only banned tokens), the sampler
(kernels/sampling.py). Randomness, the sampler's and any processor's, is
keyed by the seed and the token's index in the reply, so a speculative
verify's rows give the same tokens as steps; a thinking budget that is
spent forces the closing tag instead.

Where none of that needs the host (no log-probabilities, processors,
grammar or thinking budget), a runner that can (a captured CUDA step) is
handed an ``OnDevice``: the sampler's parameters and the request's stop
table, and chooses the token in the step itself, with the same sampler
(``kernels/step_choice.py``); the chooser then takes the ``Chosen`` token.
"""
import secrets
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tornchat.engine import logprobs, processors, thinking
from tornchat.engine.types import GenerationRequest, TokenLogprob
from tornchat.kernels import sample, step_choice, stopcheck
from tornchat.kernels.sampling import greedy_token, is_greedy


@dataclass(eq=False)
class OnDevice:
    """What a step needs to choose a row's token on the device: the sampler's parameters (device tensors [1]),
    whether its rule is greedy's, the stop table (``stopcheck``, padded to ``MAX_STOP_STRINGS``) and the reply's
    tokens so far (the chooser's own list: the last ``step_choice.WINDOW`` of them are the stop check's window)."""

    greedy: bool
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    table: stopcheck.StopTable
    output_ids: list[int]


class Chosen(NamedTuple):
    """A token chosen on the device, and whether it ended the reply (a stop token, or a stop string that ends in
    it)."""

    token: int
    finished: bool


class Chooser:
    def __init__(self, request: GenerationRequest, prompt: list[int], vocab_size: int, device: torch.device, tokenizer):
        params = request.sampling
        self.temperature = torch.tensor([params.temperature], dtype=torch.float32, device=device)
        # A top_k past the vocabulary restricts nothing; clamping keeps it in the kernel's int32.
        self.top_k = torch.tensor([min(params.top_k, vocab_size)], dtype=torch.int32, device=device)
        self.top_p = torch.tensor([params.top_p], dtype=torch.float32, device=device)
        seed = secrets.randbits(62) if params.seed is None else params.seed
        self.seed = torch.tensor([seed], dtype=torch.int64, device=device)
        self.top_logprobs = request.logprobs
        self.history = processors.History(prompt)
        self.context = processors.Context(self.history, tokenizer, params.temperature, seed)
        self.before_mask = processors.chosen(params, processors.BEFORE_MASK)
        self.after_mask = processors.chosen(params, processors.AFTER_MASK)
        self.grammar = request.grammar
        self.thinking = thinking.Budget(request.thinking, tokenizer) if request.thinking is not None else None
        self.greedy = is_greedy(torch.tensor(params.temperature, dtype=torch.float32), params.top_k)
        self.prepare()

    def on_device(self, tokenizer, stops: tuple[str, ...], stop_token_ids: frozenset[int]) -> OnDevice | None:
        """The choice for a runner that chooses in its step, or None where this chooser needs the logits on the
        host (or the stop strings do not fit the device's table)."""
        if (self.top_logprobs is not None or self.before_mask or self.after_mask or self.grammar is not None
                or self.thinking is not None):
            return None
        try:
            table = stopcheck.build_stop_table(stopcheck.token_bytes(tokenizer), stops, stop_token_ids,
                                               self.seed.device)
        except ValueError:  # more or longer stop strings than the table holds
            return None
        return OnDevice(self.greedy, self.temperature, self.top_k, self.top_p, self.seed,
                        step_choice.padded_table(table), self.history.output_ids)

    def prepare(self) -> None:
        """Ready the grammar's mask for the next row (on CUDA, while the forward's kernels run)."""
        if self.grammar is not None:
            self.grammar.fill_mask()

    def choose(self, logits: torch.Tensor | Chosen, index: int) -> tuple[int, torch.Tensor | None]:
        """The token at position ``index`` of the reply, and the raw distribution when logprobs are asked; or the
        token the step chose itself (``on_device``)."""
        if isinstance(logits, Chosen):
            self.history.append(logits.token)
            return logits.token, None
        distribution = logprobs.distribution(logits) if self.top_logprobs is not None else None
        self.context.index = index
        logits = processors.run(self.before_mask, logits, self.context)
        if self.grammar is not None:
            logits = self.grammar.apply(logits)  # tokens that leave the grammar: -inf
        logits = processors.run(self.after_mask, logits, self.context)
        if self.greedy:  # the sampler's rule 2, without the log-probability it would compute and we drop
            token = greedy_token(logits)
        else:
            token_ids, _ = sample(logits[None, :], self.temperature, self.top_k, self.top_p, self.seed, index)
            token = int(token_ids[0])
        if self.thinking is not None and (forced := self.thinking.forced()) is not None:
            token = forced
        self.history.append(token)
        return token, distribution

    def accept(self, token: int, distribution: torch.Tensor | None) -> tuple[bool, TokenLogprob | None]:
        """A token that goes into the reply (not a stop token): whether it completes the grammar, and its
        reported log-probabilities."""
        done = self.grammar is not None and self.grammar.consume(token)
        reported = logprobs.for_token(distribution, token, self.top_logprobs) if distribution is not None else None
        return done, reported

    @property
    def output_ids(self) -> list[int]:
        return self.history.output_ids
