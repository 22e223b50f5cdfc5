"""The decode loop: prefill what the slot lacks, then one token per step.

Everything a researcher changes when tweaking decoding lives here, on one
screen: the forward calls, then per step the log-probabilities the reply
reports (of the raw logits, only when asked), the logits processors
(processors.py), the grammar mask (structured outputs), the sampler call,
the thinking budget (thinking.py: past it, the closing tag's tokens replace
the sampled ones) and the stop checks. With speculation (speculate.py) one forward verifies
drafted tokens and yields a row of logits per step: the steps that follow
use those rows for as long as the sampled tokens equal the drafts.
"""
import secrets
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import torch

from tornchat.engine import logprobs, processors, speculate, thinking
from tornchat.engine.model import PREFILL_CHUNK, Runner
from tornchat.engine.slots import SlotPool
from tornchat.engine.textstream import Detokenizer, StopMatcher
from tornchat.engine.types import Event, GenerationRequest, PromptTooLong, Usage
from tornchat.kernels import sample


class Forward(NamedTuple):
    """A forward a generation asks for: token_ids appended to cache; ``every``: the logits of every row
    [n, V] (a verify's, a step's), else of the last row [1, V] (a prefill chunk's)."""

    token_ids: list[int]
    cache: Any
    every: bool


def token_budget(request: GenerationRequest, context_length: int) -> int:
    """New tokens allowed: the tightest of max_tokens, max_length and the context."""
    prompt_len = len(request.prompt_ids)
    limits = [context_length - prompt_len]
    if request.max_length is not None:
        limits.append(request.max_length - prompt_len)
    if request.max_tokens is not None:
        limits.append(request.max_tokens)
    budget = min(limits)
    if budget < 1:
        raise PromptTooLong(prompt_len, context_length, request.max_length)
    return budget


def generate(
    runner: Runner,
    slots: SlotPool,
    tokenizer,
    stop_token_ids: frozenset[int],
    request: GenerationRequest,
    emit: Callable[[Event], None],
    cancelled: Callable[[], bool],
    counters: dict,
    speculation: speculate.Costs | None = None,
) -> Generator[Forward, torch.Tensor, None]:
    """Run one request to completion, calling emit for each piece of text; yields each ``Forward`` it needs
    and is sent its logits (``run`` drives one generation alone, scheduler.py several together).

    ``speculation``: draft tokens by prompt lookup (speculate.py) and check
    them in one ``runner.verify``, sized by these costs. Each verified row
    then goes through the same steps as a plain step's logits, in order, so
    the text is the same with or without it (the sampler's randomness is
    keyed by the token's index in the reply).

    Returns quietly if cancelled() turns true; raises on a model failure
    (after dropping the slot, whose cache may be half-written). The slot is
    the generation's alone until it ends (``SlotPool.release``).
    """
    budget = token_budget(request, runner.context_length)
    slot, reused, prompt = slots.acquire(request.prompt_ids)  # the same text, maybe in the slot's ids
    counters["reused_tokens"] += reused

    def forget(tokens: list[int]) -> None:  # drafts the sampler did not confirm leave the cache
        del slot.tokens[len(slot.tokens) - len(tokens) :]
        runner.truncate(slot.cache, len(slot.tokens))

    try:
        for start in range(reused, len(prompt), PREFILL_CHUNK):
            if cancelled():
                return
            chunk = prompt[start : start + PREFILL_CHUNK]
            logits = (yield Forward(chunk, slot.cache, False))[0]
            slot.tokens.extend(chunk)
            counters["prefill_tokens"] += len(chunk)

        params = request.sampling
        device = logits.device
        temperature = torch.tensor([params.temperature], dtype=torch.float32, device=device)
        # A top_k past the vocabulary restricts nothing; clamping keeps it in the kernel's int32.
        top_k = torch.tensor([min(params.top_k, logits.shape[-1])], dtype=torch.int32, device=device)
        top_p = torch.tensor([params.top_p], dtype=torch.float32, device=device)
        seed = torch.tensor([secrets.randbits(62) if params.seed is None else params.seed], dtype=torch.int64, device=device)

        grammar = request.grammar
        if grammar is not None:
            grammar.fill_mask()
        detok, stops = Detokenizer(tokenizer, request.keep_special), StopMatcher(request.stop)
        thinking_budget = thinking.Budget(request.thinking, tokenizer) if request.thinking is not None else None
        history = processors.History(prompt)
        drafter = speculate.Drafter(speculation, prompt, request.prediction_ids, budget) if speculation else None
        rows = [logits]  # logits of the next positions: this step's, then one per draft fed after it
        drafts: list[int] = []  # tokens fed after this step's position that the sampler has yet to confirm
        fed = kept = 0  # drafts in the current verify, and how many the sampler confirmed
        drafted = accepted = 0  # over the request
        text, unsent, unsent_logprobs = "", [], []  # not emitted yet: text, its ids, their TokenLogprobs
        finish_reason, hit_stop_string = "length", False
        if cancelled():
            return
        for step in range(budget):
            logits = rows.pop(0)
            model_logprobs = logprobs.distribution(logits) if request.logprobs is not None else None
            logits = processors.apply(logits, params, history)
            if grammar is not None:
                logits = grammar.apply(logits)  # tokens that leave the grammar: -inf
            logits = processors.truncate(logits, params)  # min_p, after the mask: it must not keep only banned tokens
            token_ids, _ = sample(logits[None, :], temperature, top_k, top_p, seed, step)
            token = int(token_ids[0])
            if thinking_budget is not None and (forced := thinking_budget.forced()) is not None:
                token = forced
            history.append(token)
            if drafts and token == drafts[0]:
                drafts.pop(0)  # the next row was computed after this very token
                kept += 1
            else:
                rows.clear()
            if token in stop_token_ids:
                finish_reason = "stop"
                break
            grammar_done = grammar is not None and grammar.consume(token)
            unsent.append(token)
            if model_logprobs is not None:
                unsent_logprobs.append(logprobs.for_token(model_logprobs, token, request.logprobs))
            fresh = detok.push(token)
            if thinking_budget is not None:
                thinking_budget.observe(fresh)
            piece, hit_stop_string = stops.push(fresh)
            text += piece
            if hit_stop_string or grammar_done:
                finish_reason = "stop"
                break
            if drafter is not None:
                drafter.append(token)
            if rows:  # a confirmed draft: its row is next
                if grammar is not None:
                    grammar.fill_mask()
                continue
            if fed:  # the verify is over: a draft was rejected, or every row used
                drafter.observe(kept, fed)
                forget(drafts)
                drafted, accepted = drafted + fed, accepted + kept
                drafts, fed, kept = [], 0, 0
            if text:
                emit(Event(text=text, token_ids=tuple(unsent), logprobs=tuple(unsent_logprobs)))
                text, unsent, unsent_logprobs = "", [], []
            if step + 1 < budget:
                if cancelled():
                    return
                drafts = drafter.propose(budget - step - 2) if drafter is not None else []
                rows = list((yield Forward([token, *drafts], slot.cache, True)))
                if grammar is not None:
                    grammar.fill_mask()  # on CUDA, while the forward's kernels run
                slot.tokens += [token, *drafts]
                fed = len(drafts)
                counters["decode_steps"] += 1
        forget(drafts)
        drafted, accepted = drafted + fed, accepted + kept
        rest = "" if hit_stop_string else stops.flush()
        if text or rest:
            emit(Event(text=text + rest, token_ids=tuple(unsent), logprobs=tuple(unsent_logprobs)))
    except BaseException:
        slots.discard(slot)
        raise
    finally:
        slots.release(slot)
        slots.enforce_budget()
    counters["drafted_tokens"] += drafted
    counters["accepted_tokens"] += accepted
    # After the budget holds, so that whoever gets the last event sees the pool as it stays.
    usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(history.output_ids), cached_tokens=reused,
                  accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted,
                  reasoning_tokens=thinking_budget.reasoning_tokens if thinking_budget is not None else 0)
    emit(Event(finish_reason=finish_reason, usage=usage))


def run(runner: Runner, generation: Generator[Forward, torch.Tensor, None]) -> None:
    """Drive one generation alone: each forward it asks for, on this thread."""
    try:
        step = next(generation)
        while True:
            step = generation.send(runner.forward_many([step])[0])
    except StopIteration:
        pass
