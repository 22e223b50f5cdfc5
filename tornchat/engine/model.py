"""The model forward the decode loop calls, and the KV cache it fills.

Any forward with this shape plugs in (``Runner``): transformers' own module
(``HFRunner``, every causal LM) or a lean implementation for one family.
"""
from copy import deepcopy
from typing import Any, Protocol

import torch

PREFILL_CHUNK = 512  # bounds attention memory; cancellation is checked between chunks


class Runner(Protocol):
    device: torch.device
    context_length: int
    chooses_on_device: bool  # whether ``choose_step`` runs (a captured CUDA step)

    def new_cache(self) -> Any: ...

    def forward(self, token_ids: list[int], cache: Any, decode: bool = False) -> torch.Tensor:
        """Append token_ids to cache; return fp32 logits [V] of the last position.

        ``decode``: a one-token step after a sampled token (CUDA replays a
        captured graph for it). ``LlamaRunner`` on the CPU computes every row
        the same way whatever the call, so a prompt's logits do not depend on
        how much of it was cached or how it was chunked; transformers'
        modules (``HFRunner``) make no such promise.
        """

    def verify(self, token_ids: list[int], cache: Any) -> torch.Tensor:
        """Append token_ids to cache; return fp32 logits [n, V], row i bit for bit what
        ``forward([token_ids[i]], cache, decode=True)`` would give after the rows before it.

        A speculative decoder checks n drafted tokens with one call; whether that costs less than n steps
        depends on the runner and the machine (``speculate.measure``).
        """

    def forward_many(self, batch: list[tuple[list[int], Any, bool]]) -> list[torch.Tensor]:
        """Several sequences, each (token_ids, cache, every) with its own cache: fp32 logits [n, V] of every row
        where ``every`` (``verify``'s), else [1, V] of the last (``forward``'s), each what that call alone gives.
        The scheduler batches parallel generations through it; ``one_by_one`` is the plain version."""

    def choose_step(self, token: int, cache: Any, choice) -> tuple[int, bool]:
        """Append token to cache and choose the next token in the same step, on the device, as ``choice``
        (``choose.OnDevice``) says: ``choose.Chosen(token, finished)``, the token the chooser would take from
        ``forward``'s logits, and whether it ends the reply. Only where ``chooses_on_device``."""

    def reserve(self, cache: Any, length: int) -> None:
        """Make room in cache for ``length`` positions at once (a prompt's, before its chunks), so that it is not
        grown, and copied, chunk by chunk."""

    def truncate(self, cache: Any, length: int) -> None:
        """Keep only the first ``length`` positions of cache (at least ``resumable_from(cache)``)."""

    def hold(self, cache: Any, length: int) -> None:
        """Keep cache resumable at ``length`` and after, however it grows: a runner that drops positions no later
        row sees (Gemma 3's windowed layers) keeps what a row at ``length`` would see."""

    def resumable_from(self, cache: Any) -> int:
        """The shortest length cache can be cut back (``truncate``, ``fork``) and go on from; 0 where it keeps
        every position."""

    def fork(self, cache: Any, length: int) -> Any:
        """A new cache holding a copy of the first ``length`` positions of cache."""

    def cache_bytes(self, cache: Any) -> int: ...


def one_by_one(runner: Runner, batch: list[tuple[list[int], Any, bool]]) -> list[torch.Tensor]:
    """``forward_many`` as one call per sequence, for runners that cannot run sequences in one forward."""
    return [runner.verify(ids, cache) if every else runner.forward(ids, cache)[None] for ids, cache, every in batch]


class HFRunner:
    """transformers' model with a DynamicCache."""

    chooses_on_device = False

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        config = model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 2048) or 2048)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache, decode: bool = False) -> torch.Tensor:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def verify(self, token_ids: list[int], cache) -> torch.Tensor:
        # One row at a time: transformers' modules give a row different bits in a multi-row forward.
        return torch.stack([self.forward([token], cache, decode=True) for token in token_ids])

    def forward_many(self, batch) -> list[torch.Tensor]:
        return one_by_one(self, batch)

    def reserve(self, cache, length: int) -> None:
        pass  # a DynamicCache grows by concatenation, whatever it is told

    def truncate(self, cache, length: int) -> None:
        surplus = cache.get_seq_length() - length
        if surplus > 0:
            cache.crop(-surplus)  # transformers 5: a negative count of tokens to drop

    def hold(self, cache, length: int) -> None:
        pass  # every position is kept

    def resumable_from(self, cache) -> int:
        return 0

    def fork(self, cache, length: int):
        copy = deepcopy(cache)
        self.truncate(copy, length)
        return copy

    def cache_bytes(self, cache) -> int:
        total = 0
        for layer in getattr(cache, "layers", ()):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total
