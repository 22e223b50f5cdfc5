"""The decode weights' format, chosen by timing on this machine and remembered.

Which format decodes fastest depends on the CPU, not on one flag: PyTorch's
int4 and int8 kernels run 10-28x faster with bf16 inputs than fp32 ones on
AVX2 and AVX-512 BF16 machines, but one AVX-512 machine without bf16 had
the fp32 int4 path fastest; oneDNN's packed bf16 linear refuses AVX2-only
CPUs; int8 beat int4 on large shapes on AVX2 (PERF-NOTES.md, README). So at
start-up each candidate is packed for the model's own layer shapes and
timed, and the fastest whose quality holds is kept: perplexity and greedy
agreement through the decode weights, against the model's own weights, on a
fixed chat. Weights packed while loading (a quantized GGUF's blocks as int4
and int8 by block type, or a checkpoint packed layer by layer) already are
a format (``packed``): for them the kernels' input dtype is timed. Then the
prefill of the kept format: from which chunk length its matrices are
dequantized, layer by layer, into bf16 or fp32 for the chunk's matmuls, or
multiplied in int8 on the chunk's rows quantized to int8 (where the quality
gate checks it), rather than run through the decode kernels. The decision (never the packed
weights, whose layout depends on the instruction set) is cached, keyed by
CPU, checkpoint, torch version and thread count, so later starts skip the
timing.
"""
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from tornchat.engine import chunk_attention, cpu, fused, quant
from tornchat.engine.llama import (QUANTIZE, LlamaConfig, LlamaRunner, LlamaWeights, as_plain, causal_mask, pack,
                                   packers, sdpa_attend, shared_embedding)

log = logging.getLogger("tornchat.engine")

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# A chunk's matrices dequantized into bf16 or fp32, or multiplied in int8 on its rows quantized to int8
# (quant.DynamicInt8Weight).
PREFILL_DTYPES = {**DTYPES, "int8": torch.int8}
MAX_PERPLEXITY_RISE = 0.02  # bf16 inputs alone moved it +0.9% on the embedded model (int4 layers, lossless there)
MIN_AGREEMENT = 0.95  # of greedy choices, where the model's own weights decide (NEAR_TIE, DECIDED)
NEAR_TIE = 0.5  # logits closer than this between the first and second choice are a tie
# ... and a first choice holding less of the probability than this is no decision either: a random-weight
# model's flat logits (its first choices held at most 0.003 at 1B-3B) still have ties wider than NEAR_TIE,
# and agreement counted there was a coin toss (3B: 0.86 or 1.0 for one format by the reference's cache dtype).
DECIDED = 0.25
MAX_DECISIONS = 32  # kept in the cache file, the most recent
# Raised when the formats timed or how they are judged change, so that earlier decisions are measured again
# (2: the vnni kernels and int8 prefill; 3: agreement only where the model decides, int8 per format, and the
# chunk attention by products).
CANDIDATES = 3
ATTENTION_POSITIONS = 1024  # context at which the cache's dtype is timed
BF16_CACHE_MARGIN = 1.05  # how much slower attention over a bf16 cache may time and the cache still be bf16
PREFILL_ROWS = 512  # the engine's prefill chunk (model.PREFILL_CHUNK)
PREFILL_MARGIN = 1.2  # bf16 prefill weights must be this much faster to be worth their rounding
PREFILL_LADDER = (512, 256, 128, 32, 8)  # chunk lengths at which dequantizing for prefill is timed against the kernels
FINALIST_MARGIN = 3.0  # candidates whose one-layer estimate is within this of the best get whole steps timed:
# the estimate reads weights from the CPU cache and misranks close formats (int8 looked 2x faster than
# int4 there, and was 1.3x slower in whole steps), but it does screen out 10-30x slower scalar paths
QUALITY_TEXT = [
    {"role": "user", "content": "Explain in a few sentences why the sky is blue, and why sunsets are red."},
    {"role": "assistant", "content": (
        "Sunlight holds every color. As it crosses the atmosphere, molecules of nitrogen and oxygen scatter "
        "short wavelengths, blue and violet, far more strongly than long ones: this is Rayleigh scattering. "
        "The scattered blue light reaches our eyes from every direction, so the whole sky looks blue. At sunset "
        "the light travels through much more air before it reaches us, most of the blue is scattered away on "
        "the way, and the reds and oranges that remain color the sky near the sun.")},
]


@dataclass(frozen=True)
class Format:
    quantize: str  # none | bf16 | int8 | int4 (llama.QUANTIZE) | file: a quantized GGUF's own blocks
    inputs: str = "fp32"  # what the int4 and int8 kernels are fed: bf16 | fp32
    kv: str = "fp32"  # the KV cache's dtype: bf16 | fp32
    # bf16 | fp32: a chunk's matrices dequantized into it | int8: products in int8, the chunk's rows and the
    # weights quantized to it (quant.DynamicInt8Weight) | kernels: the decode ones
    prefill: str = "kernels"
    prefill_from: int = 1  # chunks of at least this many rows take the prefill path; shorter ones run the kernels
    attention: str = "sdpa"  # the C++ decode step's: own (fused.attend) | sdpa
    matmul: str = "torch"  # int4 and int8 kernels: torch (PyTorch's) | vnni (csrc/gemv.cpp's, on int8 activations)
    chunk_attention: str = "sdpa"  # a chunk's, over a bf16 cache: sdpa | products (chunk_attention.attend)

    def label(self) -> str:
        prefill = "kernels" if self.prefill == "kernels" else f"{self.prefill} from {self.prefill_from} rows"
        kernels = ", vnni kernels" if self.matmul == "vnni" else ""
        chunks = ", products chunk attention" if self.chunk_attention == "products" else ""
        return (f"{self.quantize} ({self.inputs} inputs{kernels}, {self.kv} cache, {self.attention} attention{chunks}, "
                f"prefill {prefill})")

    def runner(self, config: LlamaConfig, weights: LlamaWeights, keep: bool = True,
               memo: dict | None = None) -> LlamaRunner:
        """A runner over weights in this format: packed from plain ones (given up unless ``keep``), or, for
        ``packed``, the packed weights fed this format's inputs (``packers``' memo)."""
        if self.quantize.startswith("packed"):
            pack_layer, pack_head = self.packers(memo)
            head = pack_head(weights.head)
            weights = LlamaWeights(shared_embedding(weights, head), [layer.packed(pack_layer) for layer in weights.layers],
                                   weights.final_norm, head)
        else:
            weights = pack(weights, self.quantize, DTYPES[self.inputs], keep=keep)
        if self.matmul == "vnni":
            weights = LlamaWeights(weights.embed, [layer.packed(quant.on_vnni) for layer in weights.layers],
                                   weights.final_norm, quant.on_vnni(weights.head))
        runner = LlamaRunner(config, weights, kv_dtype=DTYPES[self.kv], prefill_from=self.prefill_from,
                             prefill_dtype=None if self.prefill == "kernels" else PREFILL_DTYPES[self.prefill],
                             attention=self.attention, chunk_attention=self.chunk_attention)
        runner.format = self
        return runner

    def packers(self, memo: dict | None = None):
        """(pack a layer matrix, pack the output projection) into this format: from plain weights, or from
        weights packed while loading (fed this format's inputs, int8 ones rounded onto int4 if it says so).
        ``memo`` keeps rounded matrices for the next format that rounds the same ones (a 1B file's int8
        matrices took 1.8 s to round, for each of two candidates)."""
        inputs = DTYPES[self.inputs]
        if self.matmul == "vnni":
            pack_layer, pack_head = replace(self, matmul="torch").packers(memo)
            return (lambda w: quant.on_vnni(pack_layer(w))), (lambda w: quant.on_vnni(pack_head(w)))
        if not self.quantize.startswith("packed"):
            pack_layer, pack_head = packers(self.quantize, inputs)
            return pack_layer or (lambda w: w), pack_head or (lambda w: w)

        def as_loaded(w):
            return quant.fed(w, inputs)

        def narrowed(w):
            if memo is None:
                return quant.narrowed(w, inputs)
            key = (id(w), inputs)  # the weights outlive the memo: ids stay theirs
            if key not in memo:
                memo[key] = quant.narrowed(w, inputs)
            return memo[key]

        return (as_loaded if self.quantize == "packed" else narrowed), (narrowed if self.quantize == "packed-int4-head" else as_loaded)


@dataclass
class Choice:
    format: Format
    step_ms: dict[str, float] = field(default_factory=dict)  # finalists' labels -> ms per whole decode step
    estimate_ms: dict[str, float] = field(default_factory=dict)  # every candidate -> one layer's matmuls x layers
    quality: dict[str, float] = field(default_factory=dict)  # perplexity_rise, agreement of the kept format
    cached: bool = False


class NoFormat(Exception):
    """No candidate runs on this CPU for the requested --quantize; the message is one line."""


def candidates(requested: str, int4_fits: bool, int8_layers: bool = False, int8_head: bool = False,
               vnni: bool = False) -> list[Format]:
    """Formats to time for --quantize requested (auto: all; packed: weights packed while loading), before the
    cache's dtype is picked. Packed weights holding int8 matrices (a GGUF's 5-, 6- and 8-bit blocks) may also
    be rounded onto int4, fewer bytes a step, where the quality gate lets them. ``vnni``: the int4 and int8
    formats also through csrc/gemv.cpp's kernels, whose int8 activations only a quality gate may allow."""
    if requested == "packed":
        found = [Format("packed", inputs="bf16"), Format("packed", inputs="fp32")]
        if int8_layers:
            found.append(Format("packed-int4", inputs="bf16"))
        if int8_head:
            found.append(Format("packed-int4-head", inputs="bf16"))
    else:
        found = []
        for mode in QUANTIZE if requested == "auto" else (requested,):
            if mode == "none":
                found.append(Format("none"))
            elif mode == "bf16":
                found.append(Format("bf16", inputs="bf16"))
            elif mode == "int8" or int4_fits:
                found += [Format(mode, inputs="bf16"), Format(mode, inputs="fp32")]
    if vnni:  # bf16 scales: the int4 kernel reads them as they are
        found += [replace(fmt, matmul="vnni") for fmt in found
                  if fmt.inputs == "bf16" and fmt.quantize not in ("none", "bf16")]
    return found


BATCH_S = 0.05  # a batch of calls longer than this is cut to fewer calls: slow candidates cost little to rule out


def _seconds(fn, repeats: int = 7, calls: int = 10, limit: float = math.inf) -> float:
    """Median seconds per call of fn over repeats batches, after a warm-up call and batch; or, where the
    warm-up call and a second one each take longer than ``limit``, the second's time: enough to rule fn out.
    (A first call alone may carry one-time costs: oneDNN building its kernels for the shape, buffers growing;
    one 1B start ruled int8 prefill out on it, 83 ms where it runs 47.)"""
    started = time.perf_counter()
    fn()
    once = time.perf_counter() - started
    if once > limit:
        started = time.perf_counter()
        fn()
        once = time.perf_counter() - started
        if once > limit:
            return once
    calls = max(1, min(calls, int(BATCH_S / max(once, 1e-9))))
    for _ in range(calls):
        fn()
    batches = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - started) / calls)
    return statistics.median(batches)


def time_matmuls(fmt: Format, base: LlamaRunner, bound: float = math.inf, memo: dict | None = None) -> float:
    """Seconds per token of a decode step's matmuls in fmt: one layer's matrices packed and timed, times the
    layer count, plus the output projection. Timing stops once the estimate passes ``bound`` (a candidate
    already ruled out: the fp32-input int4 path is a scalar loop, 40x slower, and took seconds to time in
    full at 1B), returning what it reached. Raises RuntimeError where a kernel does not run on this CPU."""
    pack_layer, pack_head = fmt.packers(memo)
    layers, total = len(base.layers), 0.0
    for matrix in base.layers[0].matrices():
        weight = pack_layer(matrix)
        x = torch.randn(1, quant.shape(matrix)[1]).to(quant.input_dtype(weight))
        total += _seconds(lambda: quant.linear(x, weight), limit=bound / layers)
        if total * layers > bound:
            return total * layers
    head = pack_head(base.head)
    x = torch.randn(1, base.hidden).to(quant.input_dtype(head))
    return total * layers + _seconds(lambda: quant.linear(x, head), repeats=5, calls=3)


def time_attention(base: LlamaRunner, dtype: torch.dtype, rows: int) -> float:
    """Seconds per layer of attention for rows new queries over ATTENTION_POSITIONS cached ones, each layer
    with a cache of its own as in a real step (so that, as there, they stream from memory)."""
    groups, layers = base.heads // base.kv_heads, len(base.layers)
    q = torch.randn(1, base.kv_heads, groups * rows, base.head_dim).to(dtype)
    kv = torch.randn(layers, 2, 1, base.kv_heads, ATTENTION_POSITIONS, base.head_dim).to(dtype)
    mask = torch.ones(groups * rows, ATTENTION_POSITIONS, dtype=torch.bool) if rows > 1 else None

    def every_layer():
        for layer in kv:
            F.scaled_dot_product_attention(q, layer[0], layer[1], attn_mask=mask)

    return _seconds(every_layer, repeats=3, calls=2) / layers


def own_attention_pays(base: LlamaRunner, dtype: torch.dtype) -> tuple[bool, dict[str, float]]:
    """Whether the C++ step's own attention (``fused.attend``) beats SDPA for one row over
    ATTENTION_POSITIONS cached ones in a cache of dtype; both give a verify's rows a step's bits."""
    if not fused.attends(base.head_dim):
        return False, {}
    layers = len(base.layers)
    q = torch.randn(1, base.heads, base.head_dim)
    kv = torch.randn(layers, 2, ATTENTION_POSITIONS, base.kv_heads, base.head_dim).to(dtype)

    def every_layer():
        for layer in kv:
            fused.attend(q, layer[0], layer[1], ATTENTION_POSITIONS - 1, base.scale)

    ms = {"own": 1000 * _seconds(every_layer, repeats=3, calls=2) / layers, "sdpa": 1000 * time_attention(base, dtype, 1)}
    return ms["own"] < ms["sdpa"], ms


def chunk_attention_pays(base: LlamaRunner) -> tuple[bool, dict[str, float]]:
    """Whether ``chunk_attention.attend`` beats SDPA on a PREFILL_ROWS-row chunk ending at ATTENTION_POSITIONS
    over a bf16 cache (one layer's: a chunk is bound by arithmetic, not by the cache's bytes)."""
    if not chunk_attention.runs(torch.bfloat16, base.device):
        return False, {}
    rows, start = PREFILL_ROWS, ATTENTION_POSITIONS - PREFILL_ROWS
    keys, values = torch.randn(2, ATTENTION_POSITIONS, base.kv_heads, base.head_dim).to(torch.bfloat16)
    q = torch.randn(rows, base.heads, base.head_dim).to(torch.bfloat16)
    mask = causal_mask(start, rows, base.heads // base.kv_heads, base.device)
    ms = {"products": 1000 * _seconds(lambda: chunk_attention.attend(q, keys, values, start, base.scale), 3, 1),
          "sdpa": 1000 * _seconds(lambda: sdpa_attend(q, keys, values, start, base.scale, mask), 3, 1)}
    return ms["products"] < ms["sdpa"], ms


def bf16_cache_pays(base: LlamaRunner) -> tuple[bool, dict[str, float]]:
    """A bf16 cache halves the bytes attention reads and the cache's memory, but where bf16 arithmetic is
    emulated it can cost more than it saves; prefill shares the cache. Kept unless a decode step or a chunk
    takes BF16_CACHE_MARGIN longer with it (at 1B the two decode timings were 0.218 and 0.215 ms: a tie the
    noise decided, and with it the chunk attention, which only a bf16 cache has)."""
    ms = {f"{kind} {name}": 1000 * time_attention(base, dtype, rows)
          for kind, rows in (("decode", 1), ("prefill", 64)) for name, dtype in DTYPES.items()}
    return (ms["decode bf16"] <= BF16_CACHE_MARGIN * ms["decode fp32"]
            and ms["prefill bf16"] <= BF16_CACHE_MARGIN * ms["prefill fp32"]), ms


def prefill_policy(runner: LlamaRunner, int8: bool = True) -> tuple[str, int, dict[str, float]]:
    """(prefill path, from how many rows) for runner's weights: one layer's matrices timed on PREFILL_LADDER
    rows through the decode kernels, dequantized into bf16 or fp32 (bf16 must win by PREFILL_MARGIN: 4.3-4.7x
    faster than fp32 with AVX-512 BF16, slower where bf16 is emulated) and, where ``int8`` (its rounding of the
    activations only a quality gate may allow), multiplied in int8 (it must beat the better of those by
    PREFILL_MARGIN: ~2x faster than bf16 on a 1B model's layer with AVX-512 VNNI). Dequantizing wins on long
    chunks, the kernels on short ones; the shortest length from which the kept path keeps winning is kept."""
    matrices = runner.layers[0].matrices()
    ms: dict[str, float] = {}
    scratch: dict = {}  # as a prefill reuses its buffers (LlamaRunner.scratch)

    def timed(rows: int, dtype: torch.dtype | None, limit: float = math.inf) -> float:
        """ms for the layer's matrices on rows, or, once past limit ms, what it took so far."""
        total = 0.0
        for role, matrix in enumerate(matrices):
            x = torch.randn(rows, quant.shape(matrix)[1])

            def run():
                return quant.linear(x, matrix if dtype is None else as_plain(matrix, dtype, scratch, str(role)))
            total += 1000 * _seconds(run, repeats=2 if rows >= 256 else 3, calls=2, limit=(limit - total) / 1000)
            if total > limit:
                break
        return total

    longest = PREFILL_LADDER[0]
    ms[f"kernels {longest}"] = timed(longest, None)
    dtypes = {}
    for name, dtype in DTYPES.items():
        if any(quant.dequantize(m, dtype, torch.zeros(1, dtype=torch.long)) is None for m in matrices):
            return "kernels", 1, ms  # a layout only its kernel reads (oneDNN's bf16)
        # fp32 only has to lose to bf16 by PREFILL_MARGIN to be out; timing stops there.
        limit = dtypes["bf16"] * PREFILL_MARGIN if "bf16" in dtypes else math.inf
        try:
            ms[f"{name} {longest}"] = dtypes[name] = timed(longest, dtype, limit)
        except RuntimeError as exc:  # no bf16 matmul in this CPU's build
            log.info("%s prefill matmuls do not run here: %s", name, str(exc).splitlines()[0])
    best = "bf16" if "bf16" in dtypes and dtypes["bf16"] * PREFILL_MARGIN < dtypes["fp32"] else "fp32"
    if int8 and all(quant.dynamic_int8(m, torch.empty(0, dtype=torch.uint8)) is not None for m in matrices):
        try:  # int8 only has to lose to the float path by PREFILL_MARGIN to be out
            ms[f"int8 {longest}"] = dtypes["int8"] = timed(longest, torch.int8, dtypes[best] / PREFILL_MARGIN)
            if dtypes["int8"] * PREFILL_MARGIN < dtypes[best]:
                best = "int8"
        except RuntimeError as exc:  # an int8 product this CPU's build lacks
            log.info("int8 prefill matmuls do not run here: %s", str(exc).splitlines()[0])
    if dtypes[best] >= ms[f"kernels {longest}"]:
        return "kernels", 1, ms
    start = longest
    for rows in PREFILL_LADDER[1:]:
        ms[f"kernels {rows}"] = timed(rows, None)
        ms[f"{best} {rows}"] = timed(rows, PREFILL_DTYPES[best], limit=ms[f"kernels {rows}"])
        if ms[f"{best} {rows}"] >= ms[f"kernels {rows}"]:
            break
        start = rows
    return best, start, ms


def quality_reference(base: LlamaRunner, runners: dict, steps: dict, ids: list[int]) -> torch.Tensor:
    """What candidates are checked against: the model's own weights (plain ones, ``base``); for weights packed
    while loading (a quantized GGUF's blocks), those blocks as they are, through the fastest of their timed
    PyTorch kernels (bf16 or fp32 activations): what auto checks is what it would change beyond the file (int8
    blocks rounded onto int4, activations rounded to int8 for gemv.cpp's kernels), and an fp32 forward of a 1B
    file took 3.9 s of a first start (the packed path against that fp32 reference is bench/decode_speed.py's
    quality figure)."""
    if not any(isinstance(m, quant.Int4Weight | quant.Int8Weight) for m in base.layers[0].matrices()):
        return base.score(ids, "exact")
    as_loaded = [fmt for fmt in steps if fmt.quantize == "packed" and fmt.matmul == "torch"]  # activations as they are
    if not as_loaded:
        return Format("packed", inputs="bf16").runner(base.config, base.weights).score(ids, "decode")
    return runners[min(as_loaded, key=steps.get)].score(ids, "decode")


def check_quality(runner: LlamaRunner, ids: list[int], own: torch.Tensor) -> dict[str, float]:
    """runner's prefill and decode paths against the model's own logits on ids (``reference``): the worse
    perplexity rise of the two, and the worse agreement of greedy choices at the positions where the model's
    own logits decide (not near a tie, and the first choice holds DECIDED of the probability: random-weight
    models have none, and perplexity alone judges them). The prefill path is scored as a chunk of
    prefill_from rows or more computes it, whatever the length of ids (the quality text is ~130 tokens, a
    prefill_from 256 or more); without one (prefill on the decode kernels) both paths are one computation,
    scored once."""
    targets = torch.tensor(ids[1:], device=own.device)
    top2 = own.topk(2, dim=-1).values
    first = own.float().softmax(-1).amax(-1)
    decided = ((top2[:, 0] - top2[:, 1]) >= NEAR_TIE) & (first >= DECIDED)
    rises, agreements = [], []
    for mode in ("prefill", "decode") if runner.prefill_dtype is not None else ("decode",):
        logits = prefill_scores(runner, ids) if mode == "prefill" else runner.score(ids, mode)
        rises.append(math.exp(float(F.cross_entropy(logits[:-1], targets) - F.cross_entropy(own[:-1], targets))) - 1)
        same = logits.argmax(-1) == own.argmax(-1)
        agreements.append(float(same[decided].float().mean()) if decided.any() else 1.0)
    return {"perplexity_rise": max(rises), "agreement": min(agreements), "positions": float(decided.sum())}


def prefill_scores(runner: LlamaRunner, ids: list[int]) -> torch.Tensor:
    """runner.score(ids, "prefill") through the prefill path however few ids there are."""
    prefill_from, runner.prefill_from = runner.prefill_from, 1
    try:
        return runner.score(ids, "prefill")
    finally:
        runner.prefill_from = prefill_from


def passes(quality: dict[str, float]) -> bool:
    return quality["perplexity_rise"] <= MAX_PERPLEXITY_RISE and quality["agreement"] >= MIN_AGREEMENT


def depends_on(requested: str, checkpoint: str) -> dict:
    """What the decision depends on: CPU, checkpoint, torch, threads, the requested mode, and which candidates
    this version of tornchat times (``CANDIDATES``)."""
    return {"cpu": cpu.model_name(), "flags": sorted(cpu.flags()), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "checkpoint": checkpoint, "requested": requested,
            "candidates": CANDIDATES}


def cache_key(requested: str, checkpoint: str) -> str:
    return hashlib.sha256(json.dumps(depends_on(requested, checkpoint)).encode()).hexdigest()[:24]


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def time_steps(runner: LlamaRunner, ids: list[int], steps: int = 24) -> float:
    """Median seconds of a real decode step: weights streamed from memory, every op included."""
    cache = runner.new_cache()
    runner.forward(ids[:8], cache)
    times = []
    for token in ids[8 : 8 + steps]:
        started = time.perf_counter()
        float(runner.forward([token], cache, decode=True)[0])  # read on the host, as the sampled id is
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def choose(config: LlamaConfig, weights: LlamaWeights, requested: str, quality_ids: list[int], cache_file,
           checkpoint: str, gate: bool | None = None) -> tuple[LlamaRunner, Choice]:
    """The runner for --quantize requested (auto, a mode, or packed: weights packed while loading) on a CPU,
    and why it was chosen: an earlier start's decision (``recall``), else ``measure``'s, all at once.
    ``weights``: plain ones (packed into the format, and to be given up by the caller afterwards) or, for
    ``packed``, the packed ones. ``gate``: check quality (default: for auto)."""
    known = recall(cache_file, cache_key(requested, checkpoint))
    if known:
        choice = recalled_choice(known)
        log.info("decode weights %s: measured on an earlier start (%s)", choice.format.label(), cache_file)
        return choice.format.runner(config, weights, keep=False), choice
    return finish(measure(config, weights, requested, quality_ids, cache_file, checkpoint, gate))


def recalled_choice(known: dict) -> Choice:
    """An earlier start's decision (``recall``) as a Choice."""
    return Choice(Format(**known["format"]), known["step_ms"], known["estimate_ms"], known["quality"], cached=True)


def finish(steps: Generator):
    """Run a generator of slices (``measure``) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def provisional(config: LlamaConfig, weights: LlamaWeights, requested: str, inputs: str | None = None) -> LlamaRunner:
    """What to serve with while ``measure`` (a first start) or ``recalled`` runs: the weights as the mode has
    them without rounding anything (auto: the model's own; packed: as loaded; a mode: packed into it), fed
    ``inputs``, or where that is not known yet whichever input dtype one layer's matmuls run faster with here
    (10-28x apart, and which one depends on the CPU); the cache, attention and prefill as a runner has them
    by default."""
    base = LlamaRunner(config, weights)
    if requested == "auto":
        return base
    if inputs is not None:
        log.info("serving with %s while an earlier start's format is built", Format(requested, inputs=inputs).label())
        return Format(requested, inputs=inputs).runner(config, weights)
    int4_fits = all(quant.supports(m, 32) for m in base.layers[0].matrices() if isinstance(m, torch.Tensor))
    estimates = {}
    for fmt in candidates(requested, int4_fits):
        try:
            estimates[fmt] = time_matmuls(fmt, base, FINALIST_MARGIN * min(estimates.values(), default=math.inf))
        except RuntimeError as exc:
            log.info("decode weights %s do not run here: %s", fmt.label(), str(exc).splitlines()[0])
    if not estimates:
        raise NoFormat(f"--quantize {requested}: none of its kernels runs on this CPU ({cpu.model_name()})")
    fmt = min(estimates, key=estimates.get)
    log.info("serving with %s while the formats are measured", fmt.label())
    return fmt.runner(config, weights)


def rebuilds(known: dict) -> bool:
    """Whether an earlier start's decision takes work beyond the weights as loaded: rounding a file's int8
    matrices onto int4 (1.0 s at 1B, 4 s at 3B) or packing plain weights."""
    return Format(**known["format"]).quantize not in ("none", "packed")


def recalled(config: LlamaConfig, weights: LlamaWeights, known: dict) -> Generator[None, None, tuple[LlamaRunner, Choice]]:
    """An earlier start's decision built as one slice for the engine (as ``measure``'s are), so that a later
    start that ``rebuilds`` serves from ``provisional`` meanwhile. The weights are kept: the provisional
    runner reads them until the switch."""
    yield
    choice = recalled_choice(known)
    log.info("decode weights %s: measured on an earlier start, built", choice.format.label())
    return choice.format.runner(config, weights), choice


def measure(config: LlamaConfig, weights: LlamaWeights, requested: str, quality_ids: list[int], cache_file,
            checkpoint: str, gate: bool | None = None) -> Generator[None, None, tuple[LlamaRunner, Choice]]:
    """``choose``'s measurement, in slices: a generator that yields between timings (each a second or so) and
    returns (runner, choice), the decision remembered in cache_file. The engine runs it a slice at a time
    while no request waits (serving meanwhile with ``provisional``), or ``finish`` runs it at once.

    Two rounds of timing: each candidate's matmuls for one layer (cheap, but
    the weights sit in the CPU's cache), then whole decode steps of the
    candidates within FINALIST_MARGIN of the best, packed for real. The
    cache's dtype, the decode step's attention and, over a bf16 cache, a
    chunk's attention are timed on their own and go with every packed format; the
    prefill policy is timed for the format kept. An explicit mode still has
    its kernels' input dtype, the cache's dtype and the prefill timed, and
    no quality check (the user asked for it). The quality reference is the
    model's own weights, or the packed ones as loaded (``quality_reference``).
    """
    key = cache_key(requested, checkpoint)
    started = time.perf_counter()
    base = LlamaRunner(config, weights)  # the shapes to time, and for plain weights the quality reference
    int4_fits = all(quant.supports(m, 32) for m in base.layers[0].matrices() if isinstance(m, torch.Tensor))
    int8_layers = any(isinstance(m, quant.Int8Weight) for layer in base.layers for m in layer.matrices())
    bf16_cache, attention_ms = bf16_cache_pays(base)
    yield
    own_attention, own_ms = own_attention_pays(base, torch.bfloat16 if bf16_cache else torch.float32)
    yield
    attention_ms.update({f"decode {name}, {'bf16' if bf16_cache else 'fp32'} cache": v for name, v in own_ms.items()})
    products, chunk_ms = chunk_attention_pays(base) if bf16_cache else (False, {})
    attention_ms.update({f"chunk of {PREFILL_ROWS} {name}": v for name, v in chunk_ms.items()})
    yield
    estimates, memo = {}, {}
    gated = requested == "auto" if gate is None else gate
    found = candidates(requested, int4_fits, int8_layers, isinstance(base.head, quant.Int8Weight),
                       vnni=gated and quant.vnni_runs())
    for fmt in found:
        if fmt.quantize != "none":  # none stays the model's own weights throughout: the reference
            fmt = replace(fmt, kv="bf16" if bf16_cache else "fp32", attention="own" if own_attention else "sdpa",
                          chunk_attention="products" if products else "sdpa")
        try:
            estimates[fmt] = time_matmuls(fmt, base, FINALIST_MARGIN * min(estimates.values(), default=math.inf), memo)
        except RuntimeError as exc:  # a kernel this CPU's build lacks
            log.info("decode weights %s do not run here: %s", fmt.label(), str(exc).splitlines()[0])
        yield
    if not estimates:
        raise NoFormat(f"--quantize {requested}: none of its kernels runs on this CPU ({cpu.model_name()})")

    def build(fmt: Format) -> LlamaRunner:
        return base if fmt == Format("none") else fmt.runner(config, weights, memo=memo)

    best = min(estimates.values())
    runners, steps = {}, {}
    for fmt in [fmt for fmt, s in estimates.items() if s <= FINALIST_MARGIN * best]:
        runners[fmt] = build(fmt)
        steps[fmt] = time_steps(runners[fmt], quality_ids)
        yield
    step_ms = {fmt.label(): round(1000 * s, 3) for fmt, s in steps.items()}
    estimate_ms = {fmt.label(): round(1000 * s, 3) for fmt, s in estimates.items()}
    log.info("decode step, ms: %s; estimates from one layer's matmuls, ms: %s; attention at %d positions, ms per "
             "layer: %s", step_ms, estimate_ms, ATTENTION_POSITIONS, {k: round(v, 3) for k, v in attention_ms.items()})
    ranked = sorted(steps, key=steps.get) + sorted(set(estimates) - set(steps), key=estimates.get)
    reference = policy = float_policy = None
    for fmt in ranked:
        runner = runners.get(fmt) or build(fmt)
        if policy is None or not fmt.quantize.startswith("packed"):
            # Packed candidates differ in a few matrices' kernels only: the first one's policy serves them all
            # (timing it takes seconds on 1B-class layers). int8 products round the activations: they are a
            # candidate only where the quality gate checks them.
            policy, float_policy = prefill_policy(runner, int8=gated), None
            log.info("prefill of %s, ms for one layer's matmuls by rows: %s", fmt.label(),
                     {k: round(v, 3) for k, v in policy[2].items()})
            yield
        fmt = with_prefill(runner, fmt, policy)
        quality = {}
        if gated and fmt != Format("none"):
            if reference is None:
                reference = quality_reference(base, runners, steps, quality_ids)
                yield
            quality = check_quality(runner, quality_ids, reference)
            yield
            if fmt.prefill == "int8" and not passes(quality):
                # The int8 activations may be what failed: this format gets its float prefill and the gate
                # again; the next one is still offered int8 (its weights may round less).
                log.info("int8 prefill of %s rejected: %s", fmt.label(), quality)
                if float_policy is None:
                    float_policy = prefill_policy(runner, int8=False)
                    yield
                fmt = with_prefill(runner, fmt, float_policy)
                quality = check_quality(runner, quality_ids, reference)
                yield
        if quality and not passes(quality):
            log.info("decode weights %s rejected: %s", fmt.label(), quality)
            continue
        choice = Choice(fmt, step_ms, estimate_ms, quality)
        log.info("decode weights %s chosen in %.1f s (quality %s)", fmt.label(), time.perf_counter() - started, quality)
        remember(cache_file, key, {"format": asdict(fmt), "step_ms": step_ms, "estimate_ms": estimate_ms,
                                   "quality": quality, "for": depends_on(requested, checkpoint)})
        return runner, choice
    raise NoFormat(f"--quantize {requested}: no format keeps the model's quality on this CPU ({cpu.model_name()})")


def with_prefill(runner: LlamaRunner, fmt: Format, policy: tuple[str, int, dict]) -> Format:
    """fmt with prefill_policy's (path, from rows), set on runner as well."""
    prefill, prefill_from, _ = policy
    runner.prefill_dtype = None if prefill == "kernels" else PREFILL_DTYPES[prefill]
    runner.prefill_from, runner.format = prefill_from, replace(fmt, prefill=prefill, prefill_from=prefill_from)
    return runner.format


def choose_on_gpu(config: LlamaConfig, weights: LlamaWeights, requested: str, quality_ids: list[int]) -> LlamaRunner:
    """The runner for --quantize on CUDA: the weights as loaded (``none``), tinygemm int4 (``int4``), or for
    ``auto`` whichever of the two decodes faster here, int4 only where its quality holds against the loaded
    weights (the same gate as on a CPU). A GPU times a step in milliseconds, so nothing is cached."""
    if requested == "none":
        return LlamaRunner(config, weights)
    if requested not in ("int4", "auto"):
        raise NoFormat(f"--quantize {requested}: on a GPU the formats are none, int4 and auto")
    int4 = pack(weights, "int4", group_size=quant.CUDA_GROUP, keep=requested == "auto")
    if requested == "int4":
        return LlamaRunner(config, int4)
    plain, packed = LlamaRunner(config, weights), LlamaRunner(config, int4)
    step_ms = {"none": 1000 * time_steps(plain, quality_ids), "int4": 1000 * time_steps(packed, quality_ids)}
    quality = check_quality(packed, quality_ids, plain.score(quality_ids, "exact"))
    keep = packed if step_ms["int4"] < step_ms["none"] and passes(quality) else plain
    log.info("GPU decode step: %s; int4 quality %s; kept %s", {k: round(v, 3) for k, v in step_ms.items()},
             {k: round(v, 4) for k, v in quality.items()}, keep.label())
    return keep


def recall(cache_file, key: str) -> dict | None:
    """A decision remembered under key (``cache_key``), or None."""
    return _read(cache_file).get(key)


def remember(cache_file, key: str, entry: dict) -> None:
    """Keep entry under key, newest last, dropping the oldest beyond MAX_DECISIONS."""
    decisions = _read(cache_file)
    decisions.pop(key, None)
    decisions[key] = entry
    for stale in list(decisions)[:-MAX_DECISIONS]:  # oldest first: test runs leave a checkpoint each
        del decisions[stale]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_file.with_name(cache_file.name + ".partial")
    partial.write_text(json.dumps(decisions, indent=1))
    partial.replace(cache_file)
