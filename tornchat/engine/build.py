"""Config in, ready Engine out: the one place that wires checkpoint, runner and slots."""
import logging

import torch

from tornchat import checkpoint, prompt
from tornchat.config import Config
from tornchat.engine import llama, quant
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


def pick_quantize(name: str, model: torch.nn.Module) -> str:
    """auto, on a CPU: int4 where every layer matrix already sits on its grid (a Q4_1 GGUF, such as the
    embedded model: lossless; 0.3 s to check), else packed bf16 where the CPU has bf16 hardware, else
    none (README). A file mixing formats (Q4_K_M) is not on the grid and gets bf16."""
    if name != "auto":
        return name
    if next(model.parameters()).device.type != "cpu":
        return "none"
    matrices = [p for layer in model.model.layers for p in layer.parameters() if p.dim() == 2]
    if all(quant.on_int4_grid(matrix) for matrix in matrices):
        return "int4"
    return "bf16" if torch.cpu._is_avx512_bf16_supported() else "none"


def make_runner(model: torch.nn.Module, config: Config) -> Runner:
    """The lean forward where the family allows it (PERF-NOTES.md), else transformers' modules."""
    reason = llama.unsupported_reason(model)
    if config.model_impl == "hf" or (config.model_impl == "auto" and reason):
        if config.quantize not in ("none", "auto"):
            raise checkpoint.CheckpointError(f"--quantize {config.quantize} needs the lean forward ({reason or 'model_impl is hf'})")
        return HFRunner(model)
    if reason:
        raise checkpoint.CheckpointError(f"--model-impl lean: {reason}")
    return llama.LlamaRunner(model, quantize=pick_quantize(config.quantize, model))


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
    loaded = checkpoint.load(config.checkpoint_path, device=device, dtype=DTYPES[config.dtype])
    runner = make_runner(loaded.model, config)
    warm_up(runner)
    slots = SlotPool(runner, config.kv_slots, config.kv_memory_mb * 1024 * 1024, prompt_bytes(loaded.tokenizer))
    stops = prompt.stop_token_ids(loaded.tokenizer, getattr(loaded.model, "generation_config", None))
    log.info(
        "engine ready on %s, %s forward, decode weights %s, %d threads, %d KV slots",
        device, type(runner).__name__, getattr(runner, "quantize", "as loaded"), torch.get_num_threads(), config.kv_slots,
    )
    return Engine(runner, loaded.tokenizer, stops, slots, max_queue=config.max_queue, on_this_thread=True)
