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

from tornchat.engine import quant

FAMILIES = ("llama", "qwen2", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the sequence length
CACHE_CHUNK = 256  # positions a cache grows by; kv_memory_mb measures what is allocated


class Layer(NamedTuple):
    attn_norm: torch.Tensor
    wqkv: torch.Tensor | quant.Int4Weight | quant.Bf16Weight  # packed ones for decode steps
    bqkv: torch.Tensor | None  # Qwen2 has q/k/v biases
    wo: torch.Tensor | quant.Int4Weight | quant.Bf16Weight
    ffn_norm: torch.Tensor
    w13: torch.Tensor | quant.Int4Weight | quant.Bf16Weight  # gate and up, stacked
    w2: torch.Tensor | quant.Int4Weight | quant.Bf16Weight


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


class LlamaRunner:
    """Implements ``model.Runner``. ``quantize`` picks the weights decode steps read.

    A decode step streams every weight once, so its speed is bytes per token.
    ``bf16``: bf16 copies of the layer weights and the output projection in
    oneDNN's packed layout.
    ``int4``: layer weights packed for PyTorch's int4 CPU kernel (group 32,
    asymmetric: a Q4_1 GGUF's layers round-trip exactly), and the output
    projection in int8 with a scale per row: on SmolLM2 an int4 head raised
    perplexity by 8% and changed 17% of greedy choices, the int8 one neither
    (its GGUF stores the head as Q8_0). Where the int8 kernel is slow (CPUs
    without AVX-512 BF16), the head stays as loaded.
    Both are weight-only: norms and the residual stream stay in the model's
    dtype, and each projection's input is cast to what its kernel takes.
    With either, on a CPU with AVX-512 BF16, the KV cache holds bf16 too:
    attention over a long context reads half the bytes (decode at 2,000
    tokens +10%, prefill +21%). Prefill and decode share that cache.
    Which one pays depends on the CPU (README, bench/decode_speed.py).

    Prefill keeps the model's own weights: a 512-row chunk is a matrix
    product, bound by arithmetic rather than by bytes.
    """

    def __init__(self, model: torch.nn.Module, quantize: str = "none", group_size: int = 32):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"the lean forward does not support this model: {reason}")
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
        self.freqs_cis = torch.polar(magnitude, angles)  # [context, head_dim / 2]

        self.quantize = quantize
        self.decode_layers, self.decode_head = self.layers, self.lm_head
        if quantize == "int4":
            self.decode_layers = [self._pack(layer, lambda w: self._int4(w, group_size)) for layer in self.layers]
            self.decode_head = self._int8(self.lm_head)
        elif quantize == "bf16":
            self.decode_layers = [self._pack(layer, self._bf16) for layer in self.layers]
            self.decode_head = self._bf16(self.lm_head)
        elif quantize != "none":
            raise ValueError(f"unknown quantize mode {quantize!r} (none | bf16 | int4)")
        packed = self.device.type == "cpu" and quantize != "none"
        self.kv_dtype = quant.kernel_dtype() if packed else self.dtype  # fp32 where bf16 attention is emulated

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

    def _bf16(self, weight: torch.Tensor):
        if self.device.type != "cpu" or not quant.packs_bf16():
            return weight  # oneDNN's packed linear is the CPU one
        return quant.pack_bf16(weight)

    def _int4(self, weight: torch.Tensor, group_size: int):
        if self.device.type != "cpu" or not quant.supports(weight, group_size):
            return weight  # the packed kernel is the CPU one; odd shapes stay as they are
        return quant.quantize_int4(weight, group_size)

    def _int8(self, weight: torch.Tensor):
        if self.device.type != "cpu" or quant.kernel_dtype() == torch.float32:
            return weight  # the int8 kernel is fast only with bf16 inputs on a CPU with AVX-512 BF16
        return quant.quantize_int8(weight)

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
        n, start = len(token_ids), cache.length
        end = start + n
        self._reserve(cache, end)
        layers, head = (self.decode_layers, self.decode_head) if decode else (self.layers, self.lm_head)
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        groups = heads // kv_heads
        qk_width = (heads + kv_heads) * head_dim
        freqs = self.freqs_cis[start:end].view(n, 1, head_dim // 2)
        # Queries are folded to [kv_heads, groups * n, head_dim] so that each
        # KV head serves its group without copying keys (grouped-query
        # attention); rows are ordered (group, position), hence the repeat.
        mask = None
        if n > 1:
            positions = torch.arange(end, device=self.device)
            mask = (positions[None, :] <= positions[start:, None]).repeat(groups, 1)

        x = F.embedding(torch.tensor(token_ids, device=self.device), self.embed)
        for i, layer in enumerate(layers):
            h = F.rms_norm(x, (self.hidden,), layer.attn_norm, self.eps)
            qkv = quant.linear(h, layer.wqkv)
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            qk = qkv[:, :qk_width].reshape(n, heads + kv_heads, head_dim // 2, 2).float()
            qk = torch.view_as_real(torch.view_as_complex(qk) * freqs).view(n, heads + kv_heads, head_dim)
            keys, values = cache.kv[i].unbind()  # [capacity, kv_heads, head_dim] each
            keys[start:end] = qk[:, heads:]
            values[start:end] = qkv[:, qk_width:].view(n, kv_heads, head_dim)
            # 4-D so that SDPA takes its fused CPU kernel rather than the math path.
            q = qk[:, :heads].transpose(0, 1).reshape(1, kv_heads, groups * n, head_dim).to(keys.dtype)
            out = F.scaled_dot_product_attention(
                q, keys[None, :end].transpose(1, 2), values[None, :end].transpose(1, 2), attn_mask=mask, scale=self.scale
            )
            # reshape, not view: CUDA's SDPA kernels return a non-contiguous layout.
            out = out.reshape(heads, n, head_dim).transpose(0, 1).reshape(n, heads * head_dim)
            x = x + quant.linear(out, layer.wo)
            h = F.rms_norm(x, (self.hidden,), layer.ffn_norm, self.eps)
            gate, up = quant.linear(h, layer.w13).chunk(2, dim=-1)
            x = x + quant.linear(F.silu(gate) * up, layer.w2)
        cache.length = end
        last = F.rms_norm(x[-1:], (self.hidden,), self.final_norm, self.eps)
        return quant.linear(last, head)[0].float()
