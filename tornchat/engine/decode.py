"""The decode loop: prefill what the slot lacks, then one token per step, in three stages.

- What feeds the next rows (here): prefill chunks, a one-token step, or a
  verify of drafted tokens (speculate.py), each a ``Forward`` the loop
  yields; the scheduler (scheduler.py) runs the rows of every running
  generation in one forward and sends each its logits back, the same bits as
  alone (``LlamaRunner.forward_many``).
- What chooses a token from a row: ``choose.Chooser`` (log-probabilities,
  processors, grammar mask, truncation, sampler).
- What turns tokens into text and events: ``textstream.Outbox``
  (detokenizer, stop strings, held-back text).

With speculation one forward verifies drafted tokens and yields a row of
logits per step: the steps that follow use those rows for as long as the
chosen tokens equal the drafts, so the text is the same with or without it.
"""
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import torch

from tornchat.engine import speculate
from tornchat.engine.choose import Chooser, Chosen, OnDevice
from tornchat.engine.model import PREFILL_CHUNK, Runner
from tornchat.engine.slots import SlotPool
from tornchat.engine.textstream import Outbox
from tornchat.engine.types import Event, GenerationRequest, PromptTooLong, Usage


class Forward(NamedTuple):
    """A forward a generation asks for: token_ids appended to cache; ``every``: the logits of every row
    [n, V] (a verify's, a step's), else a prompt chunk that the scheduler may shorten: the generation is sent
    (the logits of the last row read [1, V], how many rows were read). ``choice``: a one-token step whose next
    token the runner may choose itself (``Runner.choose_step``): then the generation is sent
    [``choose.Chosen``] instead of the logits."""

    token_ids: list[int]
    cache: Any
    every: bool
    choice: OnDevice | None = None


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
    generations: Callable[[], int] = lambda: 1,
) -> Generator[Forward, torch.Tensor, None]:
    """Run one request to completion, calling emit for each piece of text; yields each ``Forward`` it needs
    and is sent its logits (scheduler.py).

    ``speculation``: draft tokens by prompt lookup (speculate.py) and check
    them in one verify, sized by these costs and by how many generations
    share the step (``generations()``). Each verified row then goes
    through the same steps as a plain step's logits, in order, so the text is
    the same with or without it (the sampler's randomness is keyed by the
    token's index in the reply).

    The prompt is offered PREFILL_CHUNK tokens at a time; beside other generations the scheduler reads fewer
    (``scheduler.Batch.shared_rows``). A chunk's size changes no row's logits.

    Returns quietly if cancelled() turns true; raises on a model failure
    (after dropping the slot, whose cache may be half-written). The slot is
    the generation's alone until it ends (``SlotPool.release``).
    """
    budget = token_budget(request, runner.context_length)
    slot, reused, prompt = slots.acquire(request.prompt_ids)  # the same text, maybe in the slot's ids
    counters["reused_tokens"] += reused

    def forget(tokens: list[int]) -> None:  # drafts the chooser did not confirm leave the cache
        del slot.tokens[len(slot.tokens) - len(tokens) :]
        runner.truncate(slot.cache, len(slot.tokens))

    try:
        runner.reserve(slot.cache, len(prompt) + 1)  # the prompt and the first token: one allocation, not one a chunk
        start = reused
        while start < len(prompt):
            if cancelled():
                return
            last_row, read = yield Forward(prompt[start : start + PREFILL_CHUNK], slot.cache, False)
            logits = last_row[0]
            slot.tokens.extend(prompt[start : start + read])
            counters["prefill_tokens"] += read
            start += read

        chooser = Chooser(request, prompt, logits.shape[-1], logits.device, tokenizer)
        # The device's stop table spells special tokens as nothing: where some are kept in the text, the host's
        # matcher alone sees what the text holds.
        on_device = (chooser.on_device(tokenizer, request.stop, stop_token_ids)
                     if runner.chooses_on_device and not request.keep_special else None)
        thinking = chooser.thinking
        outbox = Outbox(tokenizer, request.keep_special, request.stop, emit, thinking.observe if thinking else None)
        drafter = speculate.Drafter(speculation, prompt, request.prediction_ids) if speculation else None
        rows = [logits]  # logits of the next positions: this step's, then one per draft fed after it
        drafts: list[int] = []  # tokens fed after this step's position that the chooser has yet to confirm
        fed = kept = 0  # drafts in the current verify, and how many the chooser confirmed
        drafted = accepted = 0  # over the request
        finish_reason, hit_stop_string = "length", False
        if cancelled():
            return
        for step in range(budget):
            row = rows.pop(0)
            token, distribution = chooser.choose(row, step)
            if drafts and token == drafts[0]:
                drafts.pop(0)  # the next row was computed after this very token
                kept += 1
            else:
                rows.clear()
            if token in stop_token_ids:
                finish_reason = "stop"
                break
            grammar_done, logprob = chooser.accept(token, distribution)
            hit_stop_string = outbox.push(token, logprob)
            if hit_stop_string or grammar_done or isinstance(row, Chosen) and row.finished:
                finish_reason = "stop"
                break
            if drafter is not None:
                drafter.append(token)
            if rows:  # a confirmed draft: its row is next
                chooser.prepare()
                continue
            if fed:  # the verify is over: a draft was rejected, or every row used
                drafter.observe(kept, fed)
                forget(drafts)
                drafted, accepted = drafted + fed, accepted + kept
                drafts, fed, kept = [], 0, 0
            outbox.send()
            if step + 1 < budget:
                if cancelled():
                    return
                drafts = drafter.propose(budget - step - 2, generations()) if drafter is not None else []
                rows = list((yield Forward([token, *drafts], slot.cache, True, None if drafts else on_device)))
                chooser.prepare()
                slot.tokens += [token, *drafts]
                fed = len(drafts)
                counters["decode_steps"] += 1
        forget(drafts)
        drafted, accepted = drafted + fed, accepted + kept
        outbox.close(hit_stop_string)
    except BaseException:
        slots.discard(slot)
        raise
    finally:
        slots.release(slot)
        slots.enforce_budget()
    counters["drafted_tokens"] += drafted
    counters["accepted_tokens"] += accepted
    # After the budget holds, so that whoever gets the last event sees the pool as it stays.
    usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(chooser.output_ids), cached_tokens=reused,
                  accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted,
                  reasoning_tokens=thinking.reasoning_tokens if thinking is not None else 0)
    emit(Event(finish_reason=finish_reason, usage=usage))
