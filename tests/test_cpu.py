"""CPU probes: what benchmark tables and the start-up log name, on CPUs other than this one too."""
import torch

from tornchat.engine import cpu

ZEN3 = {"model name": "AMD EPYC 7B13", "flags": "fpu sse2 avx avx2 fma f16c bmi2"}
SAPPHIRE_RAPIDS = {"model name": "Intel(R) Xeon(R) Platinum 8481C",
                   "flags": "avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile"}
GRAVITON = {"CPU implementer": "0x41", "Features": "fp asimd aes crc32 atomics bf16 i8mm sve"}


def test_describe_names_the_cpu_and_the_flags_that_decide_kernels(monkeypatch):
    for info, present, absent in ((ZEN3, ["avx2", "fma"], ["avx512f", "amx_tile"]),
                                  (SAPPHIRE_RAPIDS, ["avx512_bf16", "amx_bf16", "avx512_vnni"], ["asimd"]),
                                  (GRAVITON, ["asimd", "sve", "bf16", "i8mm"], ["avx2"])):
        monkeypatch.setattr(cpu, "_cpuinfo", lambda info=info: info)
        line = cpu.describe()
        assert line.startswith(info.get("model name", cpu.model_name()))
        assert all(f" {flag}" in line for flag in present) and not any(f" {flag} " in line for flag in absent)
        assert f"torch {torch.__version__}" in line


def test_arm_cores_are_named_from_their_part_numbers(monkeypatch):
    # Linux on arm64 prints no model name: lscpu names the core from these numbers, and so does describe()
    for info, name in (({"CPU implementer": "0x41", "CPU part": "0xd0c"}, "Arm Neoverse-N1"),
                       ({"CPU implementer": "0xc0", "CPU part": "0xac3"}, "Ampere Ampere-1"),
                       ({"CPU implementer": "0x41", "CPU part": "0xfff"}, "Arm part 0xfff"),
                       ({"CPU implementer": "0x61", "CPU part": "0x022"}, "implementer 0x61 part 0x022")):
        monkeypatch.setattr(cpu, "_cpuinfo", lambda info=info: info)
        assert cpu.model_name() == name and cpu.describe().startswith(name)


def test_a_machine_without_proc_cpuinfo_still_gets_a_name(monkeypatch):
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: {})
    assert cpu.model_name() and cpu.flags() == frozenset() and "no notable flags" in cpu.describe()


def test_this_machine(capsys):
    line = cpu.describe()
    with capsys.disabled():
        print(f"\n  running on: {line}")
    present = [flag for flag in cpu.NOTABLE_FLAGS if flag in cpu.flags()]
    assert line.startswith(cpu.model_name()) and all(f" {flag}" in line for flag in present)
    assert f"ATen capability {torch.backends.cpu.get_cpu_capability()}" in line
