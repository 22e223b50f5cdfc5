"""Sampling and stop-check kernels (installed as ``tornchat.kernels``).

Each kernel has a PyTorch reference that defines its semantics. ``sample``
dispatches: Triton for CUDA tensors, the reference elsewhere.
"""
from tornchat.kernels.sampling import GREEDY_TEMPERATURE, sample, sample_reference

__all__ = ["GREEDY_TEMPERATURE", "sample", "sample_reference"]
