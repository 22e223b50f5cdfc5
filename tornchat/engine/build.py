"""Config in, ready Engine out: the one place that wires checkpoint, runner and slots."""
import logging
from collections.abc import Generator

import torch

from tornchat import checkpoint, prompt
from tornchat.config import Config
from tornchat.engine import autotune, cpu, fused, llama, speculate
from tornchat.engine.model import HFRunner, Runner
from tornchat.engine.slots import SlotPool
from tornchat.engine.worker import Engine
from tornchat.kernels import sample
from tornchat.kernels.stopcheck import prompt_bytes

log = logging.getLogger("tornchat.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise checkpoint.CheckpointError("--device cuda, but this torch build sees no CUDA device")
    return name


def make_runner(loaded: checkpoint.Loaded, config: Config, quality_ids: list[int], checkpoint_id: str,
                later: bool = False) -> tuple[Runner, Generator | None]:
    """The lean forward where the family allows it (PERF-NOTES.md), else transformers' modules; on a CPU,
    decode weights in the format --quantize asks for, timed on this machine (autotune). Takes the weights
    over from ``loaded``, so that the runner holds the only copy. With ``later``, a checkpoint whose format
    this machine has not measured yet comes back as ``autotune.provisional``'s runner with the measurement
    to run (``autotune.measure``), and one whose measured format takes building (``autotune.rebuilds``) with
    that to run (``autotune.recalled``); otherwise the second item is None."""
    if loaded.lean is None:
        model = loaded.model
        reason = llama.unsupported_reason(model.config)
        if config.model_impl == "hf" or (config.model_impl == "auto" and reason):
            if config.quantize not in ("none", "auto"):
                raise checkpoint.CheckpointError(f"--quantize {config.quantize} needs the lean forward ({reason or 'model_impl is hf'})")
            return HFRunner(model), None
        if reason:
            raise checkpoint.CheckpointError(f"--model-impl lean: {reason}")
        spec, weights = llama.from_transformers(model)
        del model  # its unfused projections; the fused copies are the weights now
    else:
        spec, weights = loaded.lean
    loaded.model = loaded.lean = None
    if weights.final_norm.device.type == "cuda":
        try:
            return autotune.choose_on_gpu(spec, weights, config.quantize, quality_ids), None
        except autotune.NoFormat as exc:
            raise checkpoint.CheckpointError(str(exc)) from None
    if config.quantize == "none" and not loaded.quantized:
        return llama.LlamaRunner(spec, weights), None
    cache_file = checkpoint.cache_root() / "decode-formats.json"
    # Weights packed while loading (a GGUF's blocks, a checkpoint packed layer by layer) are a format of
    # their own: their inputs and prefill are timed, and checked for quality unless the user chose them.
    requested, gate = "packed" if loaded.quantized else config.quantize, config.quantize == "auto"
    known = autotune.recall(cache_file, autotune.cache_key(requested, checkpoint_id))
    try:
        if later and known is None:
            return autotune.provisional(spec, weights, requested), autotune.measure(
                spec, weights, requested, quality_ids, cache_file, checkpoint_id, gate)
        if later and autotune.rebuilds(known):
            inputs = known["format"]["inputs"]
            return autotune.provisional(spec, weights, requested, inputs), autotune.recalled(spec, weights, known)
        runner, _ = autotune.choose(spec, weights, requested, quality_ids, cache_file, checkpoint_id, gate=gate)
    except autotune.NoFormat as exc:
        raise checkpoint.CheckpointError(str(exc)) from None
    return runner, None


def speculation(runner: Runner, mode: str, ids: list[int], checkpoint_id: str) -> speculate.Costs | None:
    """The verify costs drafts are sized by, or None for one token per forward: with --speculate none, or
    auto where no draft pays on this machine (a runner that verifies one row at a time, say). Measured at
    the first start, then remembered beside the weights' format."""
    if mode == "none":
        return None
    cache_file = checkpoint.cache_root() / "decode-formats.json"
    label = runner.label() if hasattr(runner, "label") else type(runner).__name__
    key = autotune.cache_key(f"speculate: {label}", checkpoint_id)
    known = autotune.recall(cache_file, key)
    costs = speculate.Costs(tuple(known["relative"])) if known else speculate.measure(runner, ids)
    if not known:
        autotune.remember(cache_file, key, {"relative": list(costs.relative), "for": label})
    pays = costs.pays()
    log.info("speculation %s: a verify of 1..%d rows costs %s one-token steps%s", "on" if mode == "lookup" or pays
             else "off", len(costs.relative), list(costs.relative), "" if pays else "; drafts do not pay here")
    return costs if mode == "lookup" or pays else None


def quality_ids(tokenizer) -> list[int]:
    """autotune's fixed chat, in the model's own template where it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(autotune.QUALITY_TEXT, tokenize=True, return_dict=False)
    return tokenizer(" ".join(m["content"] for m in autotune.QUALITY_TEXT))["input_ids"]


def warm_up(runner: Runner) -> None:
    """A prefill, a decode step and a sampled token before the first request, which would otherwise pay
    for them: on CUDA, compiling the Triton sampler and capturing its graph took 7 s on an H100."""
    cache = runner.new_cache()
    runner.forward([0], cache)
    logits = runner.forward([0], cache, decode=True)
    ones = torch.ones(1, device=logits.device)
    zeros = torch.zeros(1, dtype=torch.int64, device=logits.device)
    sample(logits[None, :], ones, zeros, ones, zeros, 0)  # temperature 1, no top-k, top-p 1, seed 0


def build_engine(config: Config) -> Engine:
    """Load the model on the engine's own worker thread, which then serves (``Engine.start``)."""
    return Engine.start(lambda: _build_on_worker(config))


def _build_on_worker(config: Config) -> Engine:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = pick_device(config.device)
    loaded = checkpoint.load(config.checkpoint_path, device=device, dtype=DTYPES[config.dtype],
                             model_impl=config.model_impl, quantize=config.quantize)
    stops = prompt.stop_token_ids(loaded.tokenizer, loaded.generation_config)
    ids, checkpoint_id = quality_ids(loaded.tokenizer), checkpoint.fingerprint(loaded.source)
    runner, measuring = make_runner(loaded, config, ids, checkpoint_id, later=True)
    warm_up(runner)
    # A first start serves at once; the measurements run while no request waits (Engine's ``tuning``).
    costs = None if measuring else speculation(runner, config.speculate, ids, checkpoint_id)
    tuning = measured(measuring, config.speculate, ids, checkpoint_id) if measuring else None
    slots = SlotPool(runner, config.kv_slots, config.kv_memory_mb * 1024 * 1024, prompt_bytes(loaded.tokenizer))
    log.info(
        "engine ready on %s (%s), %s forward, weights %s, %s, %d threads, %d KV slots",
        device, cpu.describe() if device == "cpu" else torch.cuda.get_device_name(), type(runner).__name__,
        runner.label() if hasattr(runner, "label") else "as loaded",
        "C++ decode step" if getattr(runner, "decode_step", None) else "per-op decode steps"
        + ("" if fused.NATIVE else " (the C++ extension is not built: pip install --no-build-isolation -e .)"),
        torch.get_num_threads(), config.kv_slots,
    )
    return Engine(runner, loaded.tokenizer, stops, slots, max_queue=config.max_queue, on_this_thread=True,
                  speculation=costs, tuning=tuning)


def measured(measuring: Generator, mode: str, ids: list[int], checkpoint_id: str) -> Generator:
    """A first start's work after serving began, in slices: the formats measured (``autotune.measure``), the
    kept runner warmed up, and its speculation costs; returns (runner, costs) for the engine to switch to."""
    runner, _ = yield from measuring
    warm_up(runner)
    yield
    return runner, speculation(runner, mode, ids, checkpoint_id)
