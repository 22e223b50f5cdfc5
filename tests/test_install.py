"""tornchat's requirements can be installed together: with what torch's published builds require, and on every
Python tornchat admits.

setup.py pins torch's release. On a CPU machine pip takes the local CPU wheel, which requires no triton; the
builds PyPI serves for Linux (x86-64 and aarch64: CUDA builds, what a GPU user and every ARM user get) pin the
triton they were built with. A tornchat requirement that excludes a version torch pins makes pip refuse the
install there (ResolutionImpossible) while this machine's install passes: setup.py pinned triton==3.9.0 against
torch 2.13.0's triton==3.7.1 until 2026-12-07. Read here from PyPI: each wheel's METADATA, by HTTP range
requests (a few MB of a 500 MB wheel); skipped where PyPI cannot be reached.

Likewise setup.py's python_requires said 3.10 while transformers 5.23.0 needs 3.11 (found installing on 3.10,
2026-12-07): each pinned requirement's release is checked to have a build for the oldest Python tornchat admits.
"""
import ast
import io
import json
import re
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPI = "https://pypi.org/simple"


def setup_argument(name: str):
    """An argument of setup.py's setup() call, read without running it."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for keyword in node.keywords:
                if keyword.arg == name:
                    return ast.literal_eval(keyword.value)
    raise AssertionError(f"setup.py's setup() has no {name}")


def setup_requirements() -> list[Requirement]:
    return [Requirement(text) for text in setup_argument("install_requires")]


def pinned_version(requirement: Requirement) -> str:
    (spec,) = requirement.specifier
    assert spec.operator == "==", f"{requirement} is not pinned"
    return spec.version


class RemoteFile(io.RawIOBase):
    """A file on an HTTP server that honours Range, read as zipfile reads: seek, then read a few bytes."""

    def __init__(self, url: str):
        self.url, self.position = url, 0
        with self._get("bytes=0-0") as reply:
            self.size = int(reply.headers["Content-Range"].rsplit("/", 1)[1])

    def _get(self, byte_range: str):
        return urllib.request.urlopen(urllib.request.Request(self.url, headers={"Range": byte_range}), timeout=60)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def readinto(self, buffer) -> int:
        end = min(self.position + len(buffer), self.size)
        if end <= self.position:
            return 0
        with self._get(f"bytes={self.position}-{end - 1}") as reply:
            data = reply.read()
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def project_files(project: str) -> list[dict]:
    """PyPI's files of a project (its simple index, JSON): filename, url, requires-python."""
    index = urllib.request.Request(f"{PYPI}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(index, timeout=60) as reply:
            return json.load(reply)["files"]
    except (urllib.error.URLError, OSError) as error:
        pytest.skip(f"PyPI not reachable: {error}")


def torch_requirements(version: str, machine: str) -> list[Requirement]:
    """Requires-Dist of PyPI's torch wheel of that release for Linux on that machine and this Python."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    name = f"torch-{version}-{tag}-{tag}-manylinux_2_28_{machine}.whl"
    url = next((entry["url"] for entry in project_files("torch") if entry["filename"] == name), None)
    assert url, f"PyPI has no {name}"
    wheel = zipfile.ZipFile(io.BufferedReader(RemoteFile(url), buffer_size=1 << 20))
    metadata = wheel.read(f"torch-{version}.dist-info/METADATA").decode()
    return [Requirement(line.split(":", 1)[1]) for line in metadata.splitlines() if line.startswith("Requires-Dist:")]


def applies(requirement: Requirement, machine: str) -> bool:
    """Whether pip installs this requirement on Linux on that machine with this Python (no extras asked)."""
    environment = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": machine, "extra": ""}
    return requirement.marker is None or requirement.marker.evaluate(environment)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_torch_pins_nothing_tornchat_excludes(machine):
    ours = {canonicalize_name(r.name): r for r in setup_requirements() if applies(r, machine)}
    theirs = [r for r in torch_requirements(pinned_version(ours["torch"]), machine) if applies(r, machine)]
    pins = {canonicalize_name(r.name): pinned_version(r) for r in theirs
            if any(spec.operator == "==" for spec in r.specifier)}
    assert "triton" in pins, "torch's Linux build pins no triton: this test no longer checks what it was written for"
    excluded = {name: version for name, version in pins.items()
                if name in ours and not ours[name].specifier.contains(version, prereleases=True)}
    assert not excluded, f"torch's {machine} build pins {excluded}; setup.py requires " + ", ".join(
        str(ours[name]) for name in excluded)


def builds_for(python: Version, entry: dict) -> bool:
    """Whether a file of PyPI's index installs on that Python (x.y): its Requires-Python and, for a wheel, its tags."""
    if not SpecifierSet(entry.get("requires-python") or "").contains(python, prereleases=True):
        return False
    if not entry["filename"].endswith(".whl"):
        return True  # an sdist: its Requires-Python says it
    minor = python.release[1]
    for tag in parse_wheel_filename(entry["filename"])[3]:
        if tag.interpreter in ("py3", f"py3{minor}", f"cp3{minor}"):
            return True
        if tag.abi == "abi3" and re.fullmatch(r"cp3\d+", tag.interpreter) and int(tag.interpreter[3:]) <= minor:
            return True
    return False


def test_every_pinned_requirement_builds_for_the_oldest_python_tornchat_admits():
    oldest = Version(re.fullmatch(r">=\s*(3\.\d+)", setup_argument("python_requires")).group(1))
    pinned = [r for r in setup_requirements() if applies(r, "x86_64") and any(s.operator == "==" for s in r.specifier)]
    assert len(pinned) >= 5, pinned
    without = []
    for requirement in pinned:
        version = pinned_version(requirement)
        files = [entry for entry in project_files(canonicalize_name(requirement.name))
                 if re.match(rf"{re.escape(requirement.name).replace('-', '[-_]')}-{re.escape(version)}[-.]",
                             entry["filename"], re.IGNORECASE)]
        assert files, f"PyPI has no files of {requirement}"
        if not any(builds_for(oldest, entry) for entry in files):
            without.append(str(requirement))
    assert not without, f"setup.py admits Python {oldest}, which {without} do not"


def test_requirements_are_read():
    # The checks above see setup.py's list, markers and all (a triton requirement outside Linux would be a
    # requirement macOS cannot meet: PyPI has no triton for it).
    triton = next(r for r in setup_requirements() if r.name == "triton")
    assert applies(triton, "x86_64") and not triton.marker.evaluate({"platform_system": "Darwin", "sys_platform": "darwin"})
    assert re.fullmatch(r"\d+\.\d+\.\d+", pinned_version(triton))
