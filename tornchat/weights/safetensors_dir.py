"""A Hugging Face Llama-family checkpoint read tensor by tensor from its safetensors files, each matrix
quantized into GGML blocks as it is read (``--quantize int4|int8``, ``quant.to_blocks``): the whole model
is never held in fp32, only the tensor being packed."""
import json
import logging
import time
from pathlib import Path

import torch

from tornchat.engine import llama, quant
from tornchat.engine.llama import Layer, LlamaConfig, LlamaWeights

log = logging.getLogger("tornchat.checkpoint")


class Tensors:
    """Tensors by name across a checkpoint's safetensors files (one, or sharded with an index)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
        self.files = [safe_open(directory / name, framework="pt") for name in files]
        self.where = {key: f for f in self.files for key in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name).float()


def load(directory: Path, hf_config, quantize: str) -> tuple[LlamaConfig, LlamaWeights]:
    """Config and weights, each layer's matrices fused and quantized into ``quantize``'s blocks as they are
    read."""
    started = time.perf_counter()
    config = llama.config_of(hf_config)
    tensors = Tensors(directory)

    def pack(weight: torch.Tensor) -> quant.BlockWeight:
        return quant.to_blocks(weight, quantize)

    def rows(name: str, heads: int | None = None) -> torch.Tensor:
        t = tensors.get(name)
        return llama.interleave_rope_rows(t, heads) if heads else t

    gemma = hf_config.model_type == "gemma3_text"

    def norm(name: str) -> torch.Tensor:
        return rows(name) + 1 if gemma else rows(name)  # Gemma's norms scale by 1 + weight

    def mlp(p: str) -> dict:
        """A layer's MLP: gate and up stacked, and down; or a mixture of experts (Qwen3 MoE), each expert's own."""
        if p + "mlp.gate.weight" not in tensors:
            return {"w13": pack(torch.cat([rows(p + "mlp.gate_proj.weight"), rows(p + "mlp.up_proj.weight")])),
                    "w2": pack(rows(p + "mlp.down_proj.weight"))}
        experts = [f"{p}mlp.experts.{e}." for e in range(hf_config.num_experts)]
        return {"w13": None, "w2": None, "moe": llama.Experts(
            router=rows(p + "mlp.gate.weight"),
            w13=tuple(pack(torch.cat([rows(e + "gate_proj.weight"), rows(e + "up_proj.weight")])) for e in experts),
            w2=tuple(pack(rows(e + "down_proj.weight")) for e in experts),
            top_k=hf_config.num_experts_per_tok, norm_top_k=bool(hf_config.norm_topk_prob))}

    layers = []
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}."
        bias = None
        if p + "self_attn.q_proj.bias" in tensors:
            bias = torch.cat([rows(p + "self_attn.q_proj.bias", config.heads), rows(p + "self_attn.k_proj.bias", config.kv_heads),
                              rows(p + "self_attn.v_proj.bias")])
        layers.append(Layer(
            attn_norm=norm(p + "input_layernorm.weight"),
            wqkv=pack(torch.cat([rows(p + "self_attn.q_proj.weight", config.heads),
                                       rows(p + "self_attn.k_proj.weight", config.kv_heads), rows(p + "self_attn.v_proj.weight")])),
            bqkv=bias,
            wo=pack(rows(p + "self_attn.o_proj.weight")),
            ffn_norm=norm(p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
            qk_norm=llama.qk_norms(norm(p + "self_attn.q_norm.weight"), norm(p + "self_attn.k_norm.weight"))
            if p + "self_attn.q_norm.weight" in tensors else None,
            post_attn_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
            post_ffn_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
            **mlp(p),
        ))
    tied = "lm_head.weight" not in tensors or getattr(hf_config, "tie_word_embeddings", False)
    head = quant.to_blocks(rows("model.embed_tokens.weight" if tied else "lm_head.weight"), quantize, head=True)
    embed = head if tied else rows("model.embed_tokens.weight")  # the head's blocks give its rows back
    weights = LlamaWeights(embed=embed, layers=layers, final_norm=norm("model.norm.weight"), head=head)
    log.info("read %s layer by layer, packed, in %.1f s", directory, time.perf_counter() - started)
    return config, weights
