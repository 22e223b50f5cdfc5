"""What was measured on this machine, remembered between starts in one small JSON file.

A measurement (how much a speculative verify of r rows costs against one
step, say) depends on the CPU, the checkpoint, torch, the thread count and
the build of our kernels; each entry is kept under a key made of those, so a
change of any of them (an upgrade of tornchat included) measures again.
"""
import hashlib
import json

import torch

from tornchat.engine import cpu, fused

MAX_ENTRIES = 32  # the most recent kept: test runs leave a checkpoint each


def cache_key(what: str, checkpoint: str) -> str:
    depends_on = {"cpu": cpu.model_name(), "flags": sorted(cpu.flags()), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "kernels": fused.build_id(), "checkpoint": checkpoint, "what": what}
    return hashlib.sha256(json.dumps(depends_on).encode()).hexdigest()[:24]


def recall(cache_file, key: str) -> dict | None:
    """The entry remembered under key (``cache_key``), or None."""
    return _read(cache_file).get(key)


def remember(cache_file, key: str, entry: dict) -> None:
    """Keep entry under key, newest last, dropping the oldest beyond MAX_ENTRIES."""
    entries = _read(cache_file)
    entries.pop(key, None)
    entries[key] = entry
    for stale in list(entries)[:-MAX_ENTRIES]:
        del entries[stale]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_file.with_name(cache_file.name + ".partial")
    partial.write_text(json.dumps(entries, indent=1))
    partial.replace(cache_file)


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
