"""Ready after a first start: tornchat against llama-server, in turns, on the same file and threads.

Each round starts tornchat (its defaults, a new empty TORNCHAT_CACHE: a first start, which measures
speculation's costs) and llama-server (bench/e2e.py's command), each a fresh process, and times launch to
the first 200 from /health. With --cold the page cache is dropped before every start (root only:
/proc/sys/vm/drop_caches), so that the file and the libraries come from disk as after a reboot or a
download; without it they come from memory, as on a later start. With --idle S each start waits S seconds
first, so that it finds memory as a machine left alone does rather than as the other server just freed
it: on a VM whose host takes freed memory back (free page reporting), fresh 2 MiB pages then cost
tornchat's read of the file seconds (docs/performance.md). Prints each round and the medians, and
tornchat's time less llama-server's (issue "One answer per request": at most 3 s).

    python -m bench.ready [--checkpoint-path FILE.gguf] [--rounds 4] [--threads 2] [--cold] [--idle S]
                          [--llama-server PATH]
"""
import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import e2e, servers
from bench.common import free_port
from tornchat import checkpoint
from tornchat.engine.cpu import describe

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> None:
    """Write dirty pages out, then drop the clean ones (page cache, dentries, inodes): needs root."""
    subprocess.run(["sync"], check=True)
    DROP_CACHES.write_text("3\n")


def ready_seconds(system: e2e.System, port: int, threads: int, cold: bool, idle: float) -> float:
    time.sleep(idle)
    if cold:
        drop_page_cache()
    server = e2e.launch(system, port, threads)
    try:
        return servers.wait_ready(server, e2e.STARTUP_TIMEOUT_S)
    finally:
        servers.stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-path", help="a GGUF file (default: the embedded model's)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every start (root)")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds to wait before each start")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: bench/e2e.py's)")
    args = parser.parse_args()
    if args.cold and not os.access(DROP_CACHES, os.W_OK):
        parser.error(f"--cold drops the page cache, which needs write access to {DROP_CACHES} (root)")
    model = Path(args.checkpoint_path) if args.checkpoint_path else checkpoint.default_gguf_path()
    llama_server = e2e.find_llama_server(args.llama_server)
    port = free_port()
    tornchat = e2e.tornchat_systems(args.threads, port, model)[0]
    llamacpp = e2e.llamacpp_system(args.threads, port, model, llama_server)
    if llamacpp.skip:
        parser.error(f"llama-server: {llamacpp.skip}")
    print(f"CPU: {describe()}; {model.name}, {args.threads} threads, "
          f"{'page cache dropped before each start' if args.cold else 'page cache warm'}"
          f"{f', {args.idle:g} s idle before each' if args.idle else ''}", flush=True)
    ours, theirs = [], []
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="tornchat-cache-") as cache:
            tornchat.env = {"TORNCHAT_CACHE": cache}
            ours.append(ready_seconds(tornchat, port, args.threads, args.cold, args.idle))
        theirs.append(ready_seconds(llamacpp, port, args.threads, args.cold, args.idle))
        print(f"round {round_ + 1}: tornchat {ours[-1]:.2f} s, llama-server {theirs[-1]:.2f} s", flush=True)
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    print(f"\n| system | ready (s), median of {args.rounds} | range |\n|---|---|---|")
    print(f"| tornchat (first start) | {ours_s:.2f} | {min(ours):.2f}-{max(ours):.2f} |")
    print(f"| llama-server | {theirs_s:.2f} | {min(theirs):.2f}-{max(theirs):.2f} |")
    print(f"\ntornchat - llama-server: {ours_s - theirs_s:+.2f} s (medians)")


if __name__ == "__main__":
    main()
