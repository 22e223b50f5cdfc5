"""Lean runners over a transformers model's weights, for tests."""
import torch

from tornchat.engine import llama, quant


def lean(model, quantize: str = "none", inputs: torch.dtype = torch.bfloat16, **options) -> llama.LlamaRunner:
    """The lean forward over a transformers model's weights, packed for decode as ``quantize`` says."""
    config, weights = llama.from_transformers(model)
    return llama.LlamaRunner(config, llama.pack(weights, quantize, inputs), **options)


def exact(runner: llama.LlamaRunner) -> llama.LlamaRunner:
    """The same model over plain fp32 copies of runner's weights, as its kernels dequantize them."""
    weights = runner.weights
    plain = llama.LlamaWeights(
        embed=quant.dequantize(weights.head, torch.float32) if weights.embed is weights.head else weights.embed,
        layers=[layer.packed(lambda w: quant.dequantize(w, torch.float32)) for layer in weights.layers],
        final_norm=weights.final_norm, head=quant.dequantize(weights.head, torch.float32),
    )
    return llama.LlamaRunner(runner.config, plain)


def decode_nll(runner: llama.LlamaRunner, ids: list[int]) -> float:
    """Negative log-likelihood of ids[1:], every token fed through one-token decode steps: the weights a
    decode step reads (a perplexity comparison between formats)."""
    cache, nll = runner.new_cache(), 0.0
    for position, token in enumerate(ids[:-1]):
        logits = runner.forward([token], cache, decode=True)
        nll -= float(torch.log_softmax(logits, dim=-1)[ids[position + 1]])
    return nll
