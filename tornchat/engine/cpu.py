"""What this CPU is and what PyTorch's CPU kernels can do on it.

The machines tornchat runs on differ (AVX2 only, AVX-512, AVX-512 BF16,
AMX, ARM), so nothing here guesses from one flag: features a kernel needs
are probed by running that kernel once. Tests replace these functions to
exercise the choices a different CPU would make.
"""
import functools
import platform
from pathlib import Path

import torch

# Flags worth naming next to a benchmark figure: they decide which kernels are fast.
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_tile",
                 "asimd", "sve", "bf16", "i8mm")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (Linux), else {}."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def model_name() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def flags() -> frozenset[str]:
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def describe() -> str:
    """One line naming the CPU and the flags that decide kernel speed, for logs and benchmark tables."""
    present = [flag for flag in NOTABLE_FLAGS if flag in flags()]
    return (f"{model_name()} ({platform.machine()}; {' '.join(present) or 'no notable flags'}; "
            f"torch {torch.__version__}, ATen capability {torch.backends.cpu.get_cpu_capability()})")


@functools.cache
def packs_bf16() -> bool:
    """Whether oneDNN's prepacked bf16 linear runs here.

    It needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT on x86 and refuses other
    CPUs with an error at pack time, so try it on a small matrix.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 32, dtype=torch.bfloat16), 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 32, dtype=torch.bfloat16), weight, None, "none", [None], "")
    except RuntimeError:
        return False
    return bool(out.float().eq(32).all())
