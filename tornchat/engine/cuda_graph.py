"""One-token decode steps on CUDA, captured once as a CUDA graph and replayed.

At batch 1 a decode step reads every weight once, so its limit is memory
bandwidth; but an eager step launches ~15 kernels per layer, each costing
the CPU a few microseconds, and for all but the largest models the GPU
waits on those launches. A captured step replays them with one launch.

A graph records addresses, so whatever a step reads or writes stays put:
the token and its position are device tensors, filled before each replay;
the KV cache is the slot's own tensor (one graph per cache tensor: a cache
that grows is a new tensor, captured anew; ``LlamaRunner`` grows CUDA
caches by doubling so that happens a few times per conversation); and
attention runs over the cache's whole capacity, masking the positions
after the token's, so the graph does not depend on the length.
"""
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tornchat.engine import fused, quant


def step(runner, token: torch.Tensor, position: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The lean forward of one token (``LlamaRunner._layers`` for n = 1) with no host value in it: token
    and position are int64 [1] device tensors, kv the cache [layers, 2, capacity, kv_heads, head_dim]
    the token's key and value are written into. Returns fp32 logits [1, V]."""
    heads, kv_heads, head_dim = runner.heads, runner.kv_heads, runner.head_dim
    x = quant.dequantize(runner.weights.embed, runner.dtype, token)
    freqs = runner.rope.index_select(0, position)
    visible = (torch.arange(kv.shape[2], device=kv.device) <= position)[None, None, None, :]
    for i, layer in enumerate(runner.layers):
        h = fused.rms_norm_ref(x, layer.attn_norm, runner.eps, quant.input_dtype(layer.wqkv) == torch.bfloat16)
        qkv = quant.linear(h, layer.wqkv)
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv
        rotated = fused.rope_ref(qkv, freqs, heads, kv_heads, head_dim, layer.qk_norm, runner.eps)
        keys, values = kv[i].unbind()
        keys.index_copy_(0, position, rotated[:, heads:].to(kv.dtype))
        values.index_copy_(0, position, qkv[:, (heads + kv_heads) * head_dim :].reshape(1, kv_heads, head_dim).to(kv.dtype))
        q = rotated[:, :heads].to(kv.dtype).reshape(1, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, keys[None].transpose(1, 2), values[None].transpose(1, 2),
                                             attn_mask=visible, scale=runner.scale)
        x = x + quant.linear(out.reshape(1, heads * head_dim), layer.wo)
        h = fused.rms_norm_ref(x, layer.ffn_norm, runner.eps, quant.input_dtype(layer.w13) == torch.bfloat16)
        x = x + quant.linear(fused.silu_mul_ref(quant.linear(h, layer.w13)), layer.w2)
    return runner._logits(x)


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    kv: weakref.ref  # the cache tensor the graph reads and writes
    logits: torch.Tensor  # where each replay leaves its logits


class GraphedSteps:
    """``step`` replayed from a graph per cache tensor.

    All of a runner's graphs are captured on one stream of its own, warmed
    (a run outside the capture) before each capture. PyTorch keys cuBLAS
    workspaces by stream, hands every graph captured on a stream that
    stream's workspace, and frees it when any one of those graphs is
    destroyed (pytorch/pytorch#193402): the others then write into memory
    that is no longer theirs: a runner's graphs destroyed
    while another runner decoded on the shared default capture stream
    turned its output to noise. So graphs are dropped all together, when
    one of their caches is gone, and the live ones are captured again on
    next use; and runners do not share a stream. Each graph keeps its own
    memory pool: a batch-1 step's intermediates are small, and a pool shared
    by handle cannot be captured into again once its graphs are gone.
    """

    def __init__(self, runner, step_fn=step):
        self.runner, self.step_fn = runner, step_fn  # step_fn: ``step``, or ``step`` compiled (bench/gpu.py)
        self.token = torch.zeros(1, dtype=torch.int64, device=runner.device)
        self.position = torch.zeros(1, dtype=torch.int64, device=runner.device)
        self.stream = torch.cuda.Stream(runner.device)
        self.captured: dict[int, _Captured] = {}  # by the cache tensor's address
        self.captures = 0

    def __call__(self, token: int, kv: torch.Tensor, position: int) -> torch.Tensor:
        """fp32 logits [V] of ``token`` at ``position``, its key and value written into kv."""
        self.token.fill_(token)  # on the stream, no host sync
        self.position.fill_(position)
        captured = self.captured.get(kv.data_ptr())
        if captured is None or captured.kv() is not kv:
            captured = None  # not a reference to a stale graph: it must be gone before the capture
            captured = self._capture(kv)
        captured.graph.replay()
        return captured.logits[0].clone()  # the next replay overwrites the buffer

    def _capture(self, kv: torch.Tensor) -> _Captured:
        if any(c.kv() is None for c in self.captured.values()):
            self.captured.clear()  # all together (see the class docstring)
        # The warm-up run writes the very key and value the replay will: it changes nothing.
        self.stream.wait_stream(torch.cuda.current_stream(kv.device))
        with torch.cuda.stream(self.stream), torch.inference_mode():
            self.step_fn(self.runner, self.token, self.position, kv)
        torch.cuda.current_stream(kv.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream), torch.inference_mode():
            logits = self.step_fn(self.runner, self.token, self.position, kv)
        captured = _Captured(graph, weakref.ref(kv), logits)
        self.captured[kv.data_ptr()] = captured
        self.captures += 1
        return captured
