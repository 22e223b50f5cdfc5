"""A prefill chunk's attention over a bf16 cache, as matrix products per KV head.

PyTorch's CPU flash attention ran a 3B model's 512-row chunk over 2,048
positions at ~170 GFLOP/s on a Zen 5 core pair (no AMX: bf16 no faster than
fp32), where oneDNN's bf16 matrix products of the same shapes run ~800. So
each KV head's scores are one product, the softmax is one pass in C++
(csrc/prefill.cpp), and the probabilities, in bf16, are one product with the
values. The scores leave the product rounded to bf16, which alone moved the
softmax by 1.8% (L1) on large logits; so they are computed twice, the second
time with each row's largest score (from the first) subtracted inside the
product (addmm adds it to the fp32 sums before rounding): the scores that
matter sit near zero, where bf16 is fine-grained (0.006%). autotune times
this against SDPA (``chunk_attention_pays``); the runner uses what it kept.
"""
import torch

from tornchat.engine import quant

SCORES = 1 << 22  # a KV head's scores are computed this many at a time at most (8 MiB in bf16), a block of rows


def runs(kv_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a chunk over this cache can be attended here: a bf16 cache on a CPU, the C++ passes built."""
    return kv_dtype == torch.bfloat16 and device.type == "cpu" and quant._prefill() is not None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """``fused.attend_ref``'s causal grouped-query attention for a chunk: q [n, heads, head_dim] at positions
    start .. start + n - 1 over keys and values [capacity, kv_heads, head_dim] in bf16, each row seeing
    positions 0 .. its own; returns [n, heads * head_dim] in bf16. Queries, scores (less each row's largest, to
    within that one's bf16 rounding) and probabilities are rounded to bf16 for the products; the softmax is
    fp32."""
    native = quant._prefill()
    n, heads, head_dim = q.shape
    kv_heads, end = keys.shape[1], start + n
    groups = heads // kv_heads
    out = torch.empty(heads, n, head_dim, dtype=torch.bfloat16)
    block = max(1, SCORES // end)
    for h in range(kv_heads):
        # A KV head's rows are (group, position): its query heads one after the other.
        queries = q[:, h * groups : (h + 1) * groups].transpose(0, 1).reshape(groups * n, head_dim).to(torch.bfloat16)
        k, v = keys[:end, h].t(), values[:end, h]
        result = out[h * groups : (h + 1) * groups].view(groups * n, head_dim)
        for first in range(0, groups * n, block):
            rows = queries[first : first + block]
            scores = torch.mm(rows, k)
            largest = native.causal_row_max(scores, start, n, first)
            torch.addmm(largest, rows, k, beta=-scale, alpha=scale, out=scores)  # scale * (q . k - largest)
            native.causal_softmax_(scores, start, n, first)
            torch.mm(scores, v, out=result[first : first + block])
    return out.transpose(0, 1).reshape(n, heads * head_dim)
