"""Decode steps on CUDA, captured as CUDA graphs and replayed: one row, the rows of a verify, or one row of each of
several generations; and a lone row's step that chooses its token too.

At batch 1 a decode step reads every weight once, so its limit is memory
bandwidth; but an eager step launches tens of kernels per layer, each
costing the CPU a few microseconds, and for all but the largest models the
GPU waits on those launches. A captured step replays them with one launch,
and its small operations are Triton kernels of our own (``step_ops``), so
that a layer is ten kernels rather than ~38 back to back.

Several rows share one step, which reads every weight once for all of
them: a verify's (a generation's next token and its drafts), and those of
generations decoding together. Its matrix products run on 2, 4 or 8 rows
(padding the rest); each cache's rows go through RoPE and attention in one
call of their own. With plain (bf16, fp16, fp32) weights every op of the
step computes a row by itself (``step_ops``: our product kernel, not
cuBLAS), so a row gets the same bits in any step: a verify gives what its
rows' steps would, and a generation decoding beside others what it gets
alone. tinygemm's int4 products compute a row of a many-row product with
other kernels than a lone row's: there a verify runs its rows one step
each, so that the reply is the same with speculation or without, and rows
of several generations need not get the bits they get alone
(``--parallel 1`` keeps every reply as alone).

A lone generation whose token needs nothing from the host gets a step that
also chooses the token and checks for a stop (``GraphedSteps.choose``,
``kernels/step_choice.py``): the token, its position and the reply's index
are written into the step's own inputs on the device, so the host reads
two numbers a step and copies nothing in while the same reply goes on.

A graph records addresses, so whatever a step reads or writes stays put:
the tokens and positions are device tensors, filled before each replay;
the KV caches are the rows' own tensors (one graph per combination of
them: a cache that grows is a new tensor, captured anew; ``LlamaRunner``
grows CUDA caches by doubling so that happens a few times per
conversation); and attention reads each row's position on the device and
stops there (its PyTorch reference, ``step_ops.attend_ref``, runs over the
whole capacity with the later positions masked), so the graph does not
depend on the length.
"""
import dataclasses
import gc
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

from tornchat.engine import quant, step_ops
from tornchat.engine.choose import Chosen, OnDevice
from tornchat.kernels import step_choice, stopcheck
from tornchat.kernels.dispatch import triton_module

STEP_ROWS = 8  # the most generations' rows one step takes; a step's products run on 1, 2, 4 or 8 rows
GRAPH_LIMIT = 32  # captured combinations of caches kept; past it all are dropped (see GraphedSteps) and captured anew
SEEN_LIMIT = 1024  # mixes of generations remembered as seen once

Row = tuple[int, torch.Tensor, int]  # a one-token row: the token, the cache tensor it joins, its position there


def step(runner, tokens: torch.Tensor, positions: torch.Tensor, kvs: tuple[torch.Tensor, ...],
         ops: step_ops.StepOps | None = None) -> torch.Tensor:
    """The lean forward (``LlamaRunner._layers``) of one-token rows with no host value in it: tokens and
    positions int64 [M] device tensors; kvs the caches [layers, 2, capacity, kv_heads, head_dim] of the first
    len(kvs) rows. Row r's key and value are written at positions[r] of kvs[r], and it attends over kvs[r] up
    to there; every row's key is written before any row attends, so rows of one cache see the ones before
    them. Consecutive rows of one cache go through RoPE and attention in one call. The rows past len(kvs) are
    padding: they go through the matrices (the products run on all M rows, so a step of M rows uses the same
    kernels whatever it holds) and nothing else. ``ops``: the small operations' implementations (default:
    ``step_ops.ops_for`` the tokens' device). Returns fp32 logits [M, V]."""
    ops = ops or step_ops.ops_for(tokens)
    heads, kv_heads, eps = runner.heads, runner.kv_heads, runner.eps
    rows, used = tokens.shape[0], len(kvs)
    runs = _runs(kvs)
    rope = runner.rope.whole()
    x = quant.dequantize(runner.weights.embed, runner.dtype, tokens)
    delta = None  # what the previous block adds to the residual stream x, added in the next norm's kernel
    for i, layer in enumerate(runner.layers):
        x, h = ops.add_rms_norm(x, delta, layer.attn_norm, eps, quant.input_dtype(layer.wqkv))
        qkv = ops.linear(h, layer.wqkv)
        queries = [ops.rope_store(qkv[start:end], layer.bqkv, rope, positions[start:end], *kvs[start][i].unbind(),
                                  heads, kv_heads, layer.qk_norm, eps) for start, end in runs]
        attended = [ops.attend(q, *kvs[start][i].unbind(), positions[start:end], runner.scale)
                    for q, (start, end) in zip(queries, runs)]
        if used < rows:
            attended.append(attended[0].new_zeros(rows - used, attended[0].shape[1]))
        delta = ops.linear(torch.cat(attended) if len(attended) > 1 else attended[0], layer.wo)
        x, h = ops.add_rms_norm(x, delta, layer.ffn_norm, eps, quant.input_dtype(layer.w13))
        delta = ops.linear(ops.silu_mul(ops.linear(h, layer.w13)), layer.w2)
    _, h = ops.add_rms_norm(x, delta, runner.final_norm, eps, quant.input_dtype(runner.head))
    return ops.linear(h, runner.head).float()


def _runs(kvs: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive rows of one cache."""
    starts = [r for r in range(len(kvs)) if r == 0 or kvs[r] is not kvs[r - 1]]
    return list(zip(starts, starts[1:] + [len(kvs)]))


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    kvs: tuple[weakref.ref, ...]  # the cache tensors the graph reads and writes
    output: torch.Tensor  # where each replay leaves its result: the logits, or a chosen step's (token, finished)


class GraphedSteps:
    """``step`` replayed from a graph per combination of caches, or run eagerly where no graph fits.

    A generation's own step recurs with every token and is captured at once.
    A mix of generations' rows is captured when seen a second time (it lasts
    while they all run); the first time, the same ``step`` runs eagerly,
    which gives the same bits.

    All of a runner's graphs are captured on one stream of its own, warmed
    (a run outside the capture) before each capture. PyTorch keys cuBLAS
    workspaces by stream, hands every graph captured on a stream that
    stream's workspace, and frees it when any one of those graphs is
    destroyed (pytorch/pytorch#193402): the others then write into memory
    that is no longer theirs: a runner's graphs destroyed
    while another runner decoded on the shared default capture stream
    turned its output to noise. So graphs are dropped all together, when
    one of their caches is gone or there are more than GRAPH_LIMIT, and the
    live ones are captured again on next use; and runners do not share a
    stream. Each graph keeps its own memory pool: a step's intermediates are
    small, and a pool shared by handle cannot be captured into again once
    its graphs are gone.

    No graph may be destroyed while a stream captures, in any thread: CUDA
    refuses and invalidates the capture ("operation failed due to a previous
    error during capture"). Python's cyclic collector runs at whatever
    allocation crosses its threshold, and a discarded runner held in a
    reference cycle has its graphs destroyed there; on an H200 that broke
    a capture in three of four sequences of runners. So automatic
    collection is off while a graph is captured.
    """

    def __init__(self, runner, step_fn=step, rows: int = STEP_ROWS):
        self.runner, self.step_fn = runner, step_fn  # step_fn: ``step``, or ``step`` compiled (bench/gpu.py)
        # Whether a row's bits do not depend on the rows beside it, so a verify can run in one step.
        self.rows_apart = step_fn is step and step_ops.ops_for(runner.final_norm).rows_apart(runner)
        self.sizes = [1 << i for i in range(rows.bit_length()) if 1 << i <= rows]  # rows a step's products run on
        self.inputs = {size: (torch.zeros(size, dtype=torch.int64, device=runner.device),
                              torch.zeros(size, dtype=torch.int64, device=runner.device)) for size in self.sizes}
        self.stream = torch.cuda.Stream(runner.device)
        self.captured: dict[tuple[int, ...], _Captured] = {}  # by the step's size and its caches' addresses
        self.seen: Counter = Counter()  # mixes of generations run eagerly so far
        self.captures = 0
        self.choice_buffers: _ChoiceBuffers | None = None  # a chosen step's (``choose``), made at its first
        self.loaded: tuple[OnDevice, int] | None = None  # the reply and length a chosen step's buffers are set for

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        """fp32 logits [len(rows), V], each row's key and value written into its cache: up to ``STEP_ROWS`` a
        step, except a verify's rows (of one cache) where a row's bits depend on the rows beside it: one a
        step."""
        alone = not self.rows_apart and len({kv.data_ptr() for _, kv, _ in rows}) == 1
        most = 1 if alone else self.sizes[-1]
        return torch.cat([self._step(rows[at : at + most]) for at in range(0, len(rows), most)])

    def _step(self, rows: list[Row]) -> torch.Tensor:
        self.loaded = None  # the inputs are refilled below: a chosen step sets them again
        size = next(size for size in self.sizes if size >= len(rows))
        tokens, positions = self.inputs[size]
        for r, (token, _, position) in enumerate(rows):  # on the stream, no host sync
            tokens[r].fill_(token)
            positions[r].fill_(position)
        kvs = tuple(kv for _, kv, _ in rows)
        key = (size, *(kv.data_ptr() for kv in kvs))
        captured = self.captured.get(key)
        if captured is None or any(ref() is not kv for ref, kv in zip(captured.kvs, kvs)):
            captured = None  # not a reference to a stale graph: it must be gone before a capture
            if len(kvs) > 1 and self.seen[key] == 0:
                if len(self.seen) >= SEEN_LIMIT:  # mixes that never came back (drafts of changing lengths)
                    self.seen.clear()
                self.seen[key] += 1
                with torch.inference_mode():
                    return self.step_fn(self.runner, tokens, positions, kvs)[: len(rows)]
            captured = self._capture(key, kvs, lambda: self.step_fn(self.runner, tokens, positions, kvs))
        captured.graph.replay()
        return captured.output[: len(rows)].clone()  # the next replay overwrites the buffer

    def _capture(self, key: tuple, kvs: tuple[torch.Tensor, ...], run) -> _Captured:
        """A graph of ``run()`` (which returns the graph's output), warmed by one run outside the capture: a
        step's warm-up writes the very keys and values its replay will."""
        if len(self.captured) >= GRAPH_LIMIT or any(ref() is None for c in self.captured.values() for ref in c.kvs):
            self.captured.clear()  # all together (see the class docstring)
            self.seen.clear()
        device = kvs[0].device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream), torch.inference_mode():
            run()
        torch.cuda.current_stream(device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # see the class docstring: a collection now may destroy another runner's graphs
        try:
            with torch.cuda.graph(graph, stream=self.stream), torch.inference_mode():
                output = run()
        finally:
            if collecting:
                gc.enable()
        captured = _Captured(graph, tuple(weakref.ref(kv) for kv in kvs), output)
        self.captured[key] = captured
        self.captures += 1
        self.loaded = None  # the warm-up run moved what a chosen step advances
        return captured

    def choose(self, token: int, kv: torch.Tensor, position: int, choice: OnDevice) -> Chosen:
        """A one-row step (``token`` at ``position`` of the cache ``kv``) that also chooses the next token, by
        ``choice``'s sampler, and checks whether it ends the reply (``kernels/step_choice.py``), in the same
        graph: one replay and one read of two numbers. Its buffers (the token and position it feeds, the reply's
        index and last ids) advance on the device, so the next replay of the same reply needs no copy in."""
        buffers = self._choice_buffers(choice.table)
        key = ("chosen", choice.greedy, kv.data_ptr())
        captured = self.captured.get(key)
        if captured is None or captured.kvs[0]() is not kv:
            captured = None  # as in _step: a stale graph must be gone before a capture
            tokens, positions = self.inputs[1]
            self._load(token, position, choice, buffers)  # so the warm-up run writes this row's own key and value
            captured = self._capture(key, (kv,), lambda: self._chosen_step(tokens, positions, kv, choice.greedy, buffers))
        if self.loaded != (choice, len(choice.output_ids)):
            self._load(token, position, choice, buffers)
        captured.graph.replay()
        token, finished = buffers.out[0].tolist()
        self.loaded = (choice, len(choice.output_ids) + 1)  # where the replay left them: the chooser appends token
        return Chosen(token, bool(finished))

    def _chosen_step(self, tokens, positions, kv, greedy: bool, buffers: "_ChoiceBuffers") -> torch.Tensor:
        logits = self.step_fn(self.runner, tokens, positions, (kv,))
        if greedy:
            ids = step_choice.greedy(logits)
        else:
            ids = triton_module("sampling_triton").sample_at(logits, buffers.temperature, buffers.top_k, buffers.top_p,
                                                            buffers.seed, buffers.index)
        step_choice.advance(ids, tokens, positions, buffers.index, buffers.window, buffers.table, buffers.out)
        return buffers.out

    def _choice_buffers(self, table: stopcheck.StopTable) -> "_ChoiceBuffers":
        if self.choice_buffers is None or self.choice_buffers.table.final.shape != table.final.shape:
            if self.choice_buffers is not None:  # chosen graphs read the old ones: graphs go all together
                self.captured.clear()
                self.seen.clear()
            self.choice_buffers = _ChoiceBuffers.like(table, self.runner.device)
        return self.choice_buffers

    def _load(self, token: int, position: int, choice: OnDevice, buffers: "_ChoiceBuffers") -> None:
        """The buffers set for ``choice``'s reply at this step (a first step, or after other steps ran)."""
        tokens, positions = self.inputs[1]
        tokens[0].fill_(token)
        positions[0].fill_(position)
        recent = choice.output_ids[-step_choice.WINDOW :]
        window = [-1] * (step_choice.WINDOW - len(recent)) + recent
        buffers.window.copy_(torch.tensor([window], dtype=torch.int64))
        buffers.index.fill_(len(choice.output_ids))
        for buffer, value in ((buffers.temperature, choice.temperature), (buffers.top_k, choice.top_k),
                              (buffers.top_p, choice.top_p), (buffers.seed, choice.seed)):
            buffer.copy_(value)
        for buffer, value in ((buffers.table.final, choice.table.final), (buffers.table.cont, choice.table.cont),
                              (buffers.table.done, choice.table.done), (buffers.table.length, choice.table.length)):
            buffer.copy_(value)


@dataclass
class _ChoiceBuffers:
    """What a chosen step reads besides the step's own inputs, at fixed addresses: the sampler's parameters (in
    the dtypes its kernels read), the reply's token index (the sampler's key), its last ids and the stop table
    (``kernels/step_choice.py``), and where the replay leaves (token, finished)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    index: torch.Tensor
    window: torch.Tensor
    table: stopcheck.StopTable
    out: torch.Tensor

    @classmethod
    def like(cls, table: stopcheck.StopTable, device) -> "_ChoiceBuffers":
        def new(dtype, *shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        fixed = dataclasses.replace(table, final=torch.zeros_like(table.final), cont=torch.zeros_like(table.cont),
                                    done=torch.zeros_like(table.done), length=torch.zeros_like(table.length))
        return cls(new(torch.float32, 1), new(torch.int64, 1), new(torch.float32, 1), new(torch.int64, 1),
                   new(torch.int32, 1), new(torch.int64, 1, step_choice.WINDOW), fixed, new(torch.int64, 1, 2))
