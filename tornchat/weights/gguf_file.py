"""A Llama-family GGUF file straight into ``LlamaWeights``, its tensors used in place.

Every matrix is a ``quant.BlockWeight`` over views of the file's memory
map: the kernels (csrc/blocks/) compute on the blocks as the file
stores them, whatever their types (Q4_K_M mixes Q4_K and Q6_K, even inside
one fused query-key-value matrix), so nothing is converted at start and the
model is in memory once, as the file's pages. A mixture of experts' 3-D
tensors (Qwen3 MoE) are views too, one matrix per expert, each expert's rows
contiguous in the file. Only Qwen2's and Qwen3's query and key rows are
copied, reordered for RoPE. The token embedding's rows are decoded
as a prompt looks them up. With ``plain``, every tensor is decoded into
that dtype instead (a GPU, or --quantize modes that pack from float values).

Config comes from the file's metadata.
"""
import logging
import math
import mmap
import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tornchat.engine import blocks, quant
from tornchat.engine.llama import Experts, Layer, LlamaConfig, LlamaWeights, interleave_rope_rows, qk_norms
from tornchat.engine import ggml
from tornchat.weights import file_memory

log = logging.getLogger("tornchat.checkpoint")

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "mistral", "gemma3")
MOE_ARCHITECTURES = ("qwen3moe",)  # every layer's MLP a mixture of experts, softmax-routed, top-k renormalized
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3moe", "gemma3")


class UnsupportedFile(Exception):
    """A GGUF this loader does not read; the message is one line naming what."""


@dataclass(frozen=True)
class FileTensor:
    name: str
    type_name: str
    rows: int  # N: output features
    cols: int  # K: input features (the GGUF's first dimension)
    offset: int
    nbytes: int


# GGUF metadata value types: struct format of the scalars; 8 is a string, 9 an array.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFFile:
    """The header of a GGUF file (format version 2 or 3), read with struct from a memory map: scalar and
    string metadata, tensor names, types, shapes and offsets. Arrays (the tokenizer's vocabulary) are
    skipped, their places remembered, and read by ``array`` only when asked for: gguf's own GGUFReader builds
    every field as numpy views, which is slow on a vocabulary's strings (docs/performance.md)."""

    def __init__(self, path: Path, isa: str = ""):
        self.path = path
        self.isa = isa  # the block kernels' path ``blocks`` lays tensors out for ("": blocks.isa())
        self.grouped: dict[str, str] = {}  # tensors rearranged in memory (``blocks``): the type they hold now
        self.memory: mmap.mmap | None = None  # the file's bytes read into memory of their own (``read_into_memory``)
        try:
            self._read_header()
        except (struct.error, ValueError, OverflowError, MemoryError) as exc:  # a truncated or corrupt header
            raise UnsupportedFile(f"cannot read GGUF file {path}: {exc}") from None

    def _read_header(self) -> None:
        from gguf import GGMLQuantizationType

        path = self.path
        with open(path, "rb") as handle:
            # Copy-on-write, so that tensors can view it (torch wants writable memory); nothing writes to it.
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self.at = 4
        if len(self.map) < 24:
            raise ValueError("shorter than a GGUF header")
        magic, version = self.map[:4], self._unpack("<I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError("not a GGUF file of version 2 or 3")
        tensor_count, field_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields, self.arrays = {}, {}
        for _ in range(field_count):
            key = self._string()
            kind = self._unpack("<I")
            if kind == ARRAY:
                self.arrays[key] = self.at
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            type_id, offset = self._unpack("<I"), self._unpack("<Q")
            try:
                type_name = GGMLQuantizationType(type_id).name
            except ValueError:
                type_name = f"type {type_id}"
            infos.append((name, type_name, dims, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self.at // alignment) * alignment
        self.tensors = {}
        for name, type_name, dims, offset in infos:
            cols, rows = dims[0], math.prod(dims[1:])
            block = ggml.TYPES.get(type_name)
            nbytes = rows * cols // block.values * block.bytes if block else 0
            if data_start + offset + nbytes > len(self.map):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = FileTensor(name, type_name, rows, cols, data_start + offset, nbytes)
        self.arch = self.fields.get("general.architecture")

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.map, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = self.map[self.at : self.at + length].decode("utf-8", errors="replace")
        self.at += length
        return text

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if item in SCALARS:
                self.at += count * struct.calcsize(SCALARS[item])
            else:
                for _ in range(count):
                    self._value(item)
            return None  # not kept: see the class docstring
        return self._unpack(SCALARS[kind])

    def array(self, key: str):
        """An array field read now: strings as a list of str, numbers as a numpy array; None where the file
        has no such array."""
        at = self.arrays.get(key)
        if at is None:
            return None
        item, count = struct.unpack_from("<IQ", self.map, at)
        at += 12
        if item in SCALARS:
            return np.frombuffer(self.map, dtype=np.dtype(SCALARS[item]), count=count, offset=at).copy()
        if item != STRING:
            raise UnsupportedFile(f"{self.path.name}: {key} is an array of arrays")
        length, strings, data = struct.Struct("<Q").unpack_from, [], self.map
        for _ in range(count):
            (n,) = length(data, at)
            strings.append(str(data[at + 8 : at + 8 + n], "utf-8", "replace"))
            at += 8 + n
        return strings

    def value(self, key: str, default=None):
        found = self.fields.get(key)
        return default if found is None else found

    def meta(self, key: str, default=None):
        """An architecture key, e.g. ``meta("block_count")`` reads ``llama.block_count``; one without a
        default must be there."""
        found = self.value(f"{self.arch}.{key}", default)
        if found is None:
            raise UnsupportedFile(f"{self.path.name} lacks the metadata key {self.arch}.{key}")
        return found

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [N, row_bytes], read into memory of their own."""
        t = self.tensors[name]
        data = np.fromfile(self.path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return torch.from_numpy(data).reshape(t.rows, -1)

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [N, row_bytes], a view of the file's bytes in memory (``read_into_memory``)
        or, before that, of its map."""
        t = self.tensors[name]
        data = np.frombuffer(self.map if self.memory is None else self.memory, dtype=np.uint8, count=t.nbytes,
                             offset=t.offset)
        return torch.from_numpy(data).reshape(t.rows, -1)

    def read_into_memory(self) -> None:
        """The file read once into private memory of its own (``file_memory``: 2 MiB pages, and begun by the
        command line before torch's import where it knew the file), for tensors used in place; ``blocks``
        rearranges it in place, so memory holds one copy. Where tensors are decoded into new ones (``load``'s
        plain) the map serves: a tensor viewing this memory would hold them all."""
        if self.memory is None:
            try:
                self.memory = file_memory.take(self.path)
            except OSError as exc:
                raise UnsupportedFile(f"cannot read GGUF file {self.path}: {exc}") from None

    def blocks(self, name: str, grouped: bool, panels: bool = False) -> tuple[torch.Tensor, str]:
        """``mapped``, and the type its bytes hold: with ``grouped``, in the layout the CPU's kernels read fastest
        (``blocks.group``, its panel layout too with ``panels``: rearranged in memory itself, once, so the file
        is untouched and memory holds one copy); without, as they are (a type ``ggml.values`` decodes either
        way)."""
        raw, t = self.mapped(name), self.tensors[name]
        layout = blocks.grouped_type(t.type_name, self.isa, t.rows, panels) if grouped else t.type_name
        if name not in self.grouped and layout != t.type_name:
            self.grouped[name] = blocks.group(raw, t.type_name, self.isa, panels=panels)
        return raw, self.grouped.get(name, t.type_name)


def config_of(file: GGUFFile) -> LlamaConfig:
    if file.arch not in ARCHITECTURES:
        raise UnsupportedFile(f"unsupported architecture {file.arch!r} in {file.path.name} "
                              f"(the GGUF loader reads {', '.join(ARCHITECTURES)})")
    hidden, heads = int(file.meta("embedding_length")), int(file.meta("attention.head_count"))
    head_dim = int(file.meta("attention.key_length", hidden // heads))
    rope_dims = int(file.meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedFile(f"partial RoPE ({rope_dims} of {head_dim} dimensions) in {file.path.name}")
    inv_freq = _inv_freq(float(file.meta("rope.freq_base", 10000.0)), head_dim)
    scaling = file.meta("rope.scaling.type", "none")
    if scaling == "linear":
        inv_freq = inv_freq / float(file.meta("rope.scaling.factor", 1.0))
    elif scaling not in ("none", None):
        raise UnsupportedFile(f"RoPE scaling {scaling!r} in {file.path.name}")
    if file.arch in MOE_ARCHITECTURES:
        _check_experts(file)
    if "rope_freqs.weight" in file.tensors:  # Llama 3.1+: per-frequency divisors
        inv_freq = inv_freq / ggml.dequantize(file.raw("rope_freqs.weight"), "F32").reshape(-1)
    config = LlamaConfig(
        hidden=hidden, heads=heads, kv_heads=int(file.meta("attention.head_count_kv", heads)), head_dim=head_dim,
        eps=float(file.meta("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(file.meta("context_length", 2048)), inv_freq=inv_freq,
    )
    return _gemma3_config(file, config) if file.arch == "gemma3" else config


def _inv_freq(base: float, head_dim: int) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def _gemma3_config(file: GGUFFile, config: LlamaConfig) -> LlamaConfig:
    """A gemma3 file's parts as llama.cpp reads them: windowed layers (all but every 6th, or the file's
    attention.sliding_window_pattern) with RoPE base rope.freq_base_swa (10000) unscaled, the others with
    rope.freq_base and its scaling; queries scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B,
    whose query_pre_attn_scalar that is); embeddings by sqrt(hidden); GELU gating. Norm weights are stored
    with Gemma's + 1 already (llama.cpp's converter adds it)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if float(file.meta(key, 0.0)):
            raise UnsupportedFile(f"{key.replace('_', ' ')} in {file.path.name} (Gemma 3 has none; not supported)")
    layers, window = int(file.meta("block_count")), int(file.meta("attention.sliding_window", 0))
    flags = file.array(f"{file.arch}.attention.sliding_window_pattern")
    if flags is None:
        pattern = int(file.meta("attention.sliding_window_pattern", 6))
        flags = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    query_scalar = config.hidden // config.heads if layers == 62 else config.head_dim
    return replace(
        config, windows=tuple(window if window and flag else 0 for flag in flags),
        local_inv_freq=_inv_freq(float(file.meta("rope.freq_base_swa", 10000.0)), config.head_dim),
        attn_scale=query_scalar ** -0.5, embed_scale=config.hidden ** 0.5, gelu=True,
    )


def _check_experts(file: GGUFFile) -> None:
    """A mixture of experts as Qwen3 MoE has it, or a one-line refusal: no shared expert, softmax gating, top-k of
    the experts."""
    if file.value(f"{file.arch}.expert_shared_count", 0) or any("shexp" in name for name in file.tensors):
        raise UnsupportedFile(f"shared experts in {file.path.name} are not supported")
    gating = file.value(f"{file.arch}.expert_gating_func", 1)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
    if gating != 1:
        raise UnsupportedFile(f"expert gating function {gating} in {file.path.name} (only softmax, 1, is supported)")
    count, used = int(file.meta("expert_count")), int(file.meta("expert_used_count"))
    if not 0 < used <= count:
        raise UnsupportedFile(f"{file.path.name} uses {used} of {count} experts per token")


def _check_shapes(file: GGUFFile, config: LlamaConfig, layers: int) -> None:
    """Every layer tensor's [rows, cols] as the metadata says, before anything is converted: a file whose
    tensors do not fit is refused in one line instead of failing in the first forward."""
    q, kv = config.heads * config.head_dim, config.kv_heads * config.head_dim
    expected = {"attn_q.weight": (q, config.hidden), "attn_k.weight": (kv, config.hidden), "attn_v.weight": (kv, config.hidden),
                "attn_output.weight": (config.hidden, q), "attn_norm.weight": (1, config.hidden),
                "ffn_norm.weight": (1, config.hidden)}
    if file.arch in MOE_ARCHITECTURES:  # 3-D tensors [experts, rows, cols] as [experts * rows, cols]
        count, ffn = int(file.meta("expert_count")), int(file.meta("expert_feed_forward_length"))
        expected |= {"ffn_gate_inp.weight": (count, config.hidden), "ffn_gate_exps.weight": (count * ffn, config.hidden),
                     "ffn_up_exps.weight": (count * ffn, config.hidden), "ffn_down_exps.weight": (count * config.hidden, ffn)}
    else:
        ffn = int(file.meta("feed_forward_length"))
        expected |= {"ffn_gate.weight": (ffn, config.hidden), "ffn_up.weight": (ffn, config.hidden),
                     "ffn_down.weight": (config.hidden, ffn)}
    if file.arch in QK_NORM_ARCHITECTURES:
        expected |= {"attn_q_norm.weight": (1, config.head_dim), "attn_k_norm.weight": (1, config.head_dim)}
    if file.arch == "gemma3":
        expected |= {"post_attention_norm.weight": (1, config.hidden), "post_ffw_norm.weight": (1, config.hidden)}
    for i in range(layers):
        for part, shape in expected.items():
            name = f"blk.{i}.{part}"
            _check_type(file, name)
            found = (file.tensors[name].rows, file.tensors[name].cols)
            if found != shape:
                raise UnsupportedFile(f"tensor {name} in {file.path.name} is {found[0]} x {found[1]}, not the "
                                      f"{shape[0]} x {shape[1]} its metadata implies")


def _check_type(file: GGUFFile, name: str) -> str:
    if name not in file.tensors:
        raise UnsupportedFile(f"{file.path.name} has no tensor {name}")
    type_name = file.tensors[name].type_name
    if type_name not in ggml.TYPES or type_name in ggml.GROUPED:  # our grouped layouts are no file's types
        raise UnsupportedFile(f"tensor type {type_name} ({name}) in {file.path.name} is not supported "
                              f"(supported: {', '.join(t for t in ggml.TYPES if t not in ggml.GROUPED)})")
    return type_name


def _matrix(file: GGUFFile, names: list[str], reorder: list, plain: torch.dtype | None,
            panels: bool = True) -> quant.Weight:
    """Tensors stacked by rows into one weight: the file's blocks in place, or all decoded into dtype
    ``plain`` if given. ``reorder``: a row permutation per part, or None. ``panels``: the parts may take the
    panel layout (``blocks.grouped_type``), those not reordered after."""
    for name in names:
        _check_type(file, name)
    found = [file.blocks(name, grouped=plain is None, panels=panels and permute is None)
             for name, permute in zip(names, reorder)]
    parts = [permute(raw).contiguous() if permute else raw for (raw, _), permute in zip(found, reorder)]
    return _weight(parts, [type_name for _, type_name in found], plain)


def _weight(parts: list[torch.Tensor], types: list[str], plain: torch.dtype | None) -> quant.Weight:
    if plain is not None:
        return torch.cat([ggml.values(raw, t).to(plain) for raw, t in zip(parts, types)])
    return quant.BlockWeight(tuple(parts), tuple(types))


def _experts(file: GGUFFile, blk: str, plain: torch.dtype | None) -> Experts:
    """A layer's mixture of experts: each expert's matrices are row ranges of the file's 3-D tensors (views of the
    mapping, never copied), so a token reads only its experts' pages. Qwen3 MoE renormalizes the top k."""
    count = int(file.meta("expert_count"))
    gate, up, down = (blk + f"ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
    for name in (gate, up, down):
        _check_type(file, name)
    found = {name: file.blocks(name, grouped=plain is None) for name in (gate, up, down)}

    def expert(names: list[str], e: int) -> quant.Weight:
        rows = [found[n][0].shape[0] // count for n in names]
        parts = [found[n][0][e * r : (e + 1) * r] for n, r in zip(names, rows)]
        return _weight(parts, [found[n][1] for n in names], plain)

    router = ggml.dequantize(file.raw(blk + "ffn_gate_inp.weight"), _check_type(file, blk + "ffn_gate_inp.weight"))
    return Experts(router=router.reshape(count, -1).float(), w13=tuple(expert([gate, up], e) for e in range(count)),
                   w2=tuple(expert([down], e) for e in range(count)), top_k=int(file.meta("expert_used_count")),
                   norm_top_k=True)


def _vector(file: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    return ggml.dequantize(file.raw(name), _check_type(file, name)).reshape(-1).to(dtype)


def load(source: Path | GGUFFile, plain: torch.dtype | None = None, isa: str = "") -> tuple[LlamaConfig, LlamaWeights]:
    """Config and weights of a Llama-family GGUF (a path, or a header already read): the file's blocks for
    the CPU's kernels (laid out for the kernels' path ``isa``, default ``blocks.isa()``, where source is a path),
    or with ``plain`` every tensor dequantized into that dtype (a GPU, or --quantize modes that pack from float
    values)."""
    started = time.perf_counter()
    file = source if isinstance(source, GGUFFile) else GGUFFile(source, isa)
    config = config_of(file)
    if plain is None:
        file.read_into_memory()
    # llama.cpp stores Llama queries and keys with each head's rows in RoPE pairs already (its converter
    # permutes them); Qwen2, Qwen3 and Gemma 3 keep transformers' halves.
    if file.arch in ("qwen2",) + QK_NORM_ARCHITECTURES:
        q_rows = lambda raw: interleave_rope_rows(raw, config.heads)  # noqa: E731
        k_rows = lambda raw: interleave_rope_rows(raw, config.kv_heads)  # noqa: E731
    else:
        q_rows = k_rows = None
    vector_dtype = plain or torch.float32  # norms and biases: the residual stream's dtype

    def matrix(names, reorder, panels=True):
        return _matrix(file, names, reorder, plain, panels)

    _check_shapes(file, config, int(file.meta("block_count")))
    layers = []
    for i in range(int(file.meta("block_count"))):
        blk = f"blk.{i}."
        bias, moe = None, file.arch in MOE_ARCHITECTURES
        if blk + "attn_q.bias" in file.tensors:
            q_b, k_b, v_b = (_vector(file, blk + f"attn_{p}.bias", vector_dtype) for p in "qkv")
            bias = torch.cat([q_rows(q_b[:, None])[:, 0] if q_rows else q_b, k_rows(k_b[:, None])[:, 0] if k_rows else k_b, v_b])
        layers.append(Layer(
            attn_norm=_vector(file, blk + "attn_norm.weight", vector_dtype),
            wqkv=matrix([blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"], [q_rows, k_rows, None]),
            bqkv=bias,
            wo=matrix([blk + "attn_output.weight"], [None]),
            ffn_norm=_vector(file, blk + "ffn_norm.weight", vector_dtype),
            w13=None if moe else matrix([blk + "ffn_gate.weight", blk + "ffn_up.weight"], [None, None]),
            w2=None if moe else matrix([blk + "ffn_down.weight"], [None]),
            qk_norm=qk_norms(_vector(file, blk + "attn_q_norm.weight", torch.float32),
                             _vector(file, blk + "attn_k_norm.weight", torch.float32)).to(vector_dtype)
            if blk + "attn_q_norm.weight" in file.tensors else None,
            **({"post_attn_norm": _vector(file, blk + "post_attention_norm.weight", vector_dtype),
                "post_ffn_norm": _vector(file, blk + "post_ffw_norm.weight", vector_dtype)} if file.arch == "gemma3" else {}),
            moe=_experts(file, blk, plain) if moe else None,
        ))
    _check_type(file, "token_embd.weight")
    # Never in the panel layout: the embedding's rows are looked up one by one, and the head (a Q8_0 49,152 x 576
    # on the 135M) streamed from memory by two threads took 1.02-1.23x the time at one and two rows in it
    # (2026-12-06, AMD Zen 4), where its one-row kernel reads the file's layout.
    if "output.weight" not in file.tensors:  # tied: the head's rows are the embedding
        head = embed = matrix(["token_embd.weight"], [None], panels=False)
    else:
        head, embed = (matrix([name], [None], panels=False) for name in ("output.weight", "token_embd.weight"))
    weights = LlamaWeights(embed=embed, layers=layers, final_norm=_vector(file, "output_norm.weight", vector_dtype),
                           head=head)
    log.info("read %s (%s, %d layers) in %.1f s", file.path.name, file.arch, len(layers), time.perf_counter() - started)
    return config, weights


def to_device(weights: LlamaWeights, device: str) -> LlamaWeights:
    """Plain weights (``load(plain=...)``) moved to a device, the tied embedding kept one tensor."""
    def move(t):
        if isinstance(t, Experts):
            return t.packed(move)._replace(router=move(t.router))
        return None if t is None else t.to(device)
    head = move(weights.head)
    return LlamaWeights(
        embed=head if weights.embed is weights.head else move(weights.embed),
        layers=[Layer(*(move(t) for t in layer)) for layer in weights.layers],
        final_norm=move(weights.final_norm), head=head,
    )
