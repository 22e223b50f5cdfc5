"""What the benchmarks share: a free port, percentiles, decode rates, the fastest of several calls, a model
loaded in process with a prompt in its cache and the median of calls from it, and the one results writer."""
import json
import socket
import statistics
import time
from datetime import datetime
from pathlib import Path

from tornchat.engine.cpu import describe

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-quantile (q in 0..1), or None of no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rate_after_first(tokens: int, first: float, last: float) -> float | None:
    """Tokens/s of a reply after its first token, whose time is the TTFT's: the tokens after the first over
    the time from the first to the last; None where that time or those tokens are none."""
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else None


def greedy_steps_rate(runner, cache, token: int, steps: int) -> tuple[float, int]:
    """Tokens/s of ``steps`` greedy one-token forwards on ``cache`` from ``token``, and the last token."""
    started = time.perf_counter()
    for _ in range(steps):
        token = int(runner.forward([token], cache, decode=True).argmax())
    return steps / (time.perf_counter() - started), token


def fastest_ms(fn, calls: int) -> float:
    """Milliseconds of fn's fastest call of calls (after one untimed): on a machine shared with other work, the
    least disturbed one."""
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def runner_after_prompt(path: str | None, isa: str | None, context: int):
    """A GGUF (default: the embedded model) in process, its blocks laid out for instruction-set path ``isa``
    (default: this CPU's best; the panels are avx512vnni's alone), and a cache holding a fixed prompt of
    ``context`` tokens: (path, runner, cache, prompt)."""
    from tornchat import checkpoint
    from tornchat.engine import llama
    from tornchat.weights import gguf_file

    path = path or str(checkpoint.default_gguf_path())
    runner = llama.LlamaRunner(*gguf_file.load(Path(path), isa=isa or ""), isa=isa)
    prompt = [100 + (i * 7919) % 20000 for i in range(context)]
    cache = runner.new_cache()
    runner.forward(prompt, cache)
    return path, runner, cache, prompt


def block_seconds(call, runner, cache, start: int, calls: int) -> float:
    """Median seconds of ``calls`` calls, each starting from ``start`` positions (each call's rows dropped from
    ``cache`` after it)."""
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
        runner.truncate(cache, start)
    return statistics.median(times)


def stamp() -> str:
    """The date and time a results file name carries: 20261125-143000."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def write_results(path: Path, record: dict) -> Path:
    """``record`` as indented JSON at ``path`` (its folder made), with the CPU (model name and the flags that
    decide kernel speed) and the date it was written in it, and in each row of its lists of rows: a figure is
    only read against its machine, also when a row is copied out alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"cpu": describe(), "date": datetime.now().isoformat(timespec="seconds")}
    written = stamp | {key: [stamp | row if isinstance(row, dict) else row for row in value] if isinstance(value, list)
                       else value for key, value in record.items()}
    path.write_text(json.dumps(written, indent=2))
    return path
