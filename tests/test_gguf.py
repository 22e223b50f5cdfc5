"""Our GGUF loader: every block type against the gguf package's dequantizer, whole files against
transformers' own GGUF loading, and one-line errors for what it does not read."""
import ctypes
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tornchat import checkpoint, prompt
from tornchat.engine import blocks, llama, quant
from tornchat.engine import ggml
from tornchat.weights import file_memory, gguf_file

import gguf_files

QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.mark.parametrize("type_name", QUANTIZED + ["F16", "BF16", "F32"])
def test_every_type_decodes_as_the_gguf_package_does(type_name):
    rng = np.random.default_rng(1)
    array = gguf_files.random_tensor(rng, type_name, 6, 512)
    raw = torch.from_numpy(array.view(np.uint8).reshape(6, -1))
    expected = gguf_files.file_values(array, type_name)
    assert np.array_equal(ggml.dequantize(raw, type_name).numpy(), expected)
    if type_name in ggml.INT4:  # levels, scales and lows give the same values, to the bit
        levels, scales, lows = ggml.int4_levels(raw, type_name)
        assert levels.dtype == torch.uint8 and int(levels.max()) <= 15 and scales.shape == (6, 512 // 32)
        values = levels.reshape(6, -1, 32).float() * scales[..., None] + lows[..., None]
        assert np.array_equal(values.reshape(6, 512).numpy(), expected)


def test_the_header_reader_agrees_with_the_gguf_package(tmp_path):
    import gguf

    path = gguf_files.write(tmp_path / "m.gguf", {"q": "Q4_K", "v": "Q6_K", "down": "Q8_0", "embed": "Q5_0"}, tokenizer=True)
    ours, theirs = gguf_file.GGUFFile(path), gguf.GGUFReader(path)
    assert len(ours.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert (mine.type_name, mine.offset, mine.nbytes) == (tensor.tensor_type.name, tensor.data_offset, tensor.n_bytes)
        assert np.array_equal(ours.raw(tensor.name).numpy().reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))
    assert ours.meta("block_count") == 2 and ours.value("tokenizer.chat_template").startswith("{%")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert list(ours.array(key)) == list(theirs.fields[key].contents()), key
    assert ours.array("tokenizer.ggml.scores") is None  # a byte-level vocabulary has none


def hf_logits(path, ids, **config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **config).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


IDS = list(range(300, 340))
MIXES = {
    "q4_0": {m: "Q4_0" for m in MATRICES} | {"embed": "Q8_0"},
    "q4_1+q5_1": {m: "Q4_1" for m in MATRICES} | {"down": "Q5_1", "embed": "Q4_1"},
    "q4_k_m": {m: "Q4_K" for m in MATRICES} | {"v": "Q6_K", "down": "Q6_K", "embed": "Q6_K"},
    "q5_k+q5_0": {m: "Q5_K" for m in MATRICES} | {"o": "Q5_0", "embed": "Q4_K"},
    "f16": {m: "F16" for m in MATRICES} | {"embed": "BF16"},
}


@pytest.mark.parametrize("arch, mix, tied", [("llama", name, True) for name in MIXES] + [("llama", "q4_k_m", False),
                                             ("qwen2", "q4_0", True), ("qwen3", "q4_k_m", True),
                                             ("gemma3", "q4_k_m", True), ("qwen3moe", "q4_k_m", True),
                                             ("qwen3moe", "q4_1+q5_1", True)])
def test_a_loaded_model_computes_what_transformers_does_with_the_file(tmp_path, arch, mix, tied):
    types = MIXES[mix] | ({"output": "Q6_K"} if not tied else {})
    # Qwen3's heads times head_dim is not its hidden size (0.6B: 16 x 128 over 1024). Gemma 3: head_dim 256, as
    # transformers takes query_pre_attn_scalar (absent from GGUF) to be; 6 layers, the last global, the other
    # five windowed to 16 of the 40 positions.
    gemma, moe = arch == "gemma3", arch == "qwen3moe"
    path = gguf_files.write(tmp_path / f"{arch}-{mix}.gguf", types, arch=arch, tied=tied,
                            head_dim=128 if arch.startswith("qwen3") else 256 if gemma else None,
                            layers=6 if gemma else 2, window=16 if gemma else 0, ffn=256 if moe else 512)
    # transformers reads no expert_feed_forward_length from a GGUF
    expected = hf_logits(path, IDS, **({"moe_intermediate_size": 256} if moe else {}))
    config, plain = gguf_file.load(path, plain=torch.float32)  # the file's values, dequantized
    torch.testing.assert_close(llama.LlamaRunner(config, plain, kv_dtype=torch.float32).score(IDS, "exact"), expected,
                               atol=2e-4, rtol=1e-3)

    config, weights = gguf_file.load(path)  # the file's blocks, in place
    in_blocks = llama.LlamaRunner(config, weights, kv_dtype=torch.float32)
    assert all(isinstance(m, quant.BlockWeight) for layer in weights.layers for m in layer.matrices())
    # stacked as the file has them, in the layout the kernels read them in (csrc/blocks.h's grouped and panel
    # ones: the panels where no row is reordered after, as Qwen's and Gemma's queries and keys are)
    qkv = weights.layers[0].wqkv
    reordered = arch != "llama"
    assert qkv.types == tuple(blocks.grouped_type(types[m], rows=part.shape[0], panels=m == "v" or not reordered)
                              for m, part in zip("qkv", qkv.parts))
    down = weights.layers[0].moe.w2[0] if moe else weights.layers[0].w2
    assert down.types == (blocks.grouped_type(types["down"], rows=down.parts[0].shape[0], panels=not moe),)
    assert not any(t in ggml.PANELED for t in weights.embed.types + weights.head.types)  # rows looked up; the head
    if moe:  # each expert's matrices are consecutive row ranges of the file's mapped tensors, not copies
        gates = [w13.parts[0] for w13 in weights.layers[0].moe.w13]
        assert len(gates) == gguf_files.EXPERTS and weights.layers[0].moe.top_k == gguf_files.EXPERTS_USED
        assert all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(gates, gates[1:]))
    assert (weights.embed is weights.head) == tied and isinstance(weights.embed, quant.BlockWeight)
    # The kernels compute on the file's values with activations rounded to int8 per block of 32 (the float
    # types on fp32 activations): against fp32 products of the same values, that rounding alone.
    got, exact = in_blocks.score(IDS), in_blocks.score(IDS, "exact")
    torch.testing.assert_close(exact, expected, atol=2e-4, rtol=1e-3)
    # (On random weights that rounding moves the logits by 2.6-2.7% in L2; parts in the wrong order or the
    # wrong type would move them by about 100%.)
    tolerance = 1e-5 if mix == "f16" else 0.06
    assert float(torch.linalg.norm(got - exact)) <= tolerance * float(torch.linalg.norm(exact))


def test_the_map_is_grouped_once_and_read_either_way(tmp_path):
    """Blocks the kernels read grouped (blocks.group) are rearranged in the file's map once: loading the same
    file again, in blocks or decoded, reads the values the file holds, and the file itself is untouched."""
    path = gguf_files.write(tmp_path / "m.gguf", MIXES["q4_0"])
    before = path.read_bytes()
    file = gguf_file.GGUFFile(path)
    _, first = gguf_file.load(file)
    _, again = gguf_file.load(file)
    _, plain = gguf_file.load(file, plain=torch.float32)
    _, fresh = gguf_file.load(path, plain=torch.float32)
    for weights in (first, again):
        wo = weights.layers[1].wo
        assert wo.types == (blocks.grouped_type("Q4_0", rows=wo.parts[0].shape[0], panels=True),)
        assert torch.equal(weights.layers[1].wo.dequantize(torch.float32), fresh.layers[1].wo)
        assert torch.equal(weights.head.dequantize(torch.float32), fresh.head)
    assert torch.equal(plain.layers[1].wo, fresh.layers[1].wo) and torch.equal(plain.head, fresh.head)
    assert path.read_bytes() == before


def test_blocks_used_in_place_are_read_into_memory_of_their_own(tmp_path):
    """Loaded for the CPU's kernels, the file's tensors are read once into anonymous memory advised for 2 MiB
    pages (MADV_HUGEPAGE, where the OS has it) that the weights view; decoded (plain), they stay in the file's
    map, so that no view of a small tensor holds a copy of them all."""
    path = gguf_files.write(tmp_path / "m.gguf", MIXES["q4_k_m"])
    file = gguf_file.GGUFFile(path)
    gguf_file.load(file, plain=torch.float32)
    assert file.memory is None
    _, weights = gguf_file.load(file)
    start = ctypes.addressof(ctypes.c_char.from_buffer(file.memory))
    assert len(file.memory) == path.stat().st_size  # the whole file, tensors at their offsets in it
    for part in (*weights.layers[0].wqkv.parts, *weights.layers[1].w2.parts, *weights.head.parts):
        assert start <= part.data_ptr() < start + len(file.memory)
    smaps = Path("/proc/self/smaps")  # Linux, with transparent huge pages built into its kernel
    if smaps.exists() and hasattr(mmap, "MADV_HUGEPAGE") and Path("/sys/kernel/mm/transparent_hugepage").exists():
        assert "hg" in _vm_flags(smaps.read_text(), start)


def test_a_read_begun_before_the_load_is_the_one_it_takes(tmp_path):
    """The command line begins the file's read (``checkpoint.start_reading``) before torch's import; the
    loader takes that memory (the whole file, tensors at their file offsets) instead of reading again, and
    a read it did not take (tensors decoded, not used in place) is dropped once the load is done."""
    path = gguf_files.write(tmp_path / "m.gguf", MIXES["q4_k_m"])
    checkpoint.start_reading(str(path), "cpu", "auto", "auto")
    begun = file_memory._readings[path.resolve()]
    begun.thread.join()
    assert bytes(begun.memory) == path.read_bytes()
    file = gguf_file.GGUFFile(path)
    _, weights = gguf_file.load(file)  # rearranges the blocks in that memory
    assert file.memory is begun.memory and not file_memory._readings
    assert torch.equal(weights.head.dequantize(torch.float32), gguf_file.load(path, plain=torch.float32)[1].head)
    with_tokenizer = gguf_files.write(tmp_path / "t.gguf", MIXES["q4_k_m"], tokenizer=True)
    checkpoint.start_reading(str(with_tokenizer), "cpu", "auto", "auto")
    loaded = checkpoint.load(str(with_tokenizer), model_impl="lean", quantize="int8")  # decoded: no read taken
    assert loaded.lean is not None and not loaded.packed and not file_memory._readings


@pytest.mark.parametrize("readers", [1, 3])
def test_a_file_read_in_parts_is_the_files_bytes(tmp_path, monkeypatch, readers):
    """Read in parts at once (whole 2 MiB pages each, the last short), the memory holds the file as it is; a
    file that shrinks under the read fails it."""
    monkeypatch.setattr(file_memory, "READERS", readers)
    path = tmp_path / "blob"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 5 * file_memory.HUGE_PAGE + 123, dtype=np.uint8).tobytes())
    assert bytes(file_memory.read(path)) == path.read_bytes()
    path.write_bytes(b"")
    assert bytes(file_memory.read(path)) == b"\x00"  # an empty file: one zero byte, mmap's least
    real_open = open

    def shrunk(name, *args, **kwargs):  # a file that ends early for every reader
        handle = real_open(name, *args, **kwargs)
        handle.readinto = lambda view: 0
        return handle

    path.write_bytes(b"x" * 100)
    monkeypatch.setattr(file_memory, "open", shrunk, raising=False)
    with pytest.raises(OSError, match="shrank"):
        file_memory.read(path)


def test_reads_begin_only_for_a_gguf_the_cpu_kernels_use_in_place(tmp_path):
    path = gguf_files.write(tmp_path / "m.gguf", MIXES["q4_k_m"])
    for device, model_impl, quantize in (("cuda", "auto", "auto"), ("cpu", "hf", "auto"), ("cpu", "auto", "int4")):
        checkpoint.start_reading(str(path), device, model_impl, quantize)
    checkpoint.start_reading(str(tmp_path), "cpu", "auto", "auto")  # a directory
    checkpoint.start_reading(str(tmp_path / "none.gguf"), "cpu", "auto", "auto")
    assert not file_memory._readings


def test_the_command_line_reaches_the_read_before_importing_torch():
    """What the early read overlaps: nothing the command line imports before ``start_reading`` imports
    torch."""
    code = "import sys, tornchat.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def _vm_flags(smaps: str, address: int) -> list[str]:
    inside = False
    for line in smaps.splitlines():
        first = line.split()[0] if line else ""
        if "-" in first and not first.endswith(":"):
            low, high = (int(end, 16) for end in first.split("-"))
            inside = low <= address < high
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("arch, types, message", [
    ("gemma", {"q": "Q4_0"}, "unsupported architecture 'gemma'"),
    ("llama", {"q": "Q2_K"}, r"tensor type Q2_K \(blk.0.attn_q.weight\)"),
    ("llama", {"missing": "blk.1.ffn_up.weight"}, r"has no tensor blk.1.ffn_up.weight"),
    ("llama", {"missing": "llama.embedding_length"}, r"lacks the metadata key llama.embedding_length"),
    ("llama", {"heads": "8"}, r"attn_k.weight in m.gguf is 128 x 256, not the 64 x 256"),  # tensors that do not fit
    ("gemma3", {"softcap": "30"}, r"final logit softcapping in m.gguf"),
    ("gemma3", {"missing": "blk.0.post_ffw_norm.weight"}, r"has no tensor blk.0.post_ffw_norm.weight"),
    ("qwen3moe", {"shared_experts": "1"}, "shared experts in m.gguf are not supported"),
    ("qwen3moe", {"gating": "2"}, r"expert gating function 2 in m.gguf \(only softmax, 1, is supported\)"),  # sigmoid
    ("qwen3moe", {"missing": "qwen3moe.expert_used_count"}, r"lacks the metadata key qwen3moe.expert_used_count"),
    ("qwen3moe", {"missing": "blk.1.ffn_down_exps.weight"}, r"has no tensor blk.1.ffn_down_exps.weight"),
])
def test_what_it_does_not_read_fails_with_one_line(tmp_path, arch, types, message, monkeypatch):
    if "Q2_K" in types.values():  # gguf's writer takes raw blocks of any type; ours has no random Q2_K
        monkeypatch.setitem(gguf_files.SCALE_FIELDS, "Q2_K", (80, 82))
        monkeypatch.setitem(ggml.TYPES, "Q2_K", ggml.BlockType("Q2_K", 256, 84))
        path = gguf_files.write(tmp_path / "m.gguf", types, arch=arch)
        monkeypatch.delitem(ggml.TYPES, "Q2_K")
    else:
        path = gguf_files.write(tmp_path / "m.gguf", types, arch=arch)
    with pytest.raises(checkpoint.CheckpointError, match=message) as error:
        checkpoint.load(str(path), model_impl="lean")
    assert "\n" not in str(error.value)


def test_the_embedded_model_loads_without_a_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("TORNCHAT_CACHE", str(tmp_path))
    loaded = checkpoint.load(None, model_impl="auto")
    config, weights = loaded.lean
    assert loaded.model is None and loaded.packed and loaded.source.endswith(".gguf")
    # the file's blocks (the 135M's gate and up: 1,536 rows each, whole slabs of the panel layout)
    assert weights.layers[0].w13.types == (blocks.grouped_type("Q4_1", rows=1536, panels=True),) * 2
    if "avx2" in blocks.isas():  # laid out for another path: the grouped layout, which every x86 path reads
        _, for_avx2 = gguf_file.load(Path(loaded.source), isa="avx2")
        assert for_avx2.layers[0].w13.types == ("Q4_1_G8",) * 2
    assert weights.embed is weights.head  # tied
    assert not list(tmp_path.iterdir())  # nothing converted: the tokenizer is built from the file's metadata
    assert prompt.render(loaded.tokenizer, [{"role": "user", "content": "hi"}]).startswith("<|im_start|>")


def test_the_cpp_converters_are_built():
    # The README's install builds them; without them the references run and loading is slower, not wrong.
    assert ggml._native is not None, "tornchat/engine/_ggml is not built: pip install --no-build-isolation -e ."


@pytest.mark.parametrize("type_name", QUANTIZED)
def test_the_cpp_decoder_is_the_reference_bit_for_bit(type_name):
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(gguf_files.random_tensor(rng, type_name, 128, 512))
    assert torch.equal(ggml.values(raw, type_name), ggml.dequantize(raw, type_name))


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_hf_checkpoint_is_packed_layer_by_layer_as_it_is_read(tiny_checkpoint, tiny_model, mode):
    """--quantize int4|int8 on a safetensors directory: no transformers model, no fp32 copy of the model."""
    loaded = checkpoint.load(tiny_checkpoint, model_impl="auto", quantize=mode)
    assert loaded.model is None and loaded.packed
    config, weights = loaded.lean
    w13 = weights.layers[0].w13
    assert w13.types == (blocks.grouped_type(quant.BLOCK_TYPES[mode], rows=w13.parts[0].shape[0], panels=True),)
    assert weights.embed is weights.head  # tied: the head's blocks give the embedding's rows, one copy
    reference_config, plain = llama.from_transformers(tiny_model)  # the same weights, packed from the model
    expected = llama.LlamaRunner(reference_config, llama.pack(plain, mode))
    assert torch.equal(llama.LlamaRunner(config, weights).score(IDS), expected.score(IDS))


def test_a_gemma3_checkpoint_is_packed_as_its_transformers_model_is(tiny_gemma3, tokenizer, tmp_path):
    """The safetensors path reads Gemma's names and (1 + weight) norms as from_transformers does."""
    tiny_gemma3.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = checkpoint.load(str(tmp_path), model_impl="auto", quantize="int8")
    assert loaded.model is None and loaded.packed
    reference_config, plain = llama.from_transformers(tiny_gemma3)
    expected = llama.LlamaRunner(reference_config, llama.pack(plain, "int8"))
    assert torch.equal(llama.LlamaRunner(*loaded.lean).score(IDS), expected.score(IDS))


def test_a_mixture_of_experts_checkpoint_is_packed_expert_by_expert(tiny_qwen3_moe, tokenizer, tmp_path):
    """--quantize int8 on a Qwen3 MoE safetensors directory (each expert's matrices stored apart, as transformers
    saves them): the same blocks as packing the loaded model's, and the router left in fp32."""
    tiny_qwen3_moe.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = checkpoint.load(str(tmp_path), model_impl="auto", quantize="int8")
    assert loaded.model is None and loaded.packed
    config, weights = loaded.lean
    moe = weights.layers[1].moe
    assert weights.layers[1].w13 is None and len(moe.w13) == 8 and moe.top_k == 3 and moe.norm_top_k
    assert moe.w13[0].types == (blocks.grouped_type("Q8_0", rows=moe.w13[0].shape[0], panels=True),)
    assert moe.router.dtype == torch.float32
    reference_config, plain = llama.from_transformers(tiny_qwen3_moe)
    expected = llama.LlamaRunner(reference_config, llama.pack(plain, "int8"))
    assert torch.equal(llama.LlamaRunner(config, weights).score(IDS), expected.score(IDS))


def test_the_qwen3moe_preset_writes_what_transformers_and_our_loader_read_alike(tmp_path):
    """bench/make_gguf.py's qwen3moe-3b shape, shrunk: its 3-D expert tensors and F32 router in the layout
    transformers' GGUF reader and ours agree on."""
    import dataclasses

    from bench import make_gguf

    shape = dataclasses.replace(make_gguf.PRESETS["qwen3moe-3b"], layers=2, hidden=256, heads=4, kv_heads=2, experts=4,
                                experts_used=2, context_length=512)
    path = tmp_path / "moe.gguf"
    make_gguf.write_f16(path, "moe", shape, checkpoint.default_gguf_path(), seed=0, std=0.1)
    config, weights = gguf_file.load(path)
    moe = weights.layers[1].moe
    assert len(moe.w13) == 4 and moe.top_k == 2 and moe.w13[0].shape == (2 * 256, 256) and moe.w2[0].shape == (256, 256)
    assert gguf_file.GGUFFile(path).tensors["blk.0.ffn_gate_inp.weight"].type_name == "F32"
    expected = hf_logits(path, IDS, moe_intermediate_size=256)
    got = llama.LlamaRunner(config, weights, kv_dtype=torch.float32).score(IDS, "exact")
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
