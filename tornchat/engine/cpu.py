"""What this CPU is, for logs, benchmark tables and the measurements cache's key.

The machines tornchat runs on differ (AVX2 only, AVX-512, AVX-512 BF16,
AMX, ARM); the kernels pick their instruction-set path by CPUID themselves
(csrc/blocks/dispatch.cpp), so this only names the CPU and its notable flags.
"""
import functools
import platform
from pathlib import Path

import torch

# Flags worth naming next to a benchmark figure: they decide which kernels are fast.
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_tile",
                 "asimd", "asimddp", "sve", "bf16", "i8mm")


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
