"""Log-probabilities the reply reports: the model's own, log_softmax of the raw logits.

Taken before any logits processor, temperature or truncation, so they say
what the model thinks, not what the sampler was told to do with it.
"""
import torch

from tornchat.engine.types import TokenLogprob
from tornchat.kernels.sampling import sanitize_logits

# OpenAI's stand-in for a log-probability of -inf, which JSON cannot carry.
FLOOR = -9999.0


def distribution(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of the raw logits [V], with NaN counted as -inf as the sampler counts it."""
    return torch.log_softmax(sanitize_logits(logits), dim=-1)


def for_token(logprobs: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """The sampled token's entry, with the top_n most likely tokens."""
    top = ()
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        top = tuple(zip(ids.tolist(), (max(v, FLOOR) for v in values.tolist())))
    return TokenLogprob(token, max(float(logprobs[token]), FLOOR), top)
