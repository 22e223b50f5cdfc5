"""Small Llama-family GGUF files written by the tests, with each matrix in a chosen GGML type.

Quantized tensors are random blocks (random levels, scales of a sensible
size): every bit of the block layout is exercised, and the gguf package's
own dequantizer says what values they hold.
"""
from pathlib import Path

import gguf
import numpy as np

from bench.make_gguf import tokenizer_fields  # the embedded model's tokenizer and chat template
from tornchat.checkpoint import default_gguf_path
from tornchat.engine import ggml

# Offsets of each type's fp16 scale fields in a block (random bytes there could be inf or NaN), and the
# largest level times sub-block scale a value can reach: the fp16 scales are drawn to keep weights about 0.1.
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}
LARGEST = {"Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q8_0": 127, "Q4_K": 15 * 63, "Q5_K": 31 * 63, "Q6_K": 32 * 127}


def random_tensor(rng: np.random.Generator, type_name: str, rows: int, cols: int) -> np.ndarray:
    """A [rows, cols] matrix in type_name: float values, or the raw bytes of random blocks."""
    if type_name in ("F32", "F16"):
        return (rng.normal(size=(rows, cols)) * 0.05).astype(np.float32 if type_name == "F32" else np.float16)
    block = ggml.TYPES[type_name]
    if type_name == "BF16":
        bits = (rng.normal(size=(rows, cols)).astype(np.float32) * 0.05).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, (rows, cols // block.values, block.bytes), dtype=np.uint8)
    for at in SCALE_FIELDS[type_name]:
        size = 0.1 / LARGEST.get(type_name, 16)
        scales = rng.uniform(0.2 * size, size, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def file_values(array: np.ndarray, type_name: str) -> np.ndarray:
    """What a tensor holds, by the gguf package's own dequantizer."""
    if array.dtype != np.uint8:
        return array.astype(np.float32)
    return gguf.quants.dequantize(array, gguf.GGMLQuantizationType[type_name]).astype(np.float32)


EXPERTS, EXPERTS_USED = 8, 3  # a Qwen3 MoE file's


def write(path: Path, types: dict[str, str], arch: str = "llama", layers: int = 2, hidden: int = 256, ffn: int = 512,
          heads: int = 4, kv_heads: int = 2, tied: bool = True, seed: int = 0, tokenizer: bool = False,
          head_dim: int | None = None, window: int = 0) -> Path:
    """A model file: ``types`` maps a tensor's role (q, k, v, o, gate, up, down, embed, output) to its type;
    roles not given are F32. Qwen2 files get q/k/v biases, Qwen3 files per-head q/k norms (and ``head_dim``, if
    given, is written as the key length, heads times it need not be ``hidden``). Gemma 3 files get q/k norms,
    post-attention and post-MLP norms, RoPE base 1e6 (the windowed layers' stays llama.cpp's 10000) and, with
    ``window``, that attention window. Qwen3 MoE files have Qwen3's attention and EXPERTS experts of ``ffn``
    features per layer (gate, up and down: 3-D tensors), EXPERTS_USED of them per token, and an F32 router.
    With ``tokenizer``, the embedded model's
    tokenizer and its vocabulary; without, a 512-token vocabulary and no tokenizer (faster to read).
    Broken files for the error tests: ``types["missing"]`` names a tensor or metadata key left out,
    ``types["heads"]`` a head count written into the metadata that the tensors do not have, ``types["softcap"]``
    a final logit soft-capping, ``types["shared_experts"]`` an expert_shared_count and ``types["gating"]`` an
    expert_gating_func written into a Qwen3 MoE file."""
    rng = np.random.default_rng(seed)
    embedded = gguf.GGUFReader(default_gguf_path()) if tokenizer else None
    vocab = int(embedded.fields["llama.vocab_size"].contents()) if tokenizer else 512
    writer = gguf.GGUFWriter(path, arch)
    missing = types.get("missing")
    metadata = {"block_count": layers, "context_length": 1024, "embedding_length": hidden, "feed_forward_length": ffn,
                "attention.head_count": int(types.get("heads", heads))}
    for key, value in metadata.items():
        if f"{arch}.{key}" != missing:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)
    if window:
        writer.add_uint32(f"{arch}.attention.sliding_window", window)
    if "softcap" in types:
        writer.add_float32(f"{arch}.final_logit_softcapping", float(types["softcap"]))
    moe = arch == "qwen3moe"
    if moe:
        for key, value in (("expert_count", EXPERTS), ("expert_used_count", EXPERTS_USED), ("expert_feed_forward_length", ffn),
                           ("expert_shared_count", int(types.get("shared_experts", 0)))):
            if f"{arch}.{key}" != missing:
                writer.add_uint32(f"{arch}.{key}", value)
        if "gating" in types:
            writer.add_uint32(f"{arch}.expert_gating_func", int(types["gating"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{arch}.vocab_size", vocab)
    for key, value, vtype, sub_type in tokenizer_fields(embedded) if tokenizer else ():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if head_dim:
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    head_dim = head_dim or hidden // heads

    def add(name: str, role: str, rows: int, cols: int, experts: int = 1):
        """A matrix [rows, cols], or with ``experts`` a 3-D tensor of that many [rows, cols] matrices."""
        if name == missing:
            return
        type_name = types.get(role, "F32")
        array = random_tensor(rng, type_name, experts * rows, cols)
        if experts > 1:
            array = array.reshape(experts, rows, -1)
        raw_dtype = None if array.dtype != np.uint8 else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, array, raw_dtype=raw_dtype)

    def norm(name: str, size: int):
        if name != missing:
            writer.add_tensor(name, rng.uniform(0.5, 1.5, size).astype(np.float32))

    add("token_embd.weight", "embed", vocab, hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        add(f"blk.{i}.attn_q.weight", "q", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", "k", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", "v", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            for part, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                writer.add_tensor(f"blk.{i}.attn_{part}.bias", rng.normal(0, 0.5, size * head_dim).astype(np.float32))
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            for part in "qk":
                writer.add_tensor(f"blk.{i}.attn_{part}_norm.weight", rng.uniform(0.5, 1.5, head_dim).astype(np.float32))
        add(f"blk.{i}.attn_output.weight", "o", hidden, heads * head_dim)
        if arch == "gemma3":
            norm(f"blk.{i}.post_attention_norm.weight", hidden)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        if moe:
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.normal(0, 0.5, (EXPERTS, hidden)).astype(np.float32))
        suffix, experts = ("_exps", EXPERTS) if moe else ("", 1)
        add(f"blk.{i}.ffn_gate{suffix}.weight", "gate", ffn, hidden, experts)
        add(f"blk.{i}.ffn_up{suffix}.weight", "up", ffn, hidden, experts)
        add(f"blk.{i}.ffn_down{suffix}.weight", "down", hidden, ffn, experts)
        if arch == "gemma3":
            norm(f"blk.{i}.post_ffw_norm.weight", hidden)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    if not tied:
        add("output.weight", "output", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tokenizer(path: Path, arch: str = "llama", renamed: dict[int, str] | None = None, **fields) -> Path:
    """A GGUF holding the embedded model's tokenizer and no tensors: ``fields`` replace tokenizer.* keys (the
    part after ``tokenizer.ggml.``, or chat_template), ``renamed`` respells tokens by id. Read through our
    header reader, which takes milliseconds where gguf's GGUFReader takes seconds."""
    from tornchat.weights.gguf_file import GGUFFile

    source = GGUFFile(default_gguf_path())
    writer = gguf.GGUFWriter(path, arch)
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count"):
        writer.add_uint32(f"{arch}.{key}", 64)
    values = {key: source.value(key) if key not in source.arrays else source.array(key)
              for key in source.fields if key.startswith("tokenizer.")}
    for key, value in fields.items():
        values["tokenizer.chat_template" if key == "chat_template" else f"tokenizer.ggml.{key}"] = value
    values["tokenizer.ggml.tokens"] = [(renamed or {}).get(i, t) for i, t in enumerate(values["tokenizer.ggml.tokens"])]
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, np.ndarray):
            writer.add_array(key, value.tolist()) if value.dtype.kind == "f" else writer.add_key_value(
                key, value.tolist(), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_vocabulary() -> dict:
    """tokenizer.ggml.* fields of a SentencePiece-style vocabulary ("llama": Llama 2, Mistral) made from the
    embedded model's: its tokens spelled as text with "▁" for a space, after <unk>, <s>, </s> and the 256
    byte tokens, scored by rank, without merges (as llama.cpp writes such files: transformers derives
    them from the scores), and two of ChatML's markers kept as control and user-defined tokens."""
    from tornchat.weights.gguf_file import GGUFFile
    from tornchat.weights.gguf_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokens, types = ["<unk>", "<s>", "</s>", "<|im_start|>", "<think>"], [2, 3, 3, 3, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    seen = set(tokens)
    for token in GGUFFile(default_gguf_path()).array("tokenizer.ggml.tokens")[17:]:
        try:
            text = bytes(byte_of[c] for c in token).decode("utf-8").replace(" ", "\u2581")
        except (KeyError, UnicodeDecodeError):
            continue
        if text not in seen and text.isprintable():
            seen.add(text)
            tokens.append(text)
            types.append(1)
    return {"model": "llama", "pre": "default", "tokens": tokens, "token_type": np.array(types, dtype=np.int32),
            "scores": -np.arange(len(tokens), dtype=np.float32), "merges": None, "bos_token_id": 1,
            "eos_token_id": 2, "unknown_token_id": 0, "padding_token_id": None, "add_bos_token": None,
            "add_space_prefix": True}
