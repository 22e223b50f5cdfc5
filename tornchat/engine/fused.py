"""The lean forward's small operations: one C++ pass each where the extension is built, else PyTorch.

A small model's decode step spent as long in ~40 tiny eager ops per layer
as in its matmuls (a third of a step on an AVX-512 machine). ``csrc/fused.cpp``
(attention: ``csrc/attention.cpp``) does each group below in one call; ``pip install`` builds it (setup.py),
and where that was not possible (no compiler, another platform) the
references here run instead. The references define the semantics, and
the tests hold the C++ to them.
"""
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tornchat.engine import blocks


def _load():
    try:
        return importlib.import_module("tornchat.engine._fused")
    except ImportError:
        return None


_native = _load()  # the compiled module, or None


def build_id() -> str:
    """Which build of the compiled module is loaded (its file's size and time), "" without one: what the
    kernels were measured with (measurements.py) changes with it."""
    if _native is None:
        return ""
    stat = Path(_native.__file__).stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, bf16_out: bool) -> torch.Tensor:
    """RMS norm of fp32 rows, in fp32, rounded to bf16 once if bf16_out."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return y.bfloat16() if bf16_out else y


def rope_store_ref(qkv, freqs, keys, values, heads: int, kv_heads: int, qk_norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor:
    """Rotate queries and keys by RoPE, write keys and values into the cache, return the queries.

    qkv [n, (heads + 2 kv_heads) * head_dim] holds queries, keys and values,
    each head's dimensions in (x1, x2) pairs (``llama.interleave_rope_rows``);
    freqs [n, head_dim / 2, 2] the (cos, sin) of each pair's angle, times the
    RoPE magnitude. keys and values [n, kv_heads, head_dim] are the cache
    rows to fill. ``qk_norm`` [2, head_dim] (Qwen3, in the same pair order):
    each query head and each key head is RMS-normed with eps and weighted by
    row 0 (queries) or 1 (keys) before the rotation. Rotation is in fp32;
    queries come back [n, heads, head_dim] in the cache's dtype.
    """
    rotated = rope_ref(qkv, freqs, heads, kv_heads, keys.shape[-1], qk_norm, eps)
    keys.copy_(rotated[:, heads:])
    values.copy_(qkv[:, (heads + kv_heads) * keys.shape[-1] :].reshape(values.shape))
    return rotated[:, :heads].to(keys.dtype)


def rope_ref(qkv: torch.Tensor, freqs: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
             qk_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``rope_store_ref``'s norms and rotation alone: queries then keys [n, heads + kv_heads, head_dim] in fp32."""
    n = qkv.shape[0]
    x = qkv[:, : (heads + kv_heads) * head_dim].float().reshape(n, heads + kv_heads, head_dim)
    if qk_norm is not None:
        weight = torch.cat([qk_norm[:1].expand(heads, head_dim), qk_norm[1:].expand(kv_heads, head_dim)]).float()
        x = F.rms_norm(x, (head_dim,), None, eps) * weight
    rotated = torch.view_as_complex(x.reshape(n, heads + kv_heads, -1, 2))
    return torch.view_as_real(rotated * torch.view_as_complex(freqs)[:, None]).reshape(n, heads + kv_heads, head_dim)


def attend_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
               window: int = 0) -> torch.Tensor:
    """Causal attention of n decode rows: q [n, heads, head_dim] at positions start .. start + n - 1, over a
    layer's cache, keys and values [capacity, kv_heads, head_dim] (grouped-query: each KV head serves
    heads / kv_heads query heads). Row r attends to positions 0 .. start + r (with ``window``, the last
    ``window`` of them): softmax(scale * q . k) v, in fp32, q rounded to the cache's dtype first, and with a bf16
    cache each weight exp(score - max) rounded to the nearest bf16 (ties away from zero) before the sums (the
    total theirs); returns [n, heads * head_dim]. The C++ decode step's attention (``attend``) computes this."""
    n, heads, head_dim = q.shape
    groups = heads // keys.shape[1]
    rows = []
    for r in range(n):
        seen = start + r + 1
        first = max(0, seen - window) if window else 0
        k = keys[first:seen].float().transpose(0, 1).repeat_interleave(groups, dim=0)  # [heads, seen, head_dim]
        v = values[first:seen].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        query = q[r].to(keys.dtype).float()
        scores = scale * (k @ query[:, :, None])[..., 0]  # [heads, seen]
        weights = (scores - scores.amax(-1, keepdim=True)).exp()
        if keys.dtype == torch.bfloat16:  # to the nearest bf16, ties away from zero (the weights are positive)
            weights = ((weights.view(torch.int32) + 0x8000) & -0x10000).view(torch.float32)
        rows.append(((weights[:, None, :] @ v)[:, 0] / weights.sum(-1, keepdim=True)).reshape(heads * head_dim))
    return torch.stack(rows)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [n, 2F] rows holding gate then up, in fp32, rounded once to the input's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def gelu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_ref`` with GELU's tanh approximation for SiLU (Gemma 3)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
    rope_store: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_mul: Callable[[torch.Tensor], torch.Tensor]


REFERENCE = Ops(rms_norm_ref, rope_store_ref, silu_mul_ref, gelu_mul_ref)
NATIVE = Ops(_native.rms_norm, _native.rope_store, _native.silu_mul, _native.gelu_mul) if _native else None


ATTEND_LANES = 16  # the C++ attention's vectors: head_dim must be a multiple, at most 16 of them
KEY_BLOCK = 16  # positions per block of the C++ forward's keys (forward_layout)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
           window: int = 0, isa: str = "") -> torch.Tensor:
    """The C++ forward's attention (``attend_ref``'s semantics, each row's bits whatever rows come with it), over a
    layer's keys and values in the forward's layout (``forward_layout``). isa: the block kernels' path beside
    which it runs (``blocks.isas()``; "" for ``blocks.isa()``): "avx2" and "avxvnni" run its AVX2 loops, "generic"
    its baseline loops, the others the best this CPU has (with AVX-512 BF16, VDPBF16PS for a bf16 cache's scores;
    "avx512f", where the CPU has AVX-512, the AVX-512 loops without it). Every path gives the same bits, on every
    architecture (csrc/vec.h). With a bf16 cache, q is rounded to bf16 first."""
    return _native.attend(q, keys, values, start, scale, window, isa)


def forward_layout(kv: torch.Tensor) -> torch.Tensor:
    """Caches [..., 2 (keys, values), capacity, kv_heads, head_dim] (capacity a multiple of KEY_BLOCK) as the C++
    forward holds them, the same shape: keys in blocks of 16 positions, transposed, so that one vector holds a
    dimension of 16 keys ([kv_heads, head_dim, 16] a block); in bf16, dimensions 2t and 2t + 1 interleaved
    ([kv_heads, head_dim / 2, 16, 2]). Values in the same blocks, each head's 16 positions together
    ([kv_heads, 16, head_dim]; in bf16 positions 2s and 2s + 1 interleaved, [kv_heads, 8, head_dim, 2]), so
    that one load, a shift and a mask widen two vectors (csrc/kv_layout.h's key_at and value_at)."""
    *lead, _, capacity, kv_heads, head_dim = kv.shape
    keys, values = kv.unbind(-4)
    blocks, n = capacity // KEY_BLOCK, len(lead)
    if kv.dtype == torch.bfloat16:
        keys = keys.reshape(*lead, blocks, KEY_BLOCK, kv_heads, head_dim // 2, 2).movedim(-4, -2)
        # (block, pair, position in pair, head, dim) -> (block, head, pair, dim, position in pair)
        values = values.reshape(*lead, blocks, KEY_BLOCK // 2, 2, kv_heads, head_dim).permute(
            *range(n), n, n + 3, n + 1, n + 4, n + 2)
    else:
        keys = keys.reshape(*lead, blocks, KEY_BLOCK, kv_heads, head_dim).movedim(-3, -1)
        values = values.reshape(*lead, blocks, KEY_BLOCK, kv_heads, head_dim).movedim(-2, -3)
    return torch.stack([keys.reshape(*lead, capacity, kv_heads, head_dim),
                        values.reshape(*lead, capacity, kv_heads, head_dim)], dim=-4)


def standard_layout(kv: torch.Tensor) -> torch.Tensor:
    """``forward_layout`` undone: position-major keys and values, PyTorch's layout."""
    *lead, _, capacity, kv_heads, head_dim = kv.shape
    keys, values = kv.unbind(-4)
    blocks, n = capacity // KEY_BLOCK, len(lead)
    if kv.dtype == torch.bfloat16:
        keys = keys.reshape(*lead, blocks, kv_heads, head_dim // 2, KEY_BLOCK, 2).movedim(-2, -4)
        values = values.reshape(*lead, blocks, kv_heads, KEY_BLOCK // 2, head_dim, 2).permute(
            *range(n), n, n + 2, n + 4, n + 1, n + 3)
    else:
        keys = keys.reshape(*lead, blocks, kv_heads, head_dim, KEY_BLOCK).movedim(-1, -3)
        values = values.reshape(*lead, blocks, kv_heads, KEY_BLOCK, head_dim).movedim(-3, -2)
    return torch.stack([keys.reshape(*lead, capacity, kv_heads, head_dim),
                        values.reshape(*lead, capacity, kv_heads, head_dim)], dim=-4)


def attends(head_dim: int) -> bool:
    """Whether the C++ attention (``attend``) is built and takes this head_dim."""
    return _native is not None and head_dim % ATTEND_LANES == 0 and head_dim <= 16 * ATTEND_LANES


def native_forward(layers, heads: int, kv_heads: int, eps: float, scale: float, isa: str,
                   windows: tuple[int, ...] = (), gelu: bool = False):
    """The C++ ``Forward`` over these layers (``llama.Layer``, every matrix a ``quant.BlockWeight``): one
    call runs a chunk of rows through every layer, computing what ``LlamaRunner._layers`` does, each row as
    if alone (``attend``, the block kernels on instruction-set path ``isa``). Gemma 3: ``windows`` each
    layer's attention window (0: none; a windowed layer takes the forward's second RoPE table), ``gelu`` GELU
    gating, and the layers' post-attention and post-MLP norms. None where the extension is not built."""
    if _native is None:
        return None
    vectors, parts, types = [], [], []
    for layer in layers:
        vectors += [layer.attn_norm, layer.ffn_norm] + [_EMPTY if v is None else v for v in (layer.bqkv, layer.qk_norm)]
        for w in (layer.wqkv, layer.wo, layer.w13, layer.w2):  # w13, w2 None where the layer has experts instead
            parts.append([] if w is None else list(w.parts))
            types.append([] if w is None else _type_ids(w))
    forward = _native.Forward(vectors, parts, types, heads, kv_heads, eps, scale, isa)
    if gelu or windows or any(layer.post_attn_norm is not None for layer in layers):
        norms = [_EMPTY if v is None else v for layer in layers for v in (layer.post_attn_norm, layer.post_ffn_norm)]
        forward.gemma(norms, list(windows) or [0] * len(layers), gelu)
    for i, layer in enumerate(layers):
        moe = layer.moe
        if moe is not None:  # the router in fp32, as F32 blocks
            forward.set_experts(i, [moe.router.float().contiguous().view(torch.uint8)], [blocks.TYPE_IDS["F32"]],
                                [list(w.parts) for w in moe.w13], [_type_ids(w) for w in moe.w13],
                                [list(w.parts) for w in moe.w2], [_type_ids(w) for w in moe.w2], moe.top_k, moe.norm_top_k)
    return forward


def _type_ids(weight) -> list[int]:
    return [blocks.TYPE_IDS[t] for t in weight.types]


_EMPTY = torch.empty(0)


def ops_for(device: torch.device, dtype: torch.dtype) -> Ops:
    """The C++ ops for an fp32 model on the CPU where they are built, else the references."""
    if NATIVE is not None and device.type == "cpu" and dtype == torch.float32:
        return NATIVE
    return REFERENCE
