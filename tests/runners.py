"""Lean runners over a transformers model's weights, for tests."""
import torch

from tornchat.engine import llama, quant


def lean(model, quantize: str = "none", **options) -> llama.LlamaRunner:
    """The lean forward over a transformers model's weights, in ``quantize``'s blocks (``llama.pack``, laid out
    for the runner's ``isa`` where one is given)."""
    config, weights = llama.from_transformers(model)
    return llama.LlamaRunner(config, llama.pack(weights, quantize, keep=True, isa=options.get("isa", "")), **options)


def exact(runner: llama.LlamaRunner, **options) -> llama.LlamaRunner:
    """The same model over plain fp32 copies of runner's weights, as its blocks decode: PyTorch's matmuls on
    unrounded activations, the reference the kernels are measured against."""
    weights = runner.weights
    plain = llama.LlamaWeights(
        embed=quant.dequantize(weights.head, torch.float32) if weights.embed is weights.head else weights.embed,
        layers=[layer.packed(lambda w: quant.dequantize(w, torch.float32)) for layer in weights.layers],
        final_norm=weights.final_norm, head=quant.dequantize(weights.head, torch.float32),
    )
    return llama.LlamaRunner(runner.config, plain, **options)


def decode_nll(runner: llama.LlamaRunner, ids: list[int]) -> float:
    """Negative log-likelihood of ids[1:] from one pass over ids (``score``): compares formats' quality."""
    logits = runner.score(ids)
    return -float(torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).sum())
