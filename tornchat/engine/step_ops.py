"""The small operations of the CUDA decode step (``cuda_graph.step``): PyTorch references, and Triton kernels that
do each in one launch.

A captured step of a small model is bound by its kernels' count, not by its
bytes: PyTorch runs each of these as several tiny kernels (an RMS norm as a
cast, a square, a mean, an rsqrt and two products; RoPE as casts and complex
products; SDPA with its mask), about 38 a layer, and each costs the GPU
1.5-2 us whatever its size. The kernels (``tornchat/kernels/decode_step_triton.py``)
do each in one, leaving ten a layer with the four matrix products.

Semantics, for one-token rows (rows [R, ...]; the rows given to one
``rope_store`` or ``attend`` belong to one cache, each at its own position):

- ``add_rms_norm(x, delta, weight, eps, out_dtype)``: x + delta rounded to
  x's dtype (delta None: x itself), and that sum's RMS norm times weight,
  computed in fp32 and rounded once to out_dtype. Returns (sum, norm).
- ``rope_store(qkv, bias, table, positions, keys, values, heads, kv_heads, qk_norm, eps)``:
  rows qkv [R, (heads + 2 kv_heads) * head_dim] (plus bias, in qkv's
  dtype); ``fused.rope_ref``'s norms and rotation of row r by the table's
  row at ``positions[r]`` (a device tensor [R]); its key and value written
  into the cache rows keys, values [capacity, kv_heads, head_dim] at that
  position. Returns the queries [R, heads, head_dim] in the cache's dtype.
- ``attend(q, keys, values, positions, scale)``: ``fused.attend_ref``'s
  attention of row r at ``positions[r]`` over the cache up to there, in
  fp32, returned [R, heads * head_dim] in q's dtype.
- ``silu_mul(gate_up)``: ``fused.silu_mul_ref``.
- ``linear(x, w)``: ``quant.linear``.

The kernels compute in a different order from the references (attention's
positions in blocks, then combined), so their results are close, not equal.
Each kernel computes a row by itself, in an order that depends on nothing
but the row (attention's blocks are fixed positions, whatever the cache's
capacity; the products run one compiled kernel on a fixed tile of rows), so
a row gets the same bits in a step of any rows, captured or eager: a verify
of drafts gives each row what a step gives it alone. PyTorch's ops promise
none of that: cuBLAS and tinygemm choose kernels by the row count.
"""
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tornchat.engine import fused, quant
from tornchat.kernels.dispatch import triton_module, use_triton


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        x = (x.float() + delta.float()).to(x.dtype)
    return x, F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(out_dtype)


def rope_store_ref(qkv: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor, positions: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, heads: int, kv_heads: int, qk_norm: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    if bias is not None:
        qkv = qkv + bias
    rows, head_dim = qkv.shape[0], keys.shape[-1]
    rotated = fused.rope_ref(qkv, table.index_select(0, positions), heads, kv_heads, head_dim, qk_norm, eps)
    keys.index_copy_(0, positions, rotated[:, heads:].to(keys.dtype))
    values.index_copy_(0, positions, qkv[:, (heads + kv_heads) * head_dim :].reshape(rows, kv_heads, head_dim)
                       .to(values.dtype))
    return rotated[:, :heads].to(keys.dtype)


def attend_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               scale: float) -> torch.Tensor:
    """By PyTorch's SDPA over the whole cache, each row's later positions masked (no host read of positions)."""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    visible = (torch.arange(keys.shape[0], device=keys.device) <= positions[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads, head_dim),
                                         keys[None].transpose(1, 2), values[None].transpose(1, 2),
                                         attn_mask=visible, scale=scale)
    return out.reshape(rows, heads * head_dim)


def linear_ref(x: torch.Tensor, w: quant.Weight) -> torch.Tensor:
    """``quant.linear``: cuBLAS for plain weights, tinygemm for int4; a row's bits may depend on the rows beside
    it."""
    return quant.linear(x, w)


def linear_rows(x: torch.Tensor, w: quant.Weight) -> torch.Tensor:
    """Plain weights through our kernel, whose rows do not interact; tinygemm's int4 as ``quant.linear``."""
    if isinstance(w, torch.Tensor):
        return _kernels().linear_rows(x, w)
    return quant.linear(x, w)


@dataclass(frozen=True)
class StepOps:
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_store: Callable[..., torch.Tensor]
    attend: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, quant.Weight], torch.Tensor]

    def rows_apart(self, runner) -> bool:
        """Whether every row of a step gets the bits it gets alone: each op computes a row by itself, and so do
        the runner's matrix products (our kernel on plain weights; not cuBLAS, not tinygemm)."""
        matrices = [m for layer in runner.layers for m in layer.matrices()] + [runner.head]
        return self.linear is linear_rows and all(isinstance(m, torch.Tensor) for m in matrices)


REFERENCE = StepOps(add_rms_norm_ref, rope_store_ref, attend_ref, fused.silu_mul_ref, linear_ref)


@functools.cache
def _kernels():
    """The kernels' module (imported on first use: the CPU server never imports Triton)."""
    return triton_module("decode_step_triton")


@functools.cache
def triton_ops() -> StepOps:
    kernels = _kernels()
    return StepOps(kernels.add_rms_norm, kernels.rope_store, kernels.attend, kernels.silu_mul, linear_rows)


def ops_for(tensor: torch.Tensor) -> StepOps:
    """The kernels on CUDA tensors (and on the CPU with TORNCHAT_TRITON_INTERPRET=1), else the references."""
    return triton_ops() if use_triton(tensor) else REFERENCE
