"""Which implementation runs: Triton on CUDA tensors, the PyTorch reference elsewhere.

``TORNCHAT_TRITON_INTERPRET=1`` forces the Triton kernels onto CPU tensors
through Triton's interpreter, for debugging and for the tests. The
interpreter is chosen when ``@triton.jit`` runs, so TRITON_INTERPRET must be
in the environment before the first kernel module is imported; that is why
the kernel modules are imported here, lazily, and never at package import
(the CPU server then never pays for importing Triton).
"""
import importlib
import os
import sys

import torch


def interpret_requested() -> bool:
    return os.environ.get("TORNCHAT_TRITON_INTERPRET", "") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or interpret_requested()


def triton_module(name: str):
    """Import ``tornchat.kernels.<name>`` (a module of @triton.jit kernels), interpreted if requested."""
    if interpret_requested() and not interpreting():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "TORNCHAT_TRITON_INTERPRET=1 needs TRITON_INTERPRET=1 before triton is first imported; "
                "set it in the environment of the process"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return importlib.import_module(f"tornchat.kernels.{name}")


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"
