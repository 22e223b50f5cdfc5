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


# Linux on arm64 prints no model name, only the core's implementer and part numbers (as lscpu's own table reads
# them): the cores tornchat's users are likely to run on, by name; any other by its numbers.
ARM_CORES = {
    "0x41": ("Arm", {"0xd03": "Cortex-A53", "0xd05": "Cortex-A55", "0xd07": "Cortex-A57", "0xd08": "Cortex-A72",
                     "0xd09": "Cortex-A73", "0xd0a": "Cortex-A75", "0xd0b": "Cortex-A76", "0xd0c": "Neoverse-N1",
                     "0xd0d": "Cortex-A77", "0xd40": "Neoverse-V1", "0xd41": "Cortex-A78", "0xd44": "Cortex-X1",
                     "0xd46": "Cortex-A510", "0xd47": "Cortex-A710", "0xd48": "Cortex-X2", "0xd49": "Neoverse-N2",
                     "0xd4f": "Neoverse-V2", "0xd80": "Cortex-A520", "0xd81": "Cortex-A720", "0xd82": "Cortex-X4",
                     "0xd84": "Neoverse-V3", "0xd8e": "Neoverse-N3"}),
    "0x48": ("HiSilicon", {"0xd01": "TaiShan-v110"}),
    "0xc0": ("Ampere", {"0xac3": "Ampere-1", "0xac4": "Ampere-1a"}),
}


def model_name() -> str:
    info = _cpuinfo()
    name = info.get("model name") or info.get("Model")
    if name:
        return name
    if "CPU implementer" in info:
        implementer, part = info["CPU implementer"], info.get("CPU part", "?")
        vendor, parts = ARM_CORES.get(implementer, (f"implementer {implementer}", {}))
        return f"{vendor} {parts.get(part, f'part {part}')}"
    return platform.processor() or platform.machine()


def flags() -> frozenset[str]:
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def describe() -> str:
    """One line naming the CPU and the flags that decide kernel speed, for logs and benchmark tables."""
    present = [flag for flag in NOTABLE_FLAGS if flag in flags()]
    return (f"{model_name()} ({platform.machine()}; {' '.join(present) or 'no notable flags'}; "
            f"torch {torch.__version__}, ATen capability {torch.backends.cpu.get_cpu_capability()})")
