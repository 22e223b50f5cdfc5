"""End-to-end benchmark: tornchat against what a user would pick instead.

Each system runs as a real server on loopback, one at a time, with the same
thread count, and is driven through the openai SDK with streaming, so TTFT
and the gaps between streamed chunks are what a client sees. Workloads:

- short: one short prompt, greedy, ~128 new tokens: TTFT and decode tokens/s;
- chat: a conversation whose client resends the whole history each turn,
  appending the real reply and a long user message, growing to ~2,000 prompt
  tokens by turn 6: TTFT per turn;
- peak RSS of the server process and its children, sampled throughout.

    python -m bench.e2e                      # every system (llama-server must be built, see below)
    python -m bench.e2e --quick --systems baseline,llamacpp --llama-server /path/to/llama-server

The llama.cpp baseline (system ``llamacpp``) is llama.cpp's own C++ server,
``llama-server``, started with the same GGUF file and the same thread count as
tornchat (``-t N -tb N``), ``--jinja`` (the file's own chat template) and
``-c 4096``, ready once ``/health`` answers 200. Its path: ``--llama-server
PATH``, else $LLAMA_SERVER, else /work/llama-server/bin/llama-server. Build
it from the llama.cpp that llama-cpp-python 0.3.36 vendors (cmake and g++):

    mkdir -p /work/llama-server && cd /work/llama-server
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"   # AMX's kernels segfault on AMX Xeons
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \\
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \\
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
    cmake --build build --target llama-server -j"$(nproc)"   # about 11 minutes on 2 busy cores
    mkdir -p /work/llama-server/bin && cp build/bin/llama-server /work/llama-server/bin/

NO_AMX keeps -march=native but without AMX: on an AMX Xeon (Sapphire Rapids
and later) llama.cpp's AMX kernels segfault in the warm-up forward on the
embedded Q4_1 model (llama.cpp issue 20824); on other CPUs the flags change
nothing.

llama-cpp-python's Python server (``python -m llama_cpp.server``) adds
per-token Python overhead on top of the same library; it is kept only as the
separate system ``llamacpp-python`` (not in the default list, never in a
ratio).

Writes bench/results/e2e-<timestamp>.json (every measurement), and for the
latest run e2e.md (the tables for the README), e2e-ttft.png and
e2e-decode.png; server logs go to bench/results/logs/.
"""
import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from bench import servers, workloads
from bench.common import RESULTS, free_port, percentile, rate_after_first, stamp, write_results
from tornchat import checkpoint
from tornchat.engine.cpu import describe
from tornchat.weights import gguf_file

STARTUP_TIMEOUT_S = 600


@dataclass
class System:
    name: str
    label: str  # what the table calls it
    command: list[str]
    model: str  # the "model" field the server expects
    ready_path: str
    skip: str | None = None  # why it cannot run here, when it cannot
    env: dict = field(default_factory=dict)


def tornchat_systems(threads: int, port: int, model: Path) -> list[System]:
    """tornchat with its defaults, then the before/after rows: each decode-weight format (--quantize),
    and transformers' own modules in fp32."""
    from tornchat.config import Config

    base = [sys.executable, "-m", "tornchat", "serve", "--port", str(port), "--threads", str(threads),
            "--checkpoint-path", str(model)]
    defaults = Config()
    variants = [("tornchat", [])]
    variants += [(f"tornchat-{mode}", ["--quantize", mode]) for mode in ("int4", "int8", "bf16", "none")]
    if defaults.model_impl != "hf":
        variants.append(("tornchat-hf", ["--model-impl", "hf", "--quantize", "none"]))
    systems = []
    for name, flags in variants:
        settings = {"model_impl": defaults.model_impl, "quantize": defaults.quantize}
        settings.update({flag.lstrip("-").replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2])})
        described = ", ".join(f"{key}={value}" for key, value in settings.items())
        label = f"tornchat{' defaults' if not flags else ''} ({described})"
        systems.append(System(name, label, base + flags, "gpt-3.5-turbo", "/health"))
    return systems


def baseline_system(threads: int, port: int, model: Path) -> System:
    command = [sys.executable, "-m", "bench.baseline_server", "--port", str(port), "--threads", str(threads), "--checkpoint-path", str(model)]
    return System("baseline", "transformers generate per request (reference)", command, "baseline", "/health")


DEFAULT_LLAMA_SERVER = Path("/work/llama-server/bin/llama-server")
# The recipe in this module's docstring, for the error a missing llama-server gives.
LLAMA_SERVER_BUILD = (__doc__[__doc__.index("    mkdir -p /work/llama-server"):__doc__.index("\n\nNO_AMX keeps")]
                      if __doc__ else "    see bench/e2e.py's docstring")  # python -OO drops docstrings


def find_llama_server(option: str | None) -> Path | None:
    """llama.cpp's C++ server: --llama-server PATH, else $LLAMA_SERVER, else DEFAULT_LLAMA_SERVER where it
    exists; None when none was named and the default is absent."""
    named = option or os.environ.get("LLAMA_SERVER")
    if named:
        return Path(named).expanduser()
    return DEFAULT_LLAMA_SERVER if DEFAULT_LLAMA_SERVER.exists() else None


def llama_server_problem(path: Path | None) -> str | None:
    """Why the llama.cpp baseline cannot run (with how to build it), or None when it can."""
    if path is not None and path.is_file() and os.access(path, os.X_OK):
        return None
    where = (f"{path} is not an executable file" if path is not None else
             f"no llama-server: pass --llama-server PATH, set LLAMA_SERVER, or put it at {DEFAULT_LLAMA_SERVER}")
    return f"{where}. Build llama.cpp's server (the baseline) with:\n{LLAMA_SERVER_BUILD}"


def llama_server_version(path: Path | None) -> str:
    """What ``llama-server --version`` says ("version: 0.5.0-dev (build 1, commit 0c1e570)"), without the
    parentheses: "0.5.0-dev, build 1, commit 0c1e570"."""
    if llama_server_problem(path):
        return "not built"
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__})"
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("version")]
    return lines[0].removeprefix("version:").strip().replace(" (", ", ").replace(")", "") if lines else "unknown"


def llamacpp_system(threads: int, port: int, model: Path, llama_server: Path | None, context: int = 4096) -> System:
    """The llama.cpp baseline: llama.cpp's C++ server on the same file with the same thread count, the file's
    own chat template (--jinja), ``context`` positions (-c, split between its slots); ready when /health answers
    200 (503 while it loads)."""
    command = [
        str(llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-c", str(context), "--jinja",
    ]
    return System("llamacpp", f"llama.cpp llama-server ({llama_server_version(llama_server)}, {model.name})",
                  command, model.stem, "/health", skip=llama_server_problem(llama_server))


def llamacpp_python_system(threads: int, port: int, model: Path) -> System:
    """llama-cpp-python's Python server on the same library: not the baseline (it adds per-token Python
    overhead), never in a ratio; only with --systems llamacpp-python."""
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
        "--chat_format", "chatml",
    ]
    skip = None if importlib.util.find_spec("llama_cpp") else "not installed: pip install --no-build-isolation -e '.[llamacpp]'"
    return System("llamacpp-python", f"llama-cpp-python's Python server ({version('llama_cpp_python')}, "
                  f"{model.name}; not the baseline)", command, "smollm2", "/v1/models", skip=skip)


def transformers_serve_system(threads: int, port: int, model: Path) -> System:
    directory = str(checkpoint.resolve(str(model)))
    command = [str(Path(sys.executable).with_name("transformers")), "serve", directory,
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    skip = f"needs {' and '.join(missing)}: pip install 'transformers[serving]'" if missing else None
    return System("transformers-serve", f"transformers serve ({version('transformers')})", command, directory,
                  "/health", skip=skip, env={"HF_HUB_OFFLINE": "1"})


# Each takes (threads, port, model, llama_server path).
SYSTEM_BUILDERS = {
    "tornchat": lambda threads, port, model, _: tornchat_systems(threads, port, model),
    "tornchat-defaults": lambda threads, port, model, _: tornchat_systems(threads, port, model)[:1],
    "baseline": lambda threads, port, model, _: [baseline_system(threads, port, model)],
    "llamacpp": lambda threads, port, model, llama_server: [llamacpp_system(threads, port, model, llama_server)],
    "transformers-serve": lambda threads, port, model, _: [transformers_serve_system(threads, port, model)],
    "llamacpp-python": lambda threads, port, model, _: [llamacpp_python_system(threads, port, model)],
}
# Not in the default --systems: tornchat's first row alone, and llama-cpp-python's server (not the baseline).
OPT_IN_SYSTEMS = ("tornchat-defaults", "llamacpp-python")


def chosen_systems(p: argparse.ArgumentParser, systems: str, known) -> list[str]:
    """The names in --systems (comma-separated); the parser's error where one is not among ``known``."""
    wanted = [name.strip() for name in systems.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        p.error(f"unknown systems {', '.join(unknown)}; choose from {', '.join(known)}")
    return wanted


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class RssSampler(threading.Thread):
    """Peak resident memory of a process tree, sampled every 100 ms (children included: llama.cpp and
    uvicorn may fork)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak = 0
        self.stopped = threading.Event()

    def current(self) -> int:
        total = 0
        for p in [self.process, *self.process.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def run(self):
        while not self.stopped.wait(0.1):
            try:
                self.peak = max(self.peak, self.current())
            except psutil.Error:
                return


def launch(system: System, port: int, threads: int) -> servers.Server:
    """The system's server, its log under bench/results/logs/."""
    RESULTS.joinpath("logs").mkdir(parents=True, exist_ok=True)
    # Every runtime reads these; tornchat and the baseline also set their thread count from flags.
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           **system.env}
    return servers.launch(system.command, port, RESULTS / "logs" / f"{system.name}.log", env, system.ready_path)


def stream_once(client, model: str, messages: list[dict], max_tokens: int, tokenizer, **options) -> dict:
    """One streamed completion, timed at the client: greedy unless options (request fields such as
    temperature, seed, prediction) say otherwise."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        **{"temperature": 0.0, **options},
    )
    arrivals, pieces, usage, finish_reason, timings = [], [], None, None, None
    for event in stream:
        if event.usage:
            usage = event.usage
        if (event.model_extra or {}).get("timings"):  # llama-server's own counters, on its last chunk
            timings = event.model_extra["timings"]
        if event.choices and event.choices[0].finish_reason:
            finish_reason = event.choices[0].finish_reason
        if event.choices and event.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            pieces.append(event.choices[0].delta.content)
    finished = time.perf_counter()
    text = "".join(pieces)
    if not arrivals:
        raise RuntimeError("the stream carried no text")
    # Servers differ in whether they report usage while streaming. Without it, a reply cut by max_tokens
    # has exactly that many; otherwise re-tokenizing the text is the fallback (it can miscount text the
    # model spelled in tokens the tokenizer would not pick), so every system gets a token count.
    if usage:
        tokens = usage.completion_tokens
    elif finish_reason == "length":
        tokens = max_tokens
    else:
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return {
        "ttft_s": arrivals[0] - started,
        "total_s": finished - started,
        "completion_tokens": tokens,
        "usage_reported": usage is not None,
        "finish_reason": finish_reason,
        "chunks": len(arrivals),
        "decode_tok_s": rate_after_first(tokens, arrivals[0], arrivals[-1]),
        "gaps_ms": [1000 * (b - a) for a, b in zip(arrivals, arrivals[1:])],
        "server_prompt_tokens": usage.prompt_tokens if usage else None,
        "usage": usage.model_dump(exclude_none=True) if usage else None,
        "server_timings": timings,
        "text": text,
    }


def run_system(system: System, port: int, threads: int, workload: workloads.Workload, tokenizer,
               user_messages: list[str]) -> dict:
    server = launch(system, port, threads)
    rss = RssSampler(server.process.pid)
    rss.start()
    try:
        result = drive(server, rss, system, port, workload, tokenizer, user_messages)
    except Exception as exc:
        code = server.process.poll()
        if code is None:
            raise
        # A client-side "connection error" is the symptom; the server's death is the news.
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        raise RuntimeError(f"the server {how} mid-run ({exc}); log: {server.log_path}") from exc
    finally:
        rss.stopped.set()
        servers.stop(server)
        peak = rss.peak
        print(f"  stopped; peak RSS {peak / 2**20:.0f} MiB (log: {server.log_path})", flush=True)
    result["peak_rss_mib"] = peak / 2**20
    # Other work on a shared machine slows every figure; the load average says how much there was.
    result["load_average_after"] = os.getloadavg()[0]
    return result


def drive(server: servers.Server, rss: RssSampler, system: System, port: int, workload: workloads.Workload,
          tokenizer, user_messages: list[str]) -> dict:
    from openai import OpenAI

    ready_s = servers.wait_ready(server, STARTUP_TIMEOUT_S)
    print(f"  ready after {ready_s:.1f} s (rss {rss.current() / 2**20:.0f} MiB)", flush=True)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0, timeout=600)
    # The first request of a process pays one-time costs (lazy init, allocator growth);
    # the workloads measure the steady state a user sees after that.
    stream_once(client, system.model, [{"role": "user", "content": "Hi"}], 4, tokenizer)

    runs = []
    for repeat in range(workload.short_repeats):
        run = stream_once(client, system.model, workloads.short_messages(repeat), workload.short_max_tokens, tokenizer)
        runs.append(run)
        print(f"  short {repeat + 1}/{workload.short_repeats}: TTFT {run['ttft_s'] * 1000:.0f} ms, "
              f"decode {run['decode_tok_s'] or 0:.1f} tok/s, {run['completion_tokens']} tokens in {run['chunks']} chunks",
              flush=True)
    # Medians, so that one run slowed by other work on the machine does not decide the figure.
    rates = [run["decode_tok_s"] for run in runs if run["decode_tok_s"]]
    short = {"ttft_s": statistics.median(run["ttft_s"] for run in runs),
             "decode_tok_s": statistics.median(rates) if rates else None}

    messages = [{"role": "system", "content": workloads.SYSTEM}]
    turns = []
    for number, user in enumerate(user_messages, 1):
        messages.append({"role": "user", "content": user})
        turn = stream_once(client, system.model, messages, workload.turn_max_tokens, tokenizer)
        turn["prompt_tokens"] = workloads.prompt_tokens(messages, tokenizer)
        messages.append({"role": "assistant", "content": turn["text"]})
        turns.append(turn)
        print(f"  chat turn {number}: {turn['prompt_tokens']} prompt tokens, TTFT {turn['ttft_s'] * 1000:.0f} ms, "
              f"{turn['completion_tokens']} tokens, decode {turn['decode_tok_s'] or 0:.1f} tok/s", flush=True)
    # The whole conversation once more behind another system message: no prefix in common with anything
    # cached, so every token is prefilled (a client opening a long saved chat).
    cold_messages = [{"role": "system", "content": workloads.COLD_SYSTEM}] + messages[1:-1]
    cold = stream_once(client, system.model, cold_messages, 8, tokenizer)
    cold["prompt_tokens"] = workloads.prompt_tokens(cold_messages, tokenizer)
    print(f"  cold chat: {cold['prompt_tokens']} prompt tokens, TTFT {cold['ttft_s'] * 1000:.0f} ms", flush=True)
    streams = runs + turns
    gaps = [gap for stream in streams for gap in stream["gaps_ms"]]
    return {"ready_s": ready_s, "short": short, "short_runs": runs, "chat": turns, "cold_chat": cold,
            "gap_p50_ms": percentile(gaps, 0.5), "gap_p99_ms": percentile(gaps, 0.99),
            "tokens_per_chunk": sum(s["completion_tokens"] for s in streams) / sum(s["chunks"] for s in streams)}


def machine(threads: int, llama_server: Path | None = None) -> dict:
    return {
        "cpu": describe(), "cores": os.cpu_count(), "threads": threads,
        "llama_server": {"path": str(llama_server) if llama_server else None,
                         "version": llama_server_version(llama_server)},
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "tornchat_commit": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                          cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown",
        "packages": {name: version(name) for name in
                     ("torch", "transformers", "tornado", "llama_cpp_python", "openai")},
    }


def fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    ran = {name: entry for name, entry in report["systems"].items() if "result" in entry}
    lines = [
        "# End-to-end benchmark",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; every server runs with "
        f"{m['threads']} threads. {report['started']}, `python -m bench.e2e{' --quick' if s['quick'] else ''}`.",
        f"Packages: {', '.join(f'{k} {v}' for k, v in m['packages'].items())}; llama.cpp baseline: llama-server "
        f"{(m.get('llama_server') or {}).get('version', 'unknown')}; tornchat at "
        f"`{m.get('tornchat_commit', 'unknown')}`.",
        "",
        f"Model: {s.get('model', 'SmolLM2-135M-Instruct.Q4_1.gguf')} (the transformers-based systems load it "
        f"dequantized to fp32). Each system is a real server on loopback, driven one at a time through the openai SDK "
        f"with `stream=True`, greedy (temperature 0), after one tiny warm-up request. Short prompt: "
        f"{s['short_max_tokens']} new tokens at most, medians over {s['short_repeats']} prompts on different topics. Chat: {s['turns']} turns, each resending the whole "
        f"history plus a ~{s['user_tokens']}-token user message, {s['turn_max_tokens']} new tokens at most "
        f"per turn. One run per system on a shared machine: compare ratios, not absolute figures.",
        "",
        "| system | ready (s) | short TTFT (ms) | decode tok/s | chunk gap p50 / p99 (ms) "
        f"| chat TTFT turn 1 (ms) | chat TTFT turn {s['turns']} (ms) | cold TTFT, whole chat (ms) | peak RSS (MiB) "
        f"| load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in ran.values():
        r = entry["result"]
        lines.append(
            f"| {entry['label']} | {r['ready_s']:.1f} | {r['short']['ttft_s'] * 1000:.0f} "
            f"| {fmt(r['short']['decode_tok_s'], '.1f')} | {fmt(r['gap_p50_ms'])} / {fmt(r['gap_p99_ms'])} "
            f"| {r['chat'][0]['ttft_s'] * 1000:.0f} | {r['chat'][-1]['ttft_s'] * 1000:.0f} "
            f"| {r['cold_chat']['ttft_s'] * 1000:.0f} ({r['cold_chat']['prompt_tokens']} tokens) | {r['peak_rss_mib']:.0f} "
            f"| {r['load_average_after']:.1f} |"
        )
    baseline = ran.get("baseline")
    if baseline and len(ran) > 1:
        b = baseline["result"]
        lines += ["", "Against the reference baseline (x times faster; TTFT as baseline / system):", "",
                  f"| system | decode tok/s | short TTFT | chat TTFT turn {s['turns']} | chat TTFT, sum of turns |",
                  "|---|---|---|---|---|"]
        for name, entry in ran.items():
            if name == "baseline":
                continue
            r = entry["result"]
            decode = (r["short"]["decode_tok_s"] / b["short"]["decode_tok_s"]
                      if r["short"]["decode_tok_s"] and b["short"]["decode_tok_s"] else None)
            lines.append(
                f"| {entry['label']} | {fmt(decode, '.2f')}x | {b['short']['ttft_s'] / r['short']['ttft_s']:.2f}x "
                f"| {b['chat'][-1]['ttft_s'] / r['chat'][-1]['ttft_s']:.2f}x "
                f"| {sum(t['ttft_s'] for t in b['chat']) / sum(t['ttft_s'] for t in r['chat']):.2f}x |"
            )
    lines += ["", "Chat TTFT per turn in ms (prompt tokens as the model's template counts them):", "",
              "| turn | " + " | ".join(entry["label"] for entry in ran.values()) + " |",
              "|---|" + "---|" * len(ran)]
    for turn in range(s["turns"]):
        cells = [f"{e['result']['chat'][turn]['ttft_s'] * 1000:.0f} ({e['result']['chat'][turn]['prompt_tokens']})"
                 for e in ran.values()]
        lines.append(f"| {turn + 1} | " + " | ".join(cells) + " |")
    lines += ["", "Decode tok/s: completion tokens (the server's `usage`; else max_tokens for a reply cut there, or "
              "the reply re-tokenized) after the first, over the time from the first to the last streamed chunk. Chunk gaps: time between streamed "
              "chunks with text, over the short prompt and all chat turns; a server that streams words rather than "
              "tokens has fewer, longer gaps (tokens per chunk: "
              + ", ".join(f"{e['label']} {e['result']['tokens_per_chunk']:.2f}" for e in ran.values()) + ")."
              " Peak RSS: the server process and its children, sampled every 100 ms from launch to exit."
              " Load avg: the machine's 1-minute load average when the system's run ended (above the thread "
              "count means other work shared the cores)."]
    if ran:
        lines += ["", "![TTFT per chat turn](e2e-ttft.png)", "", "![Decode tokens/s](e2e-decode.png)"]
    skipped = {name: entry for name, entry in report["systems"].items() if "skipped" in entry}
    if skipped:
        lines += ["", "Not measured:"] + [f"- {entry['label']}: {entry['skipped']}" for entry in skipped.values()]
    return "\n".join(lines) + "\n"


def plot(report: dict) -> list[Path]:
    """The two figures, under fixed names so the README can embed the latest run."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {name: entry for name, entry in report["systems"].items() if "result" in entry}
    if not ran:
        return []
    caption = f"{report['machine']['cpu']}, {report['machine']['threads']} threads"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for entry in ran.values():
        chat = entry["result"]["chat"]
        ax.plot(range(1, len(chat) + 1), [t["ttft_s"] for t in chat], marker="o", label=entry["label"])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("chat turn (whole history resent; prompt grows to ~2,000 tokens)")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title(f"TTFT per chat turn\n{caption}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    ttft = RESULTS / "e2e-ttft.png"
    fig.savefig(ttft, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 0.6 * len(ran) + 1.8))
    labels = [entry["label"] for entry in ran.values()]
    rates = [entry["result"]["short"]["decode_tok_s"] or 0 for entry in ran.values()]
    bars = ax.barh(labels, rates)
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s, streamed, greedy (higher is better)")
    ax.set_title(f"Decode speed, short prompt\n{caption}", fontsize=10)
    fig.tight_layout()
    decode = RESULTS / "e2e-decode.png"
    fig.savefig(decode, dpi=120)
    plt.close(fig)
    return [ttft, decode]


def add_baseline_arguments(p: argparse.ArgumentParser) -> None:
    """What every comparison with llama-server takes: the GGUF file both serve, their threads, the binary."""
    p.add_argument("--checkpoint-path", type=Path, help="a GGUF file every system serves (default: the embedded model)")
    p.add_argument("--threads", type=int, default=2, help="threads for every server (default 2)")
    p.add_argument("--llama-server", metavar="PATH",
                   help=f"llama.cpp's llama-server binary (default: $LLAMA_SERVER, else {DEFAULT_LLAMA_SERVER})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="End-to-end benchmark: tornchat against what users would pick instead")
    p.add_argument("--systems", default=",".join(name for name in SYSTEM_BUILDERS if name not in OPT_IN_SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEM_BUILDERS)} (default: all but "
                        f"{' and '.join(OPT_IN_SYSTEMS)}; tornchat-defaults is tornchat's first row alone; llamacpp is "
                        f"llama.cpp's llama-server, the baseline; llamacpp-python is llama-cpp-python's Python server, "
                        f"never the baseline)")
    p.add_argument("--quick", action="store_true", help="fewer turns and tokens, for a smoke run")
    p.add_argument("--llama-context", type=int, default=4096,
                   help="llama-server's -c (default 4096): room for the whole chat, which random weights can make longer "
                        "than planned; it allocates a KV cache of that size at start, which counts in its peak RSS")
    add_baseline_arguments(p)
    args = p.parse_args(argv)
    model = args.checkpoint_path or checkpoint.default_gguf_path()
    # Turn kill into an exception, so the finally blocks stop the server being measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wanted = chosen_systems(p, args.systems, SYSTEM_BUILDERS)
    llama_server = find_llama_server(args.llama_server)
    if "llamacpp" in wanted and (problem := llama_server_problem(llama_server)):
        p.error(f"the llama.cpp baseline: {problem}\nor leave llamacpp out of --systems.")
    workload = workloads.QUICK if args.quick else workloads.FULL
    tokenizer = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(model))
    user_messages = workloads.chat_user_messages(workload, tokenizer)
    started = stamp()
    report = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "machine": machine(args.threads, llama_server),
        "settings": {**dataclasses.asdict(workload), "quick": args.quick, "systems": wanted, "model": model.name},
        "systems": {},
    }
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, {args.threads} threads", flush=True)
    builders = SYSTEM_BUILDERS | {"llamacpp": lambda threads, port, model, server: [
        llamacpp_system(threads, port, model, server, args.llama_context)]}
    for builder in wanted:
        for system in builders[builder](args.threads, free_port(), model, llama_server):
            entry = report["systems"][system.name] = {"label": system.label, "command": system.command}
            if system.skip:
                print(f"[{system.name}] skipped: {system.skip}", flush=True)
                entry["skipped"] = system.skip
                continue
            print(f"[{system.name}] starting: {' '.join(system.command)}", flush=True)
            port = int(system.command[system.command.index("--port") + 1])
            try:
                result = run_system(system, port, args.threads, workload, tokenizer, user_messages)
            except Exception as exc:  # a system that fails is reported, and the others still run
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(f"[{system.name}] skipped: {reason}", flush=True)
                entry["skipped"] = reason
                continue
            entry["result"] = result

    data = write_results(RESULTS / f"e2e-{started}.json", report)
    table = RESULTS / "e2e.md"
    table.write_text(markdown(report))
    images = plot(report)
    print(f"wrote {data}, {table}" + "".join(f", {image}" for image in images), flush=True)
    print(table.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
