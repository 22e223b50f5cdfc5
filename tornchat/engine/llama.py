"""A lean forward for the Llama family (Llama, Qwen2, Qwen3, Qwen3 MoE, Mistral, Gemma 3; SmolLM2 is Llama).

transformers' modules spend about as long in Python and dispatcher overhead
as in the matmuls of a small model's decode step (docs/performance.md
compares them: `--model-impl hf`). This is
the same computation as plain functions over tensors, gpt-fast style: fused
QKV and gate/up weights, RoPE as one complex multiply over queries and keys
together, a KV cache per slot that grows in chunks. On the CPU the whole
forward is one C++ call over GGML blocks (``LlamaRunner``); weights come from
a GGUF file (``weights.gguf_file``), a safetensors directory
(``weights.safetensors_dir``) or transformers' loaded model.
"""
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tornchat.engine import blocks, cuda_graph, fused, quant
from tornchat.engine.choose import Chosen, OnDevice
from tornchat.engine.model import one_by_one

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3_text")
QUANTIZE = ("none", "bf16", "int8", "int4")
MATRICES = ("wqkv", "wo", "w13", "w2")  # a Layer's matrices, in the order matrices() gives them
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the sequence length
CACHE_CHUNK = 256  # positions a cache grows by; kv_memory_mb measures what is allocated


class Experts(NamedTuple):
    """A mixture-of-experts MLP (Qwen3 MoE): the router's softmax over the experts picks each row's top_k, and
    the row's output is their SiLU-gated MLPs' outputs weighted by those probabilities (renormalized to sum 1
    where ``norm_top_k``). Each expert's matrices are its own weights, so a row reads only its experts'."""

    router: torch.Tensor  # [experts, hidden] in fp32 (llama.cpp keeps it F32 in quantized files too)
    w13: tuple[quant.Weight, ...]  # each expert's gate and up, stacked
    w2: tuple[quant.Weight, ...]
    top_k: int
    norm_top_k: bool

    def matrices(self) -> tuple[quant.Weight, ...]:
        return self.w13 + self.w2

    def packed(self, pack) -> "Experts":
        return self._replace(w13=tuple(map(pack, self.w13)), w2=tuple(map(pack, self.w2)))


class Layer(NamedTuple):
    attn_norm: torch.Tensor
    wqkv: quant.Weight  # queries, keys, values stacked, each head's rows in RoPE pairs (interleave_rope_rows)
    bqkv: torch.Tensor | None  # Qwen2 has q/k/v biases
    wo: quant.Weight
    ffn_norm: torch.Tensor
    w13: quant.Weight | None  # gate and up, stacked; None where the MLP is a mixture of experts (moe)
    w2: quant.Weight | None
    qk_norm: torch.Tensor | None = None  # Qwen3: RMS norm weights of each query and key head [2, head_dim], RoPE pair order
    # Gemma 3: RMS norms of the attention's and the MLP's outputs before each is added to the residual stream
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    moe: Experts | None = None  # Qwen3 MoE: the MLP in place of w13 and w2

    def matrices(self) -> tuple[quant.Weight, ...]:
        dense = tuple(getattr(self, role) for role in MATRICES if getattr(self, role) is not None)
        return dense + (self.moe.matrices() if self.moe is not None else ())

    def packed(self, pack) -> "Layer":
        packed = self._replace(**{role: pack(getattr(self, role)) for role in MATRICES if getattr(self, role) is not None})
        return packed._replace(moe=self.moe.packed(pack)) if self.moe is not None else packed

    def step_bytes(self, nbytes) -> float:
        """What a decode step reads of this layer's matrices (``nbytes`` of each): every dense one, and top_k of
        the experts, all of one size."""
        dense = sum(nbytes(m) for m in self._replace(moe=None).matrices())
        if self.moe is None:
            return dense
        return dense + sum(nbytes(m) for m in self.moe.matrices()) * self.moe.top_k / len(self.moe.w13)

    def mlp_input(self) -> quant.Weight:
        """The first matrix the MLP's input meets, whose ``quant.input_dtype`` the norm before it rounds to."""
        return self.w13 if self.moe is None else self.moe.w13[0]


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
    # Gemma 3: each layer's attention window (0: all positions; a window w sees the last w positions, its own
    # included), the RoPE frequencies of the windowed layers (None: inv_freq), the attention's scale (None:
    # head_dim ** -0.5), the embeddings' scale, and GELU (tanh) gating instead of SiLU.
    windows: tuple[int, ...] = ()
    local_inv_freq: torch.Tensor | None = None
    attn_scale: float | None = None
    embed_scale: float = 1.0
    gelu: bool = False


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
    kv: torch.Tensor  # [layers, 2, capacity, kv_heads, head_dim]; the unwindowed layers' where ``windowed`` is set
    length: int = 0
    # The C++ forward's windowed layers (Gemma 3) keep their caches apart, [windowed layers, 2, capacity, kv_heads,
    # head_dim], holding positions window_start .. (a multiple of fused.KEY_BLOCK): a row sees only the last
    # ``window`` positions, so the earlier ones are dropped as the cache grows, but for those a row at ``hold``
    # (the current prompt's last position, LlamaRunner.hold) would see.
    windowed: torch.Tensor | None = None
    window_start: int = 0
    hold: int = 0


def unsupported_reason(config) -> str | None:
    """Why a model of this transformers config cannot run on the lean forward, or None if it can."""
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    if config.model_type == "gemma3_text":
        return _gemma3_unsupported_reason(config)
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "only SiLU-gated MLPs without bias"
    if getattr(config, "shared_expert_intermediate_size", 0):
        return "shared experts"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        return "sliding-window attention"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        return f"RoPE type {rope_type!r}"
    return None


def _gemma3_unsupported_reason(config) -> str | None:
    """``unsupported_reason`` of a Gemma 3 text config: its windows and two RoPE tables are read, not checked."""
    if config.final_logit_softcapping or config.attn_logit_softcapping:
        return "logit soft-capping"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if config.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return f"activation {config.hidden_activation!r} (Gemma 3: GELU, tanh approximation)"
    for layer_type, params in config.rope_parameters.items():
        allowed = STATIC_ROPE if layer_type == "full_attention" else ("default",)
        if params["rope_type"] not in allowed:
            return f"RoPE type {params['rope_type']!r} in {layer_type} layers"
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


def qk_norms(q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
    """Qwen3's per-head query and key norm weights (halves order, as transformers has them) as ``Layer.qk_norm``:
    [2, head_dim] in the RoPE pair order of interleave_rope_rows."""
    return interleave_rope_rows(torch.stack([q_norm, k_norm]).float().T, 1).T.contiguous()


def config_of(config) -> LlamaConfig:
    """The lean forward's config from a transformers config (``unsupported_reason`` None), RoPE frequencies
    and scaling computed by the family's own rotary embedding."""
    import importlib

    if config.model_type == "gemma3_text":
        return _gemma3_config(config)
    family = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    rotary = getattr(family, type(config).__name__.removesuffix("Config") + "RotaryEmbedding")(config)  # LlamaRotaryEmbedding
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return LlamaConfig(
        hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=head_dim, eps=config.rms_norm_eps, context_length=int(config.max_position_embeddings),
        inv_freq=rotary.inv_freq.detach().float(), rope_magnitude=float(rotary.attention_scaling),
    )


def _gemma3_config(config) -> LlamaConfig:
    """``config_of`` a Gemma 3 text config: windowed layers with their own RoPE base, the rest with the global
    one and its scaling."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rotary = Gemma3RotaryEmbedding(config)
    return LlamaConfig(
        hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, eps=config.rms_norm_eps, context_length=int(config.max_position_embeddings),
        inv_freq=rotary.full_attention_inv_freq.detach().float(),
        rope_magnitude=float(rotary.full_attention_attention_scaling),
        windows=tuple(config.sliding_window if t == "sliding_attention" else 0 for t in config.layer_types),
        local_inv_freq=rotary.sliding_attention_inv_freq.detach().float() if "sliding_attention" in config.layer_types else None,
        attn_scale=config.query_pre_attn_scalar ** -0.5, embed_scale=config.hidden_size ** 0.5, gelu=True,
    )


def _gemma3_norms(block, layer: Layer) -> Layer:
    """``layer`` (a Gemma 3 decoder layer read as a Llama one) with Gemma's norms: four per layer, whose
    post_attention_layernorm is not Llama's pre-MLP norm, each scaling by 1 + weight, stored here as the weight
    (llama.cpp's GGUF converter stores them so too)."""
    def norm(module) -> torch.Tensor:
        return module.weight.detach() + 1

    return layer._replace(
        attn_norm=norm(block.input_layernorm), ffn_norm=norm(block.pre_feedforward_layernorm),
        qk_norm=qk_norms(norm(block.self_attn.q_norm), norm(block.self_attn.k_norm)),
        post_attn_norm=norm(block.post_attention_layernorm), post_ffn_norm=norm(block.post_feedforward_layernorm),
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
        qk_norm = qk_norms(attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if hasattr(attn, "q_norm") else None
        moe = hasattr(mlp, "experts")  # Qwen3 MoE: the experts' matrices stacked [experts, rows, cols]
        return Layer(
            attn_norm=block.input_layernorm.weight.detach(),
            wqkv=torch.cat([q, k, attn.v_proj.weight.detach()]),
            bqkv=bias,
            wo=attn.o_proj.weight.detach(),
            ffn_norm=block.post_attention_layernorm.weight.detach(),
            w13=None if moe else torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]),
            w2=None if moe else mlp.down_proj.weight.detach(),
            qk_norm=qk_norm,
            moe=Experts(router=mlp.gate.weight.detach().float(), w13=tuple(mlp.experts.gate_up_proj.detach().unbind()),
                        w2=tuple(mlp.experts.down_proj.detach().unbind()), top_k=mlp.gate.top_k,
                        norm_top_k=bool(mlp.gate.norm_topk_prob)) if moe else None,
        )

    embed, head = inner.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    if head.data_ptr() == embed.data_ptr():  # tied: one tensor for both, which pack() keeps as one
        embed = head
    layers, final_norm = [layer(b) for b in inner.layers], inner.norm.weight.detach()
    if model.config.model_type == "gemma3_text":
        layers = [_gemma3_norms(b, read) for b, read in zip(inner.layers, layers)]
        final_norm = final_norm + 1  # the (1 + weight) of Gemma's norms
    weights = LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, head=head)
    return spec, weights


def pack(weights: LlamaWeights, quantize: str, group_size: int = quant.CUDA_GROUP, keep: bool = False,
         isa: str = "") -> LlamaWeights:
    """Plain weights in a ``QUANTIZE`` format, one layer at a time: on the CPU GGML blocks (``quant.to_blocks``:
    none F32, bf16 BF16, int8 Q8_0, int4 Q4_1 with a Q8_0 head; laid out for the block kernels' path ``isa``), on
    CUDA tinygemm int4 (``int4``) or plain (``none``). Unless ``keep``, each plain layer is dropped once packed,
    so that the model is never held twice. A tied embedding reads its rows from the packed head where that can
    give them back."""
    if quantize not in QUANTIZE:
        raise ValueError(f"unknown quantize mode {quantize!r} ({' | '.join(QUANTIZE)})")
    if weights.final_norm.is_cuda:
        if quantize not in ("none", "int4"):
            raise ValueError(f"quantize {quantize!r} has no CUDA kernels here (none | int4)")
        if quantize == "none":
            return weights

        def pack_matrix(weight):  # odd shapes stay as they are
            return quant.quantize_int4_cuda(weight, group_size) if quant.cuda_supports(weight, group_size) else weight
        pack_head = pack_matrix
    else:
        def pack_matrix(weight):
            return quant.to_blocks(weight, quantize, isa=isa)

        def pack_head(weight):
            return quant.to_blocks(weight, quantize, head=True, isa=isa)
    packed = []
    for i, layer in enumerate(weights.layers):
        packed.append(layer.packed(pack_matrix))
        if not keep:
            weights.layers[i] = None  # the caller gives the plain weights up: free each layer once packed
    head = pack_head(weights.head)
    readable = not isinstance(head, quant.CudaInt4Weight)  # tinygemm's layout gives no rows back
    embed = head if weights.embed is weights.head and readable else weights.embed
    return LlamaWeights(embed=embed, layers=packed, final_norm=weights.final_norm, head=head)


def weights_label(weights: LlamaWeights) -> str:
    """The formats the layer matrices and the head are stored in, for logs: "Q4_K x 100, Q6_K x 20; head Q6_K"."""
    def names(w) -> list[str]:
        if isinstance(w, quant.BlockWeight):
            return list(w.types)
        if isinstance(w, quant.CudaInt4Weight):
            return [f"int4 (tinygemm, group {w.group_size})"]
        return [str(w.dtype).removeprefix("torch.")]
    counts = Counter(name for layer in weights.layers for m in layer.matrices() for name in names(m))
    return ", ".join(f"{k} x {v}" for k, v in counts.most_common()) + f"; head {'+'.join(names(weights.head))}"


ROPE_BLOCK = 4096  # positions of the RoPE table computed at a time on a CPU


class RopeTable:
    """Each position's rotation, cos and sin of its angles times the magnitude [positions, head_dim / 2, 2] fp32,
    computed in blocks of ROPE_BLOCK positions as forwards reach them (on a CPU; on a GPU, whole at once: the
    captured step reads it at the row's position on the device). A whole context's table would hold memory
    that short conversations never use: Gemma 3 1B's two of them took 64 MiB. A row is computed once, in the
    block it belongs to, so its values do not depend on which forward first asked for it."""

    def __init__(self, inv_freq: torch.Tensor, magnitude: float, context: int, device: torch.device):
        self.inv_freq, self.magnitude, self.context = inv_freq.to(device).float(), magnitude, context
        self.block = context if device.type == "cuda" else ROPE_BLOCK
        self.blocks: list[torch.Tensor] = []

    def rows(self, start: int, end: int) -> torch.Tensor:
        """The table's rows start..end-1."""
        while len(self.blocks) * self.block < min(end, self.context):
            first = len(self.blocks) * self.block
            positions = torch.arange(first, min(first + self.block, self.context), dtype=torch.float32,
                                     device=self.inv_freq.device)
            angles = torch.outer(positions, self.inv_freq)
            self.blocks.append(torch.view_as_real(torch.polar(torch.full_like(angles, self.magnitude), angles)))
        first, last = start // self.block, (end - 1) // self.block
        if first == last:
            return self.blocks[first][start - first * self.block : end - first * self.block]
        return torch.cat([self.blocks[first][start - first * self.block :], *self.blocks[first + 1 : last],
                          self.blocks[last][: end - last * self.block]])

    def whole(self) -> torch.Tensor:
        """Every position's row, in one tensor (the CUDA step's)."""
        return self.rows(0, self.context)

    def nbytes(self) -> int:
        return sum(block.numel() * block.element_size() for block in self.blocks)


class LlamaRunner:
    """Implements ``model.Runner`` over one copy of the weights (``LlamaWeights``).

    On the CPU, with the C++ extension built and every matrix in GGML blocks
    (``quant.BlockWeight``), every forward is one call of csrc/fused.cpp's
    ``Forward``: a decode step's row, a verify's rows and a prefill chunk's
    rows alike. Each of its operations computes a row as if alone (the block
    kernels, attention over the row's own positions in a fixed order, norms,
    RoPE), so a row's logits and keys have the same bits however it arrives:
    a greedy reply is the same with its prompt prefilled fresh, from a KV
    slot, in any chunks, with speculation or without. Elsewhere (CUDA, or no
    extension) the Python loop ``_layers`` runs with PyTorch's SDPA.
    ``kv_dtype``: the KV cache's dtype (default bf16 on the CPU, which halves
    what attention reads over a long context; the model's dtype elsewhere).
    ``isa``: the block kernels' instruction-set path (default ``blocks.isa()``:
    the best this CPU runs, or TORNCHAT_ISA's).
    """

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, kv_dtype: torch.dtype | None = None,
                 graphs: bool = True, isa: str | None = None):
        self.config, self.weights = config, weights
        self.layers, self.head, self.final_norm = weights.layers, weights.head, weights.final_norm
        self.device, self.dtype = weights.final_norm.device, weights.final_norm.dtype
        self.context_length = config.context_length
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.scale = config.attn_scale or config.head_dim ** -0.5
        self.eps, self.hidden = config.eps, config.hidden
        self.windows = config.windows or (0,) * len(self.layers)

        self.rope = RopeTable(config.inv_freq, config.rope_magnitude, self.context_length, self.device)
        # Gemma 3: the windowed layers' table (RoPE base 10000, no scaling)
        self.local_rope = (None if config.local_inv_freq is None
                           else RopeTable(config.local_inv_freq, 1.0, self.context_length, self.device))
        self.ops = fused.ops_for(self.device, self.dtype)
        on_cpu = self.device.type == "cpu"
        self.kv_dtype = kv_dtype or (torch.bfloat16 if on_cpu else self.dtype)
        # On CUDA, one-token rows (steps, verifies, and the steps of generations decoding together) replay a
        # captured graph (cuda_graph.py) unless ``graphs`` is off; Gemma 3's steps run eagerly (the captured step
        # is the Llama layer's), and so do experts' (a graph cannot follow their choice per token).
        gemma = config.gelu or any(self.windows)
        moe = any(layer.moe is not None for layer in self.layers)
        self.graphs = cuda_graph.GraphedSteps(self) if graphs and not on_cpu and not gemma and not moe else None
        self.step = None  # the C++ forward over the layers (Forward); None: the Python loop
        self.isa = ""
        if self.ops is fused.NATIVE and fused.attends(self.head_dim) and all(
                isinstance(m, quant.BlockWeight) for layer in self.layers for m in layer.matrices()):
            self.isa = isa or blocks.isa()
            self.step = fused.native_forward(self.layers, self.heads, self.kv_heads, self.eps, self.scale, self.isa,
                                             config.windows, config.gelu)
        self.window = max(self.windows)
        self.windowed_layers = [i for i, w in enumerate(self.windows) if w]
        self.other_layers = [i for i, w in enumerate(self.windows) if not w]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings in the model's dtype, scaled there (Gemma), as transformers scales them."""
        x = quant.dequantize(self.weights.embed, self.dtype, ids)
        return x * torch.tensor(self.config.embed_scale, dtype=self.dtype) if self.config.embed_scale != 1.0 else x

    def label(self) -> str:
        forward = "C++ forward" if self.step is not None else "Python forward"
        isa = f" ({self.isa} kernels)" if self.step is not None else ""
        return f"{weights_label(self.weights)}; {self.kv_dtype} cache; {forward}{isa}"

    def new_cache(self) -> KVCache:
        if self.step is None or not self.windowed_layers:
            return KVCache(self._kv(len(self.layers)))
        # The C++ forward keeps the windowed layers' caches apart, holding only what their window sees.
        return KVCache(self._kv(len(self.other_layers)), windowed=self._kv(len(self.windowed_layers)))

    def _kv(self, layers: int) -> torch.Tensor:
        return torch.empty((layers, 2, 0, self.kv_heads, self.head_dim), dtype=self.kv_dtype, device=self.device)

    def hold(self, cache: KVCache, length: int) -> None:
        """Keep cache resumable at ``length`` and after as it grows (``resumable_from``)."""
        cache.hold = length

    def resumable_from(self, cache: KVCache) -> int:
        """The shortest length cache can be cut back to and go on from: 0, or where its windowed layers have
        dropped positions, the first row that sees none of them."""
        return cache.window_start + self.window - 1 if cache.window_start else 0

    def _check_resumable(self, cache: KVCache, length: int) -> None:
        if length < min(cache.length, self.resumable_from(cache)):
            raise ValueError(f"the cache cannot be cut back to {length} positions: its windowed layers hold positions "
                             f"{cache.window_start} .. only")

    def truncate(self, cache: KVCache, length: int) -> None:
        self._check_resumable(cache, length)
        cache.length = min(cache.length, length)

    def fork(self, cache: KVCache, length: int) -> KVCache:
        """A new cache holding a copy of the first ``length`` positions of cache (of a windowed layer's, those the
        next row sees)."""
        self._check_resumable(cache, length)
        forked = self.new_cache()
        if forked.windowed is not None:
            forked.window_start = max(cache.window_start, _blocks_before(length + 1 - self.window))
            forked.hold = length
        self.reserve(forked, length)
        self._reserve_windowed(forked, length)
        forked.length = min(length, cache.length)
        held = _whole_blocks(forked.length)
        forked.kv[:, :, :held] = cache.kv[:, :, :held]
        if forked.windowed is not None and held > forked.window_start:
            offset, count = forked.window_start - cache.window_start, held - forked.window_start
            forked.windowed[:, :, :count] = cache.windowed[:, :, offset : offset + count]
        return forked

    def positions(self, cache: KVCache) -> torch.Tensor:
        """The cache's positions 0 .. length - 1 as [layers, 2, length, kv_heads, head_dim], position-major
        (the C++ forward keeps its own layout, ``fused.forward_layout``). A windowed layer's are zeros but for the
        last ``window - 1``, which the next row sees: whatever else a cache holds depends on how it was filled."""
        def standard(kv: torch.Tensor) -> torch.Tensor:
            return fused.standard_layout(kv) if self.step is not None else kv.clone()
        kv = standard(cache.kv)[:, :, : cache.length]
        if cache.windowed is not None:
            every = kv.new_zeros((len(self.layers), *kv.shape[1:]))
            every[self.other_layers] = kv
            every[self.windowed_layers, :, cache.window_start :] = \
                standard(cache.windowed)[:, :, : max(0, cache.length - cache.window_start)]
            kv = every
        for i, window in enumerate(self.windows):
            if window:
                kv[i, :, : max(0, cache.length + 1 - window)] = 0
        return kv

    def cache_bytes(self, cache: KVCache) -> int:
        return sum(kv.numel() * kv.element_size() for kv in (cache.kv, cache.windowed) if kv is not None)

    def reserve(self, cache: KVCache, length: int) -> None:
        if length > self.context_length:
            raise ValueError(f"{length} positions exceed the context of {self.context_length}")
        capacity = cache.kv.shape[2]
        if length <= capacity:
            return
        grown = -(-length // CACHE_CHUNK) * CACHE_CHUNK
        if self.graphs is not None:  # each new cache tensor is a new graph capture: few of them
            grown = max(grown, 2 * capacity)
        grown = min(grown, _whole_blocks(self.context_length))
        kv = cache.kv.new_empty((*cache.kv.shape[:2], grown, *cache.kv.shape[3:]))
        held = _whole_blocks(cache.length)
        kv[:, :, :held] = cache.kv[:, :, :held]
        if self.graphs is not None:
            # Zeros, not stale memory, past the length: the CUDA step's PyTorch reference (step_ops.attend_ref)
            # attends over the whole capacity with the later positions masked, and a masked NaN still poisons the
            # weighted sum (0 * NaN). Its kernel, and attention elsewhere, read no position past a row's own, and
            # pages nothing writes stay out of the process's memory.
            kv[:, :, held:] = 0
        cache.kv = kv

    def _reserve_windowed(self, cache: KVCache, length: int) -> None:
        """Room in the windowed layers' caches for positions up to ``length``, dropping the whole key blocks
        before what a row at the cache's length, or at its ``hold``, sees. Called for each forward's rows, not
        for a whole prompt at once (``reserve``): a long prompt's chunks slide along it."""
        if cache.windowed is None or length - cache.window_start <= cache.windowed.shape[2]:
            return
        start = max(cache.window_start, _blocks_before(min(cache.length, cache.hold) + 1 - self.window))
        grown = min(-(-(length - start) // CACHE_CHUNK) * CACHE_CHUNK, _whole_blocks(self.context_length) - start)
        windowed = cache.windowed.new_empty((*cache.windowed.shape[:2], grown, *cache.windowed.shape[3:]))
        offset, count = start - cache.window_start, max(0, _whole_blocks(cache.length) - start)
        windowed[:, :, :count] = cache.windowed[:, :, offset : offset + count]
        cache.windowed, cache.window_start = windowed, start

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: KVCache, decode: bool = False) -> torch.Tensor:
        if decode and self.graphs is not None and len(token_ids) == 1:
            return self._replay([(token_ids, cache)])[0][0]
        return self._logits(self._hidden(token_ids, cache)[-1:])[0]

    @property
    def chooses_on_device(self) -> bool:
        return self.graphs is not None

    @torch.inference_mode()
    def choose_step(self, token: int, cache: KVCache, choice: OnDevice) -> Chosen:
        """``token`` appended to cache in a captured step that also chooses the next token
        (``cuda_graph.GraphedSteps.choose``)."""
        self.reserve(cache, cache.length + 1)
        chosen = self.graphs.choose(token, cache.kv, cache.length, choice)
        cache.length += 1
        return chosen

    @torch.inference_mode()
    def verify(self, token_ids: list[int], cache: KVCache) -> torch.Tensor:
        """fp32 logits [n, V] after each of token_ids appended to cache: bit for bit what n one-token decode
        steps give (the C++ forward's rows do not interact, nor do a captured CUDA step's with plain weights;
        elsewhere the steps themselves: ``cuda_graph.GraphedSteps``)."""
        if self.graphs is not None:
            return self._replay([(token_ids, cache)])[0]
        if self.step is None:
            return torch.stack([self.forward([token], cache, decode=True) for token in token_ids])
        return self._logits(self._hidden(token_ids, cache))

    @torch.inference_mode()
    def score(self, token_ids: list[int], mode: str = "kernels") -> torch.Tensor:
        """fp32 logits [n, V] of every position of token_ids from an empty cache, in one pass: as the runner
        computes them (``kernels``), or with every matrix dequantized to fp32 and multiplied by PyTorch
        (``exact``: the reference the kernels' activation rounding is measured against, one layer dequantized
        at a time)."""
        if mode == "kernels":
            return self._logits(self._hidden(token_ids, self.new_cache()))
        cache = KVCache(self._kv(len(self.layers)))  # every layer's: the Python loop's
        n = len(token_ids)
        self.reserve(cache, n)
        x = self._embed(torch.tensor(token_ids, device=self.device))
        x = self._layers(x, cache, 0, exact=True)
        head = quant.dequantize(self.head, torch.float32)
        return F.linear(fused.REFERENCE.rms_norm(x, self.final_norm, self.eps, False), head).float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ops.rms_norm(x, self.final_norm, self.eps, quant.input_dtype(self.head) == torch.bfloat16)
        if isinstance(self.head, quant.BlockWeight):
            return self.head.mm(h, self.isa)
        return quant.linear(h, self.head).float()

    @torch.inference_mode()
    def forward_many(self, batch: list[tuple[list[int], KVCache, bool]]) -> list[torch.Tensor]:
        """Several sequences' rows in one forward, each (token_ids, cache, every) with its own cache: fp32 logits
        [n, V] of every row where ``every`` (a verify's), else [1, V] of the last (a step's, a prefill
        chunk's). Each sequence gets bit for bit what ``verify`` / ``forward`` give it alone: the C++ forward
        computes every row by itself (rows of one sequence meet only in its own attention). On CUDA the
        sequences' steps and verifies share captured steps (``cuda_graph.GraphedSteps``), whose many-row
        products with int4 weights may give a row other bits than alone, and prefill chunks run eagerly. Without either, those
        calls one after another (``one_by_one``)."""
        if self.graphs is not None:
            replayed = iter(self._replay([(ids, cache) for ids, cache, every in batch if every]))
            return [next(replayed) if every else self.forward(ids, cache)[None] for ids, cache, every in batch]
        if self.step is None:
            return one_by_one(self, batch)
        hidden = self._hidden_many([(ids, cache) for ids, cache, _ in batch]).split([len(ids) for ids, _, _ in batch])
        kept = [h if every else h[-1:] for h, (_, _, every) in zip(hidden, batch)]
        return list(self._logits(torch.cat(kept)).split([len(k) for k in kept]))

    def _replay(self, batch: list[tuple[list[int], KVCache]]) -> list[torch.Tensor]:
        """One-token rows of distinct caches (each token_ids appended to its cache) through the captured CUDA
        steps (``cuda_graph.GraphedSteps``): fp32 logits [n, V] per cache."""
        if not batch:
            return []
        rows = []
        for token_ids, cache in batch:
            self.reserve(cache, cache.length + len(token_ids))
            rows += [(token, cache.kv, cache.length + j) for j, token in enumerate(token_ids)]
        logits = self.graphs(rows)
        for token_ids, cache in batch:
            cache.length += len(token_ids)
        return list(logits.split([len(token_ids) for token_ids, _ in batch]))

    def _hidden(self, token_ids: list[int], cache: KVCache) -> torch.Tensor:
        """Run token_ids through the layers, appending to cache: the residual stream [n, hidden] after them."""
        if self.step is not None:
            return self._hidden_many([(token_ids, cache)])
        n, start = len(token_ids), cache.length
        self.reserve(cache, start + n)
        x = self._embed(torch.tensor(token_ids, device=self.device))
        x = self._layers(x, cache, start)
        cache.length = start + n
        return x

    def _hidden_many(self, batch: list[tuple[list[int], KVCache]]) -> torch.Tensor:
        """``_hidden`` of several sequences (distinct caches) in one C++ forward: their rows one after another."""
        starts, counts = [cache.length for _, cache in batch], [len(ids) for ids, _ in batch]
        for (_, cache), start, n in zip(batch, starts, counts):
            self.reserve(cache, start + n)
            self._reserve_windowed(cache, start + n)
        ids = torch.tensor([t for token_ids, _ in batch for t in token_ids], device=self.device)
        x = self._embed(ids)
        freqs, local = ([None if table is None else torch.cat([table.rows(start, start + n) for start, n in zip(starts, counts)])
                         for table in (self.rope, self.local_rope)])
        apart = [cache for _, cache in batch if cache.windowed is not None]  # all of them or none
        x = self.step.forward(x, [cache.kv for _, cache in batch], freqs, starts, counts, local,  # _layers in one C++ call
                              [cache.windowed for cache in apart], [cache.window_start for cache in apart])
        for (_, cache), n in zip(batch, counts):
            cache.length += n
        return x

    def _layers(self, x: torch.Tensor, cache: KVCache, start: int, exact: bool = False) -> torch.Tensor:
        """The layers in PyTorch: where the C++ forward does not run, and (``exact``) with each layer's
        matrices dequantized to fp32 for ``score``."""
        n, end = x.shape[0], start + x.shape[0]
        ops = self.ops if n == 1 and not exact else fused.REFERENCE
        groups = self.heads // self.kv_heads
        masks = {window: causal_mask(start, n, groups, self.device, window) if n > 1 or window else None
                 for window in set(self.windows)}
        for i, layer in enumerate(self.layers):
            window = self.windows[i]
            freqs = (self.local_rope if window and self.local_rope is not None else self.rope).rows(start, end)
            if exact:
                layer = layer.packed(lambda w: quant.dequantize(w, torch.float32))
            h = ops.rms_norm(x, layer.attn_norm, self.eps, quant.input_dtype(layer.wqkv) == torch.bfloat16)
            qkv = quant.linear(h, layer.wqkv)
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            keys, values = cache.kv[i].unbind()  # [capacity, kv_heads, head_dim] each
            q = ops.rope_store(qkv, freqs, keys[start:end], values[start:end], self.heads, self.kv_heads,
                               layer.qk_norm, self.eps)
            out = quant.linear(sdpa_attend(q, keys, values, start, self.scale, masks[window]), layer.wo)
            x = x + (out if layer.post_attn_norm is None else ops.rms_norm(out, layer.post_attn_norm, self.eps, False))
            h = ops.rms_norm(x, layer.ffn_norm, self.eps, quant.input_dtype(layer.mlp_input()) == torch.bfloat16)
            gate = ops.gelu_mul if self.config.gelu else ops.silu_mul
            if layer.moe is not None:
                out = mixture(h, layer.moe, gate).to(x.dtype)
            else:
                out = quant.linear(gate(quant.linear(h, layer.w13)), layer.w2)
            x = x + (out if layer.post_ffn_norm is None else ops.rms_norm(out, layer.post_ffn_norm, self.eps, False))
        return x


def route(h: torch.Tensor, experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k experts [n, k] (most probable first) and their weights [n, k] in fp32: the router's
    softmax in fp32, the chosen probabilities renormalized to sum 1 where ``norm_top_k``."""
    probabilities = torch.softmax(F.linear(h.float(), experts.router.float()), dim=-1)
    weights, chosen = torch.topk(probabilities, experts.top_k, dim=-1)
    if experts.norm_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def mixture(h: torch.Tensor, experts: Experts, gate) -> torch.Tensor:
    """The mixture-of-experts MLP of rows h [n, hidden] in fp32: each expert runs on the rows routed to it
    (``route``), and a row's k outputs are weighted and summed in order of rank; ``gate``: the gating op
    (``Ops.silu_mul``)."""
    weights, chosen = route(h, experts)
    outputs = torch.zeros(*chosen.shape, h.shape[1], dtype=torch.float32, device=h.device)  # [n, k, hidden]
    for e in chosen.unique().tolist():
        rows, ranks = (chosen == e).nonzero(as_tuple=True)
        y = quant.linear(gate(quant.linear(h[rows], experts.w13[e])), experts.w2[e])
        outputs[rows, ranks] = y.float()
    return (outputs * weights[..., None]).sum(dim=1)


def _blocks_before(position: int) -> int:
    """The first position of the key block that holds position (0 for any before 0)."""
    return max(0, position) // fused.KEY_BLOCK * fused.KEY_BLOCK


def _whole_blocks(length: int) -> int:
    """Positions up to length rounded up to whole key blocks: a prefix of the positions in the C++ forward's layout
    is a prefix of the cache's memory only in whole blocks (``fused.forward_layout``; capacities are whole blocks
    too)."""
    return -(-length // fused.KEY_BLOCK) * fused.KEY_BLOCK


def causal_mask(start: int, n: int, groups: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """Which positions 0 .. start + n - 1 each of n rows at start .. sees, for ``sdpa_attend``'s folded rows:
    all up to its own, or (``window``) the last ``window`` of them, its own included."""
    positions = torch.arange(start + n, device=device)
    seen = positions[None, :] <= positions[start:, None]
    if window:
        seen &= positions[None, :] > positions[start:, None] - window
    return seen.repeat(groups, 1)


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
