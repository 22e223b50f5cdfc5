"""A lean forward for the Llama family (Llama, Qwen2, Mistral; SmolLM2 is Llama).

transformers' modules spend about as long in Python and dispatcher overhead
as in the matmuls of a small model's decode step (PERF-NOTES.md). This is
the same computation as plain functions over tensors, gpt-fast style: fused
QKV and gate/up weights, RoPE as one complex multiply over queries and keys
together, a KV cache per slot that grows in chunks, SDPA attention.
Weights, config and tokenizer still come from transformers' loaded model.
"""
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tornchat.engine import cuda_graph, fused, quant
from tornchat.engine.chunk_attention import attend as attend_chunk, runs as chunk_attention_runs

FAMILIES = ("llama", "qwen2", "mistral")
QUANTIZE = ("none", "bf16", "int8", "int4")
MATRICES = ("wqkv", "wo", "w13", "w2")  # a Layer's matrices, in the order matrices() gives them
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the sequence length
CACHE_CHUNK = 256  # positions a cache grows by; kv_memory_mb measures what is allocated


class Layer(NamedTuple):
    attn_norm: torch.Tensor
    wqkv: quant.Weight  # queries, keys, values stacked, each head's rows in RoPE pairs (interleave_rope_rows)
    bqkv: torch.Tensor | None  # Qwen2 has q/k/v biases
    wo: quant.Weight
    ffn_norm: torch.Tensor
    w13: quant.Weight  # gate and up, stacked
    w2: quant.Weight

    def matrices(self) -> tuple[quant.Weight, ...]:
        return tuple(getattr(self, role) for role in MATRICES)

    def packed(self, pack) -> "Layer":
        return self._replace(**{role: pack(getattr(self, role)) for role in MATRICES})


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    context_length: int
    inv_freq: torch.Tensor  # [head_dim / 2] RoPE frequencies, scaling applied
    rope_magnitude: float = 1.0  # YaRN-style attention scaling folded into the rotation


@dataclass
class LlamaWeights:
    """One copy of the model's weights, in whatever format each matrix is stored (``quant.Weight``).

    ``embed`` is anything ``quant.dequantize`` reads rows of: a plain tensor,
    the packed output projection when the two are tied, or a GGUF tensor
    left in the file (``weights.gguf_file``)."""

    embed: object
    layers: list[Layer]
    final_norm: torch.Tensor
    head: quant.Weight


@dataclass(eq=False)  # identity: comparing caches would compare tensors
class KVCache:
    kv: torch.Tensor  # [layers, 2, capacity, kv_heads, head_dim]
    length: int = 0


def unsupported_reason(config) -> str | None:
    """Why a model of this transformers config cannot run on the lean forward, or None if it can."""
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "only SiLU-gated MLPs without bias"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        return "sliding-window attention"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        return f"RoPE type {rope_type!r}"
    return None


def interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows from halves (x1..., x2...) to pairs (x1, x2), ...

    transformers rotates the two halves of a head; pairing them lets one
    complex multiply do RoPE. Queries and keys get the same order, so their
    dot products, and the attention, are unchanged. (llama.cpp's converter
    stores Llama GGUFs in this order already.)
    """
    rest = weight.shape[1:]
    return weight.reshape(heads, 2, -1, *rest).transpose(1, 2).reshape(weight.shape)


def config_of(config) -> LlamaConfig:
    """The lean forward's config from a transformers config (``unsupported_reason`` None), RoPE frequencies
    and scaling computed by the family's own rotary embedding."""
    import importlib

    family = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    rotary = getattr(family, type(config).__name__.removesuffix("Config") + "RotaryEmbedding")(config)  # LlamaRotaryEmbedding
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return LlamaConfig(
        hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=head_dim, eps=config.rms_norm_eps, context_length=int(config.max_position_embeddings),
        inv_freq=rotary.inv_freq.detach().float(), rope_magnitude=float(rotary.attention_scaling),
    )


def from_transformers(model: torch.nn.Module) -> tuple[LlamaConfig, LlamaWeights]:
    """Config and plain weights of a transformers Llama-family model (``unsupported_reason`` None)."""
    inner = model.model
    spec = config_of(model.config)

    def layer(block) -> Layer:
        attn, mlp = block.self_attn, block.mlp
        q = interleave_rope_rows(attn.q_proj.weight.detach(), spec.heads)
        k = interleave_rope_rows(attn.k_proj.weight.detach(), spec.kv_heads)
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([
                interleave_rope_rows(attn.q_proj.bias.detach(), spec.heads),
                interleave_rope_rows(attn.k_proj.bias.detach(), spec.kv_heads),
                attn.v_proj.bias.detach(),
            ])
        return Layer(
            attn_norm=block.input_layernorm.weight.detach(),
            wqkv=torch.cat([q, k, attn.v_proj.weight.detach()]),
            bqkv=bias,
            wo=attn.o_proj.weight.detach(),
            ffn_norm=block.post_attention_layernorm.weight.detach(),
            w13=torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]),
            w2=mlp.down_proj.weight.detach(),
        )

    embed, head = inner.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    if head.data_ptr() == embed.data_ptr():  # tied: one tensor for both, which pack() keeps as one
        embed = head
    weights = LlamaWeights(embed=embed, layers=[layer(b) for b in inner.layers], final_norm=inner.norm.weight.detach(),
                           head=head)
    return spec, weights


def packers(quantize: str, inputs: torch.dtype, group_size: int = 32, weights_on_cuda: bool = False):
    """(pack a layer matrix, pack the output projection) for a decode format, or (None, None) for none.
    On CUDA only int4 packs (tinygemm)."""
    if quantize == "none":
        return None, None
    if quantize == "bf16":
        return quant.to_bf16, quant.to_bf16

    def int8(weight):
        return quant.quantize_int8(weight, inputs)

    def int4(weight):  # odd shapes stay as they are
        if weight.is_cuda:  # tinygemm; its head is int4 too (no int8 kernel there)
            return quant.quantize_int4_cuda(weight, group_size) if quant.cuda_supports(weight, group_size) else weight
        return quant.quantize_int4(weight, group_size, inputs) if quant.supports(weight, group_size) else weight

    if quantize == "int4" and weights_on_cuda:
        return int4, int4

    return (int4 if quantize == "int4" else int8), int8


def pack(weights: LlamaWeights, quantize: str, inputs: torch.dtype = torch.bfloat16, group_size: int = 32,
         keep: bool = False) -> LlamaWeights:
    """Plain weights in a decode format (``QUANTIZE``), one layer at a time. Unless ``keep``, each plain
    layer is dropped once packed, so that the model is never held twice. The embedding reads its rows from
    the packed head where the two were the same tensor and the head's format can give rows back."""
    if quantize not in QUANTIZE:
        raise ValueError(f"unknown quantize mode {quantize!r} ({' | '.join(QUANTIZE)})")
    on_cuda = weights.final_norm.is_cuda
    if on_cuda and quantize not in ("none", "int4"):
        raise ValueError(f"quantize {quantize!r} has no CUDA kernels here (none | int4)")
    pack_layer, pack_head = packers(quantize, inputs, group_size, on_cuda)
    if pack_layer is None:
        return weights
    packed = []
    for i, layer in enumerate(weights.layers):
        packed.append(layer.packed(pack_layer))
        if not keep:
            weights.layers[i] = None  # the caller gives the plain weights up: free each layer once packed
    head = pack_head(weights.head)
    return LlamaWeights(embed=shared_embedding(weights, head), layers=packed, final_norm=weights.final_norm, head=head)


def shared_embedding(weights: LlamaWeights, head: quant.Weight) -> object:
    """The embedding beside ``head``, a repacked weights.head: head itself where embedding and head were one
    tensor and head's format gives rows back (one copy), else the embedding as it was."""
    readable = quant.dequantize(head, torch.float32, torch.zeros(1, dtype=torch.long)) is not None
    return head if weights.embed is weights.head and readable else weights.embed


def weights_label(weights: LlamaWeights) -> str:
    """The formats the layer matrices and the head are stored in, for logs: "int4 x 120, int8 x 30; head int8"."""
    def name(w) -> str:
        if isinstance(w, torch.Tensor):
            return str(w.dtype).removeprefix("torch.")
        if isinstance(w, quant.CudaInt4Weight):
            return f"int4 (tinygemm, group {w.group_size})"
        kind = {quant.Int4Weight: "int4", quant.Int8Weight: "int8", quant.Bf16Weight: "bf16 (oneDNN)"}[type(w)]
        return kind + (" (vnni)" if getattr(w, "vnni", False) else "")
    counts = Counter(name(m) for layer in weights.layers for m in layer.matrices())
    return ", ".join(f"{k} x {v}" for k, v in counts.most_common()) + f"; head {name(weights.head)}"


class LlamaRunner:
    """Implements ``model.Runner`` over one copy of the weights (``LlamaWeights``), in any format.

    A decode step streams every weight once, so its speed is bytes per token:
    packed formats (``pack``; or a GGUF's own blocks, ``weights.gguf_file``)
    make it faster. ``int4``: PyTorch's int4 CPU kernel (group 32,
    asymmetric: Q4_0, Q4_1 and Q4_K blocks map onto it exactly), ``int8``:
    one scale per row; ``bf16``: oneDNN's packed layout where it runs. The
    int4 and int8 kernels are fed inputs of the dtype their scales are in;
    which one is fast depends on the CPU (``engine/autotune.py`` times both).

    A prefill chunk is a matrix product, bound by arithmetic rather than by
    bytes: from ``prefill_from`` rows up, each layer's matrices are
    dequantized into ``prefill_dtype`` (bf16 matmuls were 4.3-4.7x faster
    than fp32 on 512 rows with AVX-512 BF16) while that layer runs, and
    dropped after it, or with ``torch.int8`` multiplied in int8 on the chunk's
    rows quantized to int8 (``quant.DynamicInt8Weight``: 2x bf16's speed with
    AVX-512 VNNI); shorter chunks run the decode kernels. No second copy of
    the model is kept for prefill.
    ``kv_dtype``: the KV cache's dtype (default: the model's); a bf16 cache
    reads half the bytes in attention over a long context.
    ``ops``: the small per-layer operations (``fused.py``; default: C++ on
    the CPU where built). ``attention``: the C++ step's, ``own`` (``fused.attend``,
    2x faster than SDPA on the embedded model's 9 heads, slower on 32) or
    ``sdpa``; autotune times both. With the C++ ones a one-token decode step runs all
    layers in one C++ call (``decode_step``), else the loop in ``_layers``.
    ``chunk_attention``: a chunk's (more than one row), ``sdpa`` or, over a bf16 cache on a
    CPU, ``products`` (``chunk_attention.attend``: 1.5-2.5x faster than SDPA on Zen 5);
    autotune times both.
    Norms and the residual stream stay in fp32 (the model's dtype), and
    each projection's input is cast to what its kernel takes.
    """

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, kv_dtype: torch.dtype | None = None,
                 prefill_dtype: torch.dtype | None = None, prefill_from: int = 1, ops: fused.Ops | None = None,
                 attention: str = "sdpa", graphs: bool = True, chunk_attention: str = "sdpa"):
        self.config, self.weights = config, weights
        self.layers, self.head, self.final_norm = weights.layers, weights.head, weights.final_norm
        self.device, self.dtype = weights.final_norm.device, weights.final_norm.dtype
        self.context_length = config.context_length
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        self.eps, self.hidden = config.eps, config.hidden

        positions = torch.arange(self.context_length, dtype=torch.float32, device=self.device)
        angles = torch.outer(positions, config.inv_freq.to(self.device))
        magnitude = torch.full_like(angles, config.rope_magnitude)
        self.rope = torch.view_as_real(torch.polar(magnitude, angles)).contiguous()  # [context, head_dim / 2, (cos, sin)]
        self.ops = ops or fused.ops_for(self.device, self.dtype)
        self.kv_dtype = kv_dtype or self.dtype
        self.prefill_dtype, self.prefill_from = prefill_dtype, prefill_from
        self.scratch: dict = {}  # one layer's matrices dequantized for prefill, a buffer per role reused (as_plain)
        # On CUDA, one-token steps replay a captured graph (cuda_graph.py) unless ``graphs`` is off.
        self.graphs = cuda_graph.GraphedSteps(self) if graphs and self.device.type == "cuda" else None
        self.chunk_attention = "sdpa"
        if chunk_attention == "products" and chunk_attention_runs(self.kv_dtype, self.device):
            self.chunk_attention = "products"
        self.decode_step = None  # the C++ step over the layers where the native ops run; None: the Python loop
        self.attention = "sdpa"  # the decode step's: "own" (fused.attend) or PyTorch's SDPA
        if self.ops is fused.NATIVE:
            self.attention = attention if attention == "sdpa" or fused.attends(self.head_dim) else "sdpa"
            self.decode_step = fused.native_decode_step(self.layers, self.heads, self.kv_heads, self.eps, self.scale,
                                                        self.attention == "own")

    def label(self) -> str:
        prefill = "kernels"
        if self.prefill_dtype == torch.int8:
            prefill = f"int8 products from {self.prefill_from} rows"
        elif self.prefill_dtype is not None:
            prefill = f"dequantized to {self.prefill_dtype} from {self.prefill_from} rows"
        chunks = ", products chunk attention" if self.chunk_attention == "products" else ""
        return f"{weights_label(self.weights)}; {self.kv_dtype} cache, {self.attention} attention{chunks}; prefill {prefill}"

    def new_cache(self) -> KVCache:
        shape = (len(self.layers), 2, 0, self.kv_heads, self.head_dim)
        return KVCache(torch.empty(shape, dtype=self.kv_dtype, device=self.device))

    def truncate(self, cache: KVCache, length: int) -> None:
        cache.length = min(cache.length, length)

    def fork(self, cache: KVCache, length: int) -> KVCache:
        """A new cache holding a copy of the first ``length`` positions of cache."""
        forked = self.new_cache()
        self._reserve(forked, length)
        forked.length = min(length, cache.length)
        forked.kv[:, :, : forked.length] = cache.kv[:, :, : forked.length]
        return forked

    def cache_bytes(self, cache: KVCache) -> int:
        return cache.kv.numel() * cache.kv.element_size()

    def _reserve(self, cache: KVCache, length: int) -> None:
        capacity = cache.kv.shape[2]
        if length <= capacity:
            return
        if length > self.context_length:
            raise ValueError(f"{length} positions exceed the context of {self.context_length}")
        grown = -(-length // CACHE_CHUNK) * CACHE_CHUNK
        if self.graphs is not None:  # each new cache tensor is a new graph capture: few of them
            grown = max(grown, 2 * capacity)
        grown = min(grown, self.context_length)
        kv = cache.kv.new_empty((*cache.kv.shape[:2], grown, *cache.kv.shape[3:]))
        kv[:, :, : cache.length] = cache.kv[:, :, : cache.length]
        cache.kv = kv

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: KVCache, decode: bool = False) -> torch.Tensor:
        if decode and self.graphs is not None and len(token_ids) == 1:
            start = cache.length
            self._reserve(cache, start + 1)
            logits = self.graphs(token_ids[0], cache.kv, start)
            cache.length = start + 1
            return logits
        x = self._hidden(token_ids, cache, self._weights_as(len(token_ids), decode))
        return self._logits(x[-1:], None)[0]

    @torch.inference_mode()
    def verify(self, token_ids: list[int], cache: KVCache) -> torch.Tensor:
        """fp32 logits [n, V] after each of token_ids appended to cache: bit for bit what n one-token decode
        steps give (``DecodeStep`` over n rows where it runs, else the steps themselves)."""
        if self.decode_step is None:
            return torch.stack([self.forward([token], cache, decode=True) for token in token_ids])
        x = self._hidden(token_ids, cache, None, steps=True)
        if isinstance(self.head, quant.Int4Weight | quant.Int8Weight):  # kernels whose rows do not interact
            return self._logits(x, None)
        return torch.cat([self._logits(row, None) for row in x.split(1)])

    @torch.inference_mode()
    def score(self, token_ids: list[int], mode: str) -> torch.Tensor:
        """fp32 logits [n, V] of every position of token_ids from an empty cache, in one pass: as a prefill
        chunk of that length computes them (``prefill``), through the decode kernels on every row
        (``decode``), or with every matrix dequantized to fp32 (``exact``: the reference the packed formats
        are measured against, one layer dequantized at a time)."""
        weights_as = {"prefill": self._weights_as(len(token_ids), False), "decode": None, "exact": torch.float32}[mode]
        return self._logits(self._hidden(token_ids, self.new_cache(), weights_as), weights_as)

    def _weights_as(self, rows: int, decode: bool) -> torch.dtype | None:
        """The dtype a forward of this many rows dequantizes the matrices into, or None for the kernels."""
        return self.prefill_dtype if not decode and rows >= self.prefill_from else None

    def _logits(self, x: torch.Tensor, weights_as: torch.dtype | None) -> torch.Tensor:
        # A prefill's logits are its last row's, through the decode kernels (forward): an int8 head on every row
        # of a score would measure what no chunk computes.
        head = as_plain(self.head, None if weights_as == torch.int8 else weights_as)
        h = self.ops.rms_norm(x, self.final_norm, self.eps, quant.input_dtype(head) == torch.bfloat16)
        return quant.linear(h, head).float()

    def _hidden(self, token_ids: list[int], cache: KVCache, weights_as: torch.dtype | None,
                steps: bool = False) -> torch.Tensor:
        """Run token_ids through the layers, appending to cache: the residual stream [n, hidden] after them.
        ``steps``: each row as a one-token decode step computes it (``verify``)."""
        n, start = len(token_ids), cache.length
        self._reserve(cache, start + n)
        ids = torch.tensor(token_ids, device=self.device)
        x = quant.dequantize(self.weights.embed, self.dtype, ids)
        if (n == 1 or steps) and weights_as is None and self.decode_step is not None:
            x = self.decode_step.forward(x, cache.kv, self.rope[start : start + n], start)  # _layers in one C++ call
        else:
            x = self._layers(x, cache, start, weights_as)
        cache.length = start + n
        return x

    def _layers(self, x: torch.Tensor, cache: KVCache, start: int, weights_as: torch.dtype | None) -> torch.Tensor:
        n, end = x.shape[0], start + x.shape[0]
        # The C++ ops save per-op overhead, which only one-row steps feel; on a prefill chunk PyTorch's
        # vectorized kernels are faster (2,000-token prefill 906 -> 1,044 tokens/s with them).
        ops, eps = self.ops if n == 1 else fused.REFERENCE, self.eps
        heads, kv_heads = self.heads, self.kv_heads
        freqs = self.rope[start:end]
        attend = attend_chunk
        if n == 1 or self.chunk_attention == "sdpa":  # the causal mask made once for every layer
            attend = partial(sdpa_attend, mask=causal_mask(start, n, heads // kv_heads, self.device) if n > 1 else None)
        for i, packed in enumerate(self.layers):
            layer = packed
            if weights_as is not None:
                layer = packed._replace(**{role: as_plain(getattr(packed, role), weights_as, self.scratch, role)
                                           for role in MATRICES})
            h = ops.rms_norm(x, layer.attn_norm, eps, quant.input_dtype(layer.wqkv) == torch.bfloat16)
            qkv = quant.linear(h, layer.wqkv)
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            keys, values = cache.kv[i].unbind()  # [capacity, kv_heads, head_dim] each
            q = ops.rope_store(qkv, freqs, keys[start:end], values[start:end], heads, kv_heads)
            out = attend(q, keys, values, start, self.scale)
            x = x + quant.linear(out, layer.wo)
            h = ops.rms_norm(x, layer.ffn_norm, eps, quant.input_dtype(layer.w13) == torch.bfloat16)
            x = x + quant.linear(ops.silu_mul(quant.linear(h, layer.w13)), layer.w2)
        return x


def causal_mask(start: int, n: int, groups: int, device: torch.device) -> torch.Tensor:
    """Which positions 0 .. start + n - 1 each of n rows at start .. sees, for ``sdpa_attend``'s folded rows."""
    positions = torch.arange(start + n, device=device)
    return (positions[None, :] <= positions[start:, None]).repeat(groups, 1)


def sdpa_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """``fused.attend_ref``'s attention of q [n, heads, head_dim] at positions start .. over a layer's cache by
    PyTorch's SDPA; ``mask``: ``causal_mask``'s, made here if not given (one-row steps need none). Queries are
    folded to [kv_heads, groups * n, head_dim] so that each KV head serves its group without copying keys
    (grouped-query attention); rows are ordered (group, position), as the mask's repeat has them."""
    n, heads, head_dim = q.shape
    kv_heads, end = keys.shape[1], start + n
    if mask is None and n > 1:
        mask = causal_mask(start, n, heads // kv_heads, q.device)
    # 4-D so that SDPA takes its fused CPU kernel rather than the math path.
    q = q.transpose(0, 1).reshape(1, kv_heads, heads // kv_heads * n, head_dim)
    out = F.scaled_dot_product_attention(q, keys[None, :end].transpose(1, 2), values[None, :end].transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    # reshape, not view: CUDA's SDPA kernels return a non-contiguous layout.
    return out.reshape(heads, n, head_dim).transpose(0, 1).reshape(n, heads * head_dim)


def as_plain(w: quant.Weight, dtype: torch.dtype | None, scratch: dict | None = None, role: str = "") -> quant.Weight:
    """w dequantized into dtype for one use, or w itself (no dtype asked, or a layout read only by its kernel).
    ``torch.int8``: int4 and int8 weights multiplied in int8 on inputs quantized per row
    (``quant.DynamicInt8Weight``), others as they are. ``scratch``: buffers by (role, dtype) that packed int4
    weights are dequantized into, and one (under torch.int8) that every int8 product works in, reused from
    layer to layer and chunk to chunk (``LlamaRunner.scratch``)."""
    if dtype is None:
        return w
    if dtype == torch.int8:
        buffer = torch.empty(0, dtype=torch.uint8) if scratch is None else scratch.setdefault(
            torch.int8, torch.empty(0, dtype=torch.uint8))
        return quant.dynamic_int8(w, buffer) or w
    into = None
    if scratch is not None and isinstance(w, quant.Int4Weight):
        n, k = quant.shape(w)
        into = scratch.get((role, dtype))
        if into is None or into.shape != (k, n):
            into = scratch[(role, dtype)] = torch.empty(k, n, dtype=dtype)
    plain = quant.dequantize(w, dtype, into=into)
    return w if plain is None else plain
