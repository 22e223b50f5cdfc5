"""The C++ kernels build for 64-bit ARM too (aarch64: Graviton, Ampere, Apple silicon under Linux).

There the portable code exists (csrc/blocks/generic.cpp, vec.h's baseline loops) and the aarch64 paths
(csrc/blocks/arm.cpp: dotprod, SDOT where the CPU has the Armv8.2 dot product; neon, Advanced SIMD alone); the x86
paths sit behind their guards. A stray intrinsic or x86-only header outside them would break an ARM user's build,
and since the build is optional, pip would install tornchat without it, on the slow PyTorch references, saying
nothing. Each source is checked here for aarch64 by a cross-compiler (-fsyntax-only; two are also assembled), and
the aarch64 paths by clang too. Nothing here runs ARM code: tests/aarch64/run.sh does, under qemu-user, outside
the suite (it downloads torch's aarch64 wheel); no timing of ARM exists.

aarch64 also has a fused multiply-add in its baseline, which GCC's default fuses a product and a following sum
into wherever it sees the pair, and not alike in a loop's inlined copies (one row's call, many rows' threads):
setup.py turns that off on every architecture (NO_CONTRACTION), and the activations' quantization, compiled to
assembly here, is checked to fuse nothing (it did, in the threads' copies, before either)."""
import ast
import collections
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CROSS = "aarch64-linux-gnu-g++"
ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "tornchat" / "engine" / "csrc"


def setup_constant(name: str):
    """A constant assigned at setup.py's top level (the build's flags), read without running setup()."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == name for target in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py assigns no {name}")


def test_setup_builds_every_source():
    # A source setup.py leaves out links nowhere: the extension fails to import and tornchat falls back, silently.
    listed = (ROOT / "setup.py").read_text()
    missing = [str(s.relative_to(ROOT)) for s in CSRC.rglob("*.cpp") if s.name not in listed]
    assert not missing, f"setup.py does not build {missing}"


# Compiled to assembly rather than only checked: the activations' quantization (quantize_rows), whose rounding
# to int8 every row's product starts from; the aarch64 paths, whose guards could leave them empty, and of which
# only dotprod may hold the dot product's SDOT (the neon path runs where the CPU lacks it); and attention, whose
# baseline loops' fused multiply-adds (vec.h's fmadd) must be NEON's, four lanes an instruction, not one lane's.
ASSEMBLED = "blocks/dispatch.cpp"
ARM = "blocks/arm.cpp"
ATTENTION = "attention.cpp"
FUSED = re.compile(r"^\s*(fmadd|fmsub|fnmadd|fnmsub|fmla|fmls)\b", re.MULTILINE)


def instructions_by_path(assembly: str) -> dict[str, collections.Counter]:
    """Per aarch64 path namespace (dotprod_path, neon_path) of arm.cpp's assembly, its instructions' mnemonics."""
    by_path: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    path = None
    for line in assembly.splitlines():
        label = re.match(r"^(_Z\w+):", line)
        if label:
            path = next((p for p in ("dotprod_path", "neon_path") if p in label.group(1)), None)
        elif path and (mnemonic := re.match(r"^\s+([a-z][\w.]*)\s", line)):
            by_path[path][mnemonic.group(1)] += 1
    return by_path


def test_every_source_compiles_for_aarch64():
    compiler = shutil.which(CROSS)
    if compiler is None:
        pytest.skip(f"no {CROSS} here (apt-get install g++-aarch64-linux-gnu; .ci/run installs it)")
    from torch.utils.cpp_extension import include_paths

    # setup.py's flags; the headers are this torch's and this Python's, which declare the same there.
    flags = ["-std=c++20", "-O3", "-fopenmp", *setup_constant("NO_CONTRACTION"), "-w",
             *(f"-I{path}" for path in include_paths()), f"-I{sysconfig.get_paths()['include']}"]
    sources = sorted(CSRC.rglob("*.cpp"))
    assembled = {CSRC / ASSEMBLED, CSRC / ARM, CSRC / ATTENTION}
    assert len(sources) >= 8 and assembled <= set(sources), sources

    def compile_one(source: Path) -> subprocess.CompletedProcess:
        output = ["-S", "-o", "-"] if source in assembled else ["-fsyntax-only"]
        return subprocess.run([compiler, *flags, *output, str(source)], capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(sources, pool.map(compile_one, sources)))
    failed = {str(s.relative_to(CSRC)): r.stderr[-3000:] for s, r in results.items() if r.returncode}
    assert not failed, failed
    fused = FUSED.findall(results[CSRC / ASSEMBLED].stdout)
    assert not fused, f"{ASSEMBLED} on aarch64 fuses products into sums ({len(fused)} instructions)"
    attention = results[CSRC / ATTENTION].stdout
    assert re.search(r"^\s*fmla\s+v\d+\.4s", attention, re.MULTILINE), f"{ATTENTION}: no NEON fused multiply-add"
    lanes = re.findall(r"^\s*(?:fmadd\s+s\d+|bl\s+fmaf\b)", attention, re.MULTILINE)
    assert not lanes, f"{ATTENTION}: {len(lanes)} fused multiply-adds a lane at a time"
    paths = instructions_by_path(results[CSRC / ARM].stdout)
    assert paths["dotprod_path"]["sdot"] > 0, f"{ARM}: the dotprod path holds no SDOT (not built?)"
    assert paths["neon_path"]["smull"] + paths["neon_path"]["smull2"] > 0, f"{ARM}: the neon path is not built"
    assert paths["neon_path"]["sdot"] == 0, f"{ARM}: the neon path uses SDOT, which its CPUs lack"


@pytest.mark.parametrize("cpu", ["", "apple-m1"])
def test_the_arm_paths_build_with_clang(cpu):
    # Apple's compiler is clang, whose arm_neon.h (14 here) declares SDOT only where the build's baseline has the dot
    # product, not in a function of that target as GCC's does: with Apple silicon's baseline the dotprod path
    # builds, with Armv8.0's only the neon path does, and either way the build must not break. Nor may attention's
    # (GCC's own builtins there broke it), whose fused multiply-adds are NEON's here too.
    compiler = shutil.which("clang++")
    if compiler is None:
        pytest.skip("no clang++ here (apt-get install clang; .ci/run installs it)")
    from torch.utils.cpp_extension import include_paths

    flags = ["--target=aarch64-linux-gnu", *([f"-mcpu={cpu}"] if cpu else []), "-std=c++20", "-O2", "-w",
             *(f"-I{path}" for path in include_paths()), f"-I{sysconfig.get_paths()['include']}"]
    results = {source: subprocess.run([compiler, *flags, "-S", "-o", "-", str(CSRC / source)], capture_output=True,
                                      text=True, timeout=600) for source in (ARM, ASSEMBLED, ATTENTION)}
    failed = {source: r.stderr[-3000:] for source, r in results.items() if r.returncode}
    assert not failed, failed
    paths = instructions_by_path(results[ARM].stdout)
    assert paths["neon_path"]["smull"] + paths["neon_path"]["smull2"] > 0, f"{ARM}: the neon path is not built"
    assert (paths["dotprod_path"]["sdot"] > 0) == (cpu == "apple-m1"), dict(paths["dotprod_path"])
    assert ("dotprod_path" in results[ASSEMBLED].stdout) == (cpu == "apple-m1"), "dispatch.cpp offers what is not built"
    assert re.search(r"^\s*fmla\s+v\d+\.4s", results[ATTENTION].stdout, re.MULTILINE), f"{ATTENTION}: no NEON fmla"
