"""The small operations of the CUDA decode step (``cuda_graph.step``): PyTorch references, and Triton kernels that
do each in one launch.

A captured step of a small model is bound by its kernels' count, not by its
bytes: PyTorch runs each of these as several tiny kernels (an RMS norm as a
cast, a square, a mean, an rsqrt and two products; RoPE as casts and complex
products; SDPA with its mask), about 38 a layer, and each costs the GPU
1.5-2 us whatever its size. The kernels (``tornchat/kernels/decode_step_triton.py``)
do each in one, leaving ten a layer with the four matrix products.

Semantics, for one-token rows:

- ``add_rms_norm(x, delta, weight, eps, out_dtype)``: x + delta rounded to
  x's dtype (delta None: x itself), and that sum's RMS norm times weight,
  computed in fp32 and rounded once to out_dtype. Returns (sum, norm).
- ``rope_store(qkv, bias, table, position, keys, values, heads, kv_heads, qk_norm, eps)``:
  one row qkv [1, (heads + 2 kv_heads) * head_dim] (plus bias, in qkv's
  dtype); ``fused.rope_ref``'s norms and rotation by the table's row at
  ``position`` (a device tensor [1]); the key and value written into the
  cache rows keys, values [capacity, kv_heads, head_dim] at that position.
  Returns the queries [1, heads, head_dim] in the cache's dtype.
- ``attend(q, keys, values, position, scale)``: ``fused.attend_ref``'s
  attention of the one row at ``position`` over the cache up to there, in
  fp32, returned [1, heads * head_dim] in q's dtype.
- ``silu_mul(gate_up)``: ``fused.silu_mul_ref``.

The kernels compute in a different order from the references (attention's
positions in blocks, then combined), so their results are close, not equal;
a step's rows get the same bits from the same op set wherever they run,
captured or eager.
"""
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tornchat.engine import fused
from tornchat.kernels.dispatch import triton_module, use_triton


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        x = (x.float() + delta.float()).to(x.dtype)
    return x, F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(out_dtype)


def rope_store_ref(qkv: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor, position: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    if bias is not None:
        qkv = qkv + bias
    head_dim = keys.shape[-1]
    rotated = fused.rope_ref(qkv, table.index_select(0, position), heads, kv_heads, head_dim, qk_norm, eps)
    keys.index_copy_(0, position, rotated[:, heads:].to(keys.dtype))
    values.index_copy_(0, position, qkv[:, (heads + kv_heads) * head_dim :].reshape(1, kv_heads, head_dim)
                       .to(values.dtype))
    return rotated[:, :heads].to(keys.dtype)


def attend_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
               scale: float) -> torch.Tensor:
    """By PyTorch's SDPA over the whole cache, the positions after the row's masked (no host read of position)."""
    _, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    visible = (torch.arange(keys.shape[0], device=keys.device) <= position)[None, None, None, :]
    out = F.scaled_dot_product_attention(q.reshape(1, kv_heads, heads // kv_heads, head_dim),
                                         keys[None].transpose(1, 2), values[None].transpose(1, 2),
                                         attn_mask=visible, scale=scale)
    return out.reshape(1, heads * head_dim)


@dataclass(frozen=True)
class StepOps:
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_store: Callable[..., torch.Tensor]
    attend: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


REFERENCE = StepOps(add_rms_norm_ref, rope_store_ref, attend_ref, fused.silu_mul_ref)


@functools.cache
def triton_ops() -> StepOps:
    """The kernels (imported on first use: the CPU server never imports Triton)."""
    kernels = triton_module("decode_step_triton")
    return StepOps(kernels.add_rms_norm, kernels.rope_store, kernels.attend, kernels.silu_mul)


def ops_for(tensor: torch.Tensor) -> StepOps:
    """The kernels on CUDA tensors (and on the CPU with TORNCHAT_TRITON_INTERPRET=1), else the references."""
    return triton_ops() if use_triton(tensor) else REFERENCE
