"""A lean forward for the Llama family (Llama, Qwen2, Mistral; SmolLM2 is Llama).

transformers' modules spend about as long in Python and dispatcher overhead
as in the matmuls of a small model's decode step (PERF-NOTES.md). This is
the same computation as plain functions over tensors, gpt-fast style: fused
QKV and gate/up weights, RoPE as one complex multiply over queries and keys
together, a KV cache per slot that grows in chunks, SDPA attention.
Weights, config and tokenizer still come from transformers' loaded model.
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tornchat.engine import fused, quant

FAMILIES = ("llama", "qwen2", "mistral")
QUANTIZE = ("none", "bf16", "int8", "int4")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the sequence length
CACHE_CHUNK = 256  # positions a cache grows by; kv_memory_mb measures what is allocated


class Layer(NamedTuple):
    attn_norm: torch.Tensor
    wqkv: quant.Weight  # packed ones for decode steps
    bqkv: torch.Tensor | None  # Qwen2 has q/k/v biases
    wo: quant.Weight
    ffn_norm: torch.Tensor
    w13: quant.Weight  # gate and up, stacked
    w2: quant.Weight

    def matrices(self) -> tuple[quant.Weight, ...]:
        return self.wqkv, self.wo, self.w13, self.w2


@dataclass(eq=False)  # identity: comparing caches would compare tensors
class KVCache:
    kv: torch.Tensor  # [layers, 2, capacity, kv_heads, head_dim]
    length: int = 0


def unsupported_reason(model) -> str | None:
    """Why this model cannot run on the lean forward, or None if it can."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "only SiLU-gated MLPs without bias"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        return "sliding-window attention"
    rope_type = model.model.rotary_emb.rope_type
    if rope_type not in STATIC_ROPE:
        return f"RoPE type {rope_type!r}"
    return None


def interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows from halves (x1..., x2...) to pairs (x1, x2), ...

    transformers rotates the two halves of a head; pairing them lets one
    complex multiply do RoPE. Queries and keys get the same order, so their
    dot products, and the attention, are unchanged.
    """
    rest = weight.shape[1:]
    return weight.reshape(heads, 2, -1, *rest).transpose(1, 2).reshape(weight.shape)


def packers(quantize: str, inputs: torch.dtype, group_size: int = 32):
    """(pack a layer matrix, pack the output projection) for a decode format, or (None, None) for none."""
    if quantize == "none":
        return None, None
    if quantize == "bf16":
        return quant.to_bf16, quant.to_bf16

    def int8(weight):
        return quant.quantize_int8(weight, inputs)

    def int4(weight):  # odd shapes stay as they are
        return quant.quantize_int4(weight, group_size, inputs) if quant.supports(weight, group_size) else weight

    return (int4 if quantize == "int4" else int8), int8


class LlamaRunner:
    """Implements ``model.Runner``. ``quantize`` picks the weights decode steps read.

    A decode step streams every weight once, so its speed is bytes per token.
    ``bf16``: bf16 copies of the layer weights and the output projection
    (``quant.to_bf16``: oneDNN's packed layout where it runs).
    ``int8``: layer weights and output projection in int8 with a scale per row.
    ``int4``: layer weights packed for PyTorch's int4 CPU kernel (group 32,
    asymmetric: a Q4_1 GGUF's layers round-trip exactly), and the output
    projection in int8 with a scale per row: on SmolLM2 an int4 head raised
    perplexity by 8% and changed 17% of greedy choices, the int8 one neither
    (its GGUF stores the head as Q8_0).
    ``inputs``: the dtype the int4 and int8 kernels are fed; which one is
    fast depends on the CPU (``engine/autotune.py`` times both).
    ``kv_dtype``: the KV cache's dtype (default: the model's); a bf16 cache
    reads half the bytes in attention over a long context. Prefill and
    decode share the cache.
    ``prefill_bf16``: prefill reads bf16 copies of the layer weights instead
    of the model's own (4.3-4.7x faster 512-row matmuls on an AVX-512 BF16
    CPU; no gain without bf16 hardware). Every prefill does, however short,
    so a prompt's logits still do not depend on how much of it was cached.
    ``ops``: the small per-layer operations (``fused.py``; default: C++ on
    the CPU where built). With the C++ ones a one-token decode step runs all
    layers in one C++ call (``decode_step``), else the loop in ``_layers``.
    All are weight-only: norms and the residual stream stay in the model's
    dtype, and each projection's input is cast to what its kernel takes.

    Prefill reads the model's own weights, or bf16 copies (``prefill_bf16``):
    a 512-row chunk is a matrix product, bound by arithmetic rather than by
    bytes, so the packed decode formats do not pay there.
    """

    def __init__(self, model: torch.nn.Module, quantize: str = "none", inputs: torch.dtype = torch.bfloat16,
                 kv_dtype: torch.dtype | None = None, prefill_bf16: bool = False, group_size: int = 32,
                 ops: fused.Ops | None = None):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        if quantize not in QUANTIZE:
            raise ValueError(f"unknown quantize mode {quantize!r} ({' | '.join(QUANTIZE)})")
        config, inner = model.config, model.model
        attn = inner.layers[0].self_attn
        self.device = inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype
        self.context_length = int(config.max_position_embeddings)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.eps = config.rms_norm_eps
        self.hidden = config.hidden_size
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.layers = [self._fuse(layer) for layer in inner.layers]

        rope = inner.rotary_emb
        positions = torch.arange(self.context_length, dtype=torch.float32, device=self.device)
        angles = torch.outer(positions, rope.inv_freq.float().to(self.device))
        magnitude = torch.full_like(angles, float(rope.attention_scaling))
        self.rope = torch.view_as_real(torch.polar(magnitude, angles)).contiguous()  # [context, head_dim / 2, (cos, sin)]
        self.ops = ops or fused.ops_for(self.device, self.dtype)

        self.quantize, self.inputs = quantize, inputs
        self.kv_dtype = kv_dtype or self.dtype
        self.decode_layers, self.decode_head = self.layers, self.lm_head
        if self.device.type == "cpu":  # the packed kernels are CPU ones; elsewhere decode reads the model's weights
            pack_layer, pack_head = packers(quantize, inputs, group_size)
            if pack_layer:
                self.decode_layers = [self._pack(layer, pack_layer) for layer in self.layers]
                self.decode_head = pack_head(self.lm_head)
        self.prefill_bf16 = prefill_bf16 and self.device.type == "cpu"
        if self.prefill_bf16:  # after packing decode weights from the model's own
            self.layers = [self._pack(layer, quant.to_bf16) for layer in self.layers]
        self.decode_step = None  # the C++ step over decode_layers where the native ops run; None: the Python loop
        if self.ops is fused.NATIVE:
            self.decode_step = fused.native_decode_step(self.decode_layers, self.heads, self.kv_heads, self.eps, self.scale)

    def _fuse(self, layer) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q = interleave_rope_rows(attn.q_proj.weight.detach(), self.heads)
        k = interleave_rope_rows(attn.k_proj.weight.detach(), self.kv_heads)
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([
                interleave_rope_rows(attn.q_proj.bias.detach(), self.heads),
                interleave_rope_rows(attn.k_proj.bias.detach(), self.kv_heads),
                attn.v_proj.bias.detach(),
            ])
        return Layer(
            attn_norm=layer.input_layernorm.weight.detach(),
            wqkv=torch.cat([q, k, attn.v_proj.weight.detach()]),
            bqkv=bias,
            wo=attn.o_proj.weight.detach(),
            ffn_norm=layer.post_attention_layernorm.weight.detach(),
            w13=torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]),
            w2=mlp.down_proj.weight.detach(),
        )

    @staticmethod
    def _pack(layer: Layer, pack) -> Layer:
        return layer._replace(wqkv=pack(layer.wqkv), wo=pack(layer.wo), w13=pack(layer.w13), w2=pack(layer.w2))

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
        grown = min(-(-length // CACHE_CHUNK) * CACHE_CHUNK, self.context_length)
        kv = cache.kv.new_empty((*cache.kv.shape[:2], grown, *cache.kv.shape[3:]))
        kv[:, :, : cache.length] = cache.kv[:, :, : cache.length]
        cache.kv = kv

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: KVCache, decode: bool = False) -> torch.Tensor:
        x = self._hidden(token_ids, cache, decode)
        return self._logits(x[-1:], decode)[0]

    @torch.inference_mode()
    def score(self, token_ids: list[int], decode: bool) -> torch.Tensor:
        """fp32 logits [n, V] of every position of token_ids from an empty cache, through the decode
        weights if ``decode`` (in one multi-row pass): what autotune compares formats by."""
        return self._logits(self._hidden(token_ids, self.new_cache(), decode), decode)

    def _logits(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        head = self.decode_head if decode else self.lm_head
        h = self.ops.rms_norm(x, self.final_norm, self.eps, quant.input_dtype(head) == torch.bfloat16)
        return quant.linear(h, head).float()

    def _hidden(self, token_ids: list[int], cache: KVCache, decode: bool) -> torch.Tensor:
        """Run token_ids through the layers, appending to cache: the residual stream [n, hidden] after them."""
        n, start = len(token_ids), cache.length
        self._reserve(cache, start + n)
        x = F.embedding(torch.tensor(token_ids, device=self.device), self.embed)
        if decode and n == 1 and self.decode_step is not None:
            x = self.decode_step.forward(x, cache.kv, self.rope[start : start + 1], start)  # _layers in one C++ call
        else:
            x = self._layers(x, self.decode_layers if decode else self.layers, cache, start)
        cache.length = start + n
        return x

    def _layers(self, x: torch.Tensor, layers: list[Layer], cache: KVCache, start: int) -> torch.Tensor:
        n, end = x.shape[0], start + x.shape[0]
        # The C++ ops save per-op overhead, which only one-row steps feel; on a prefill chunk PyTorch's
        # vectorized kernels are faster (2,000-token prefill 906 -> 1,044 tokens/s with them).
        ops, eps = self.ops if n == 1 else fused.REFERENCE, self.eps
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        groups = heads // kv_heads
        freqs = self.rope[start:end]
        # Queries are folded to [kv_heads, groups * n, head_dim] so that each
        # KV head serves its group without copying keys (grouped-query
        # attention); rows are ordered (group, position), hence the repeat.
        mask = None
        if n > 1:
            positions = torch.arange(end, device=self.device)
            mask = (positions[None, :] <= positions[start:, None]).repeat(groups, 1)
        for i, layer in enumerate(layers):
            h = ops.rms_norm(x, layer.attn_norm, eps, quant.input_dtype(layer.wqkv) == torch.bfloat16)
            qkv = quant.linear(h, layer.wqkv)
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            keys, values = cache.kv[i].unbind()  # [capacity, kv_heads, head_dim] each
            q = ops.rope_store(qkv, freqs, keys[start:end], values[start:end], heads, kv_heads)
            # 4-D so that SDPA takes its fused CPU kernel rather than the math path.
            q = q.transpose(0, 1).reshape(1, kv_heads, groups * n, head_dim)
            out = F.scaled_dot_product_attention(
                q, keys[None, :end].transpose(1, 2), values[None, :end].transpose(1, 2), attn_mask=mask, scale=self.scale
            )
            # reshape, not view: CUDA's SDPA kernels return a non-contiguous layout.
            out = out.reshape(heads, n, head_dim).transpose(0, 1).reshape(n, heads * head_dim)
            x = x + quant.linear(out, layer.wo)
            h = ops.rms_norm(x, layer.ffn_norm, eps, quant.input_dtype(layer.w13) == torch.bfloat16)
            x = x + quant.linear(ops.silu_mul(quant.linear(h, layer.w13)), layer.w2)
        return x
