"""Config in, ready Engine out: the one place that wires checkpoint, runner and slots."""
import logging
from collections.abc import Generator

import torch

from tornchat import checkpoint, prompt
from tornchat.config import Config
from tornchat.engine import blocks, cpu, fused, llama, measurements, speculate
from tornchat.engine.model import HFRunner, Runner
from tornchat.engine.slots import SlotPool
from tornchat.engine.worker import Engine
from tornchat.kernels import sample
from tornchat.kernels.stopcheck import prompt_bytes

log = logging.getLogger("tornchat.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MEASURE_CONTEXT = 16  # tokens of the sample chat a verify's cost is measured after


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise checkpoint.CheckpointError("--device cuda, but this torch build sees no CUDA device")
    return name


def make_runner(loaded: checkpoint.Loaded, config: Config) -> Runner:
    """The lean forward where the family allows it (``llama.unsupported_reason``), else transformers' modules. On a CPU the
    lean forward's matrices are GGML blocks: a GGUF's own, or float weights quantized into --quantize's
    (``llama.pack``; auto keeps them as they are, in fp32). Takes the weights over from ``loaded``, so that
    the runner holds the only copy."""
    if loaded.lean is None:
        model = loaded.model
        reason = llama.unsupported_reason(model.config)
        if config.model_impl == "hf" or (config.model_impl == "auto" and reason):
            if config.quantize not in ("none", "auto"):
                raise checkpoint.CheckpointError(f"--quantize {config.quantize} needs the lean forward ({reason or 'model_impl is hf'})")
            return HFRunner(model)
        if reason:
            raise checkpoint.CheckpointError(f"--model-impl lean: {reason}")
        spec, weights = llama.from_transformers(model)
        del model  # its unfused projections; the fused copies are the weights now
    else:
        spec, weights = loaded.lean
    loaded.model = loaded.lean = None
    if not loaded.packed:
        try:
            weights = llama.pack(weights, "none" if config.quantize == "auto" else config.quantize)
        except ValueError as exc:
            raise checkpoint.CheckpointError(str(exc)) from None
    if blocks.available():
        try:
            blocks.isa()  # TORNCHAT_ISA, where set, must name a path this CPU runs
        except RuntimeError as exc:
            raise checkpoint.CheckpointError(checkpoint.first_line(exc)) from None
    elif weights.final_norm.device.type == "cpu":
        # setup.py's build is optional (pip installs without a compiler), but on a CPU every matrix of the lean
        # forward is multiplied by those kernels: say so at start, not in a traceback at the first product.
        raise checkpoint.CheckpointError(
            f"the lean forward on a CPU needs tornchat's C++ kernels, and this install has none ({blocks.missing()}). "
            "Install a C++ compiler (apt-get install g++) and install tornchat again "
            "(pip install --no-build-isolation -e .), or run transformers' modules: --model-impl hf (much slower)")
    return llama.LlamaRunner(spec, weights)


IDLE_MEASURES = 3  # measurements of a verify's costs while idle, until one is steady (speculate.steady)


def speculation(runner: Runner, mode: str, ids: list[int], checkpoint_id: str) -> tuple[speculate.Costs | None, Generator | None]:
    """The verify costs drafts are sized by, or None for one token per forward: with --speculate none, or
    auto where no draft pays on this machine (a runner that verifies one row at a time, say). Measured at
    the first start, then remembered beside the weights' format where the timings were steady.

    Answers (costs, None) where they are known now: remembered, or measured before the engine starts for
    --speculate lookup, which drafts from the first request. For auto at a first start it answers (None, a
    measurement) instead, which the engine runs while it has nothing else to do (``Engine``'s
    ``measuring``: its result turns drafts on where they pay), so that the start does not wait for it
    (0.14 s at 135M, 0.42 s at 1B, 0.90 s at 3B, AMD Zen 4)."""
    if mode == "none":
        return None, None
    cache_file = checkpoint.cache_root() / "measurements.json"
    label = runner.label() if hasattr(runner, "label") else type(runner).__name__
    # "steady": entries from before measurements were checked for a busy machine are measured again
    key = measurements.cache_key(f"speculate, steady: {label}", checkpoint_id)
    known = measurements.recall(cache_file, key)
    if known:
        return _settled(speculate.Costs(tuple(known["relative"])), mode, "recalled"), None

    def remembered(costs: speculate.Costs, how: str) -> speculate.Costs | None:
        if costs.steady:
            measurements.remember(cache_file, key, {"relative": list(costs.relative), "for": label})
            return _settled(costs, mode, how)
        # a busy machine's timings: drafts sized by them could cost more than they save (lookup asked for drafts)
        log.info("a verify's timings never agreed (a busy machine): measured again at the next start%s",
                 "" if mode == "lookup" else "; drafts off until then")
        return costs if mode == "lookup" else None

    if mode == "lookup":
        return remembered(speculate.measure(runner, ids), "measured now"), None

    def measured_while_idle() -> Generator[None, None, speculate.Costs | None]:
        for _ in range(IDLE_MEASURES):  # a busy moment's timings: measured again at the engine's next idle moment
            costs = yield from speculate.measuring(runner, ids)
            if costs.steady:
                break
        return remembered(costs, "measured while idle")

    log.info("speculation off until a verify's costs are measured, while the engine is idle")
    return None, measured_while_idle()


def _settled(costs: speculate.Costs, mode: str, how: str) -> speculate.Costs | None:
    """The costs to draft by (None: drafts do not pay, under auto), logged."""
    pays = costs.pays()
    log.info("speculation %s: a verify of 1..%d rows costs %s one-token steps (%s)%s", "on" if mode == "lookup" or pays
             else "off", len(costs.relative), list(costs.relative), how, "" if pays else "; drafts do not pay here")
    return costs if mode == "lookup" or pays else None


def sample_ids(tokenizer) -> list[int]:
    """A fixed chat (``speculate.SAMPLE_CHAT``) as a request's would be rendered and encoded."""
    return prompt.encode(tokenizer, prompt.render(tokenizer, speculate.SAMPLE_CHAT, generation_prompt=False))


def warm_up(runner: Runner) -> None:
    """A prefill, a decode step and a sampled token before the first request, which would otherwise pay
    for them: on CUDA, compiling the Triton sampler and capturing its graph takes seconds."""
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
    runner = make_runner(loaded, config)
    warm_up(runner)
    # A short context: what a verify costs against a step hardly depends on it, and a first start waits here.
    ids = sample_ids(loaded.tokenizer)[:MEASURE_CONTEXT]
    costs, measuring = speculation(runner, config.speculate, ids, checkpoint.fingerprint(loaded.source))
    slots = SlotPool(runner, config.kv_slots, config.kv_memory_mb * 1024 * 1024, prompt_bytes(loaded.tokenizer))
    log.info(
        "engine ready on %s (%s), %s forward, weights %s, %s, %d threads, %d KV slots",
        device, cpu.describe() if device == "cpu" else torch.cuda.get_device_name(), type(runner).__name__,
        runner.label() if hasattr(runner, "label") else "as loaded",
        "C++ forward" if getattr(runner, "step", None) else "Python forward"
        + ("" if fused.NATIVE else " (the C++ extension is not built: pip install --no-build-isolation -e .)"),
        torch.get_num_threads(), config.kv_slots,
    )
    return Engine(runner, loaded.tokenizer, stops, slots, max_queue=config.max_queue, on_this_thread=True,
                  speculation=costs, measuring=measuring, parallel=config.parallel)
