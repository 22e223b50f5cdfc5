"""Prompt-lookup speculative decoding, measured against itself off and against llama.cpp's.

Each system runs as a real server on loopback, one at a time, with the same
thread count, driven through the openai SDK with streaming (bench/e2e.py's
launch and stream_once): tornchat with `--speculate none`, `lookup` and
`auto`, and llama.cpp's own C++ server, llama-server (the baseline, as in
bench/e2e.py: same file, `-t N -tb N`, `--jinja`, `-c 4096`), plain and with
its prompt lookup (`--spec-type ngram-simple --spec-ngram-simple-size-n 2
--spec-ngram-simple-size-m N`: the last 2 tokens looked up in the context,
the N tokens after the match drafted; N is --draft-tokens, default 10).
llama-server's path: --llama-server PATH, else $LLAMA_SERVER, else
/work/llama-server/bin/llama-server; build it as bench/e2e.py's docstring
says (cmake from the llama.cpp that llama-cpp-python 0.3.36 vendors; AMX
off, as its kernels segfault on an AMX Xeon):

    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \\
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
    cmake --build build --target llama-server -j"$(nproc)"

Workloads (bench/workloads.py): a code edit that rewrites a 60-line function
(also sent with the original function as the request's `prediction`, which
only tornchat takes, and with tornchat --speculate none's own reply as the
prediction: every draft right, the most a verify gives on the machine, and
the only copying a random-weight model does), a summary quoting its source, an answer quoting a
retrieved document, and free chat. Every workload runs greedy; on tornchat
also seeded (temperature 0.8, seed 1234).

Per workload and system: decode tokens/s, TTFT, completion tokens, drafted
tokens accepted and rejected (the response's usage.completion_tokens_details;
on llama-server its last chunk's timings.draft_n and draft_n_accepted; the
engine's drafted and accepted counters on /metrics go to the JSON), and
tokens per forward: completion tokens after the first over the engine's
forwards, verifies included (the tornchat_engine_decode_steps_total delta
around each request), which is 1 + the mean accepted draft length per
forward. The exactness check: tornchat's text with speculation on (and with
a prediction) must equal its text with speculation off, greedy and seeded;
the script exits 1 when one differs.

    python -m bench.speculate                          # every system, embedded model
    python -m bench.speculate --checkpoint-path /work/models/random-llama-1b-Q4_K_M.gguf
    python -m bench.speculate --quick --systems tornchat-none,tornchat-lookup
    python -m bench.speculate --quick --systems llamacpp,llamacpp-lookup --llama-server /path/to/llama-server

Writes bench/results/speculate-<timestamp>.json (every measurement and text)
and, for the latest run, speculate.md (the tables for the README); server
logs go to bench/results/logs/.
"""
import argparse
import dataclasses
import os
import signal
import statistics
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench import servers, workloads
from bench.common import RESULTS, free_port, stamp, write_results
from bench.e2e import (STARTUP_TIMEOUT_S, System, add_baseline_arguments, chosen_systems, find_llama_server, fmt, launch,
                       llama_server_problem, llamacpp_system, machine, stream_once)
from tornchat import checkpoint
from tornchat.weights import gguf_file

# Request fields per sampling mode. The seeded mode is where exactness is hardest: the sampler's draws must
# not depend on how many tokens a verify step covered.
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 1234}}
# The engine's counters, read from /metrics around each request: drafted and accepted tokens, and
# decode_steps, every forward after the prompt's (verifies included).
COUNTERS = {"drafted": "tornchat_engine_drafted_tokens_total", "accepted": "tornchat_engine_accepted_tokens_total",
            "forwards": "tornchat_engine_decode_steps_total"}
# Ratios of decode tokens/s the tables show, (numerator, denominator), where both systems ran.
RATIOS = [
    ("tornchat-lookup", "tornchat-none"),
    ("tornchat-auto", "tornchat-none"),
    ("llamacpp-lookup", "llamacpp"),
    ("tornchat-none", "llamacpp"),
    ("tornchat-lookup", "llamacpp-lookup"),
]
# The decode-rate ratios tornchat-lookup / tornchat-none, greedy, that make speculation worth its keep.
TARGETS = {"code edit": 1.5, "free chat": 0.95}


@dataclass
class Contender:
    system: System
    family: str  # "tornchat" or "llamacpp" (llama-server): which request fields it takes
    speculate: str  # "none", "lookup" or "auto"


def tornchat_contender(mode: str):
    def build(threads: int, port: int, model: Path, draft_tokens: int, llama_server: Path | None) -> Contender:
        command = [sys.executable, "-m", "tornchat", "serve", "--port", str(port), "--threads", str(threads),
                   "--checkpoint-path", str(model), "--speculate", mode]
        return Contender(System(f"tornchat-{mode}", f"tornchat --speculate {mode}", command, "gpt-3.5-turbo",
                                "/health"), "tornchat", mode)
    return build


def llamacpp_contender(lookup: bool):
    def build(threads: int, port: int, model: Path, draft_tokens: int, llama_server: Path | None) -> Contender:
        plain = llamacpp_system(threads, port, model, llama_server)
        if not lookup:
            return Contender(plain, "llamacpp", "none")
        # common/ngram-map.cpp, common_ngram_simple_draft: the last size-n tokens (the one just sampled
        # included) looked up backwards in the context, the size-m tokens after the match drafted. 2 and N as
        # llama-cpp-python's LlamaPromptLookupDecoding (max_ngram_size 2, num_pred_tokens 10) had them.
        draft = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                 "--spec-ngram-simple-size-m", str(draft_tokens)]
        system = dataclasses.replace(plain, name="llamacpp-lookup", command=plain.command + draft,
                                     label=f"{plain.label}, ngram-simple prompt lookup drafting {draft_tokens} tokens")
        return Contender(system, "llamacpp", "lookup")
    return build


CONTENDERS = {
    "tornchat-none": tornchat_contender("none"),
    "tornchat-lookup": tornchat_contender("lookup"),
    "tornchat-auto": tornchat_contender("auto"),
    "llamacpp": llamacpp_contender(False),
    "llamacpp-lookup": llamacpp_contender(True),
}


def scrape(port: int) -> dict[str, float] | None:
    """The engine's counters (COUNTERS' keys); None where the server has no /metrics (llama.cpp)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError:
        return None
    names = {name: key for key, name in COUNTERS.items()}
    return {names[sample.name]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name in names}


def counter_delta(before: dict | None, after: dict | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def prediction_counts(run: dict) -> tuple[int, int] | None:
    """(accepted, rejected) drafted tokens from the response's usage, else from llama-server's timings
    (draft_n and draft_n_accepted, left out where it drafted nothing), where the server reports them."""
    details = (run["usage"] or {}).get("completion_tokens_details") or {}
    if details.get("accepted_prediction_tokens") is not None:
        return details["accepted_prediction_tokens"], details.get("rejected_prediction_tokens") or 0
    timings = run.get("server_timings")
    if timings is None:
        return None
    accepted = int(timings.get("draft_n_accepted") or 0)
    return accepted, int(timings.get("draft_n") or 0) - accepted


def summarize(runs: list[dict]) -> dict:
    """One workload on one system: medians over the repeats, drafted tokens summed over them."""
    rates = [run["decode_tok_s"] for run in runs if run["decode_tok_s"]]
    counts = [prediction_counts(run) for run in runs]
    accepted = sum(c[0] for c in counts) if all(counts) else None
    rejected = sum(c[1] for c in counts) if all(counts) else None
    deltas = [run["metrics"] for run in runs]
    metrics = None
    if all(delta is not None for delta in deltas):
        metrics = {name: sum(delta.get(name, 0.0) for delta in deltas) for name in deltas[0]}
    drafted = (accepted + rejected) if accepted is not None else None
    forwards = (metrics or {}).get("forwards")
    # The first token of each reply comes from the prompt's forward; the rest from the forwards after it.
    later_tokens = sum(run["completion_tokens"] - 1 for run in runs)
    chunks = sum(run["chunks"] for run in runs)
    return {
        "decode_tok_s": statistics.median(rates) if rates else None,
        "ttft_s": statistics.median(run["ttft_s"] for run in runs),
        "completion_tokens": runs[0]["completion_tokens"],
        "accepted": accepted,
        "rejected": rejected,
        "drafted": drafted,
        "acceptance": accepted / drafted if drafted else None,
        "metrics": metrics,
        "tokens_per_forward": later_tokens / forwards if forwards else None,
        "tokens_per_chunk": sum(run["completion_tokens"] for run in runs) / chunks if chunks else None,
        "texts": sorted({run["text"] for run in runs}),
        "runs": runs,
    }


def measure(contender: Contender, port: int, threads: int, cases: list[workloads.SpeculationWorkload],
            max_tokens: int, repeats: int, tokenizer, replies: dict) -> dict:
    """``replies``: tornchat-none's cells where it ran first, for the cases that predict its reply."""
    server = launch(contender.system, port, threads)
    try:
        ready_s = servers.wait_ready(server, STARTUP_TIMEOUT_S)  # raises with the log's tail when it does not start
        print(f"  ready after {ready_s:.1f} s", flush=True)
        try:
            cells = run_cases(contender, port, cases, max_tokens, repeats, tokenizer, replies)
        except Exception as exc:
            if server.process.poll() is None:
                raise
            # A client-side "connection error" is the symptom; the server's death is the news.
            raise RuntimeError(f"the server exited with status {server.process.returncode} mid-run ({exc}); "
                               f"log: {server.log_path}") from exc
    finally:
        servers.stop(server)
    # Other work on a shared machine slows every figure; the load average says how much there was.
    return {"ready_s": ready_s, "cells": cells, "load_average_after": os.getloadavg()[0]}


def run_cases(contender: Contender, port: int, cases: list[workloads.SpeculationWorkload], max_tokens: int,
              repeats: int, tokenizer, replies: dict) -> dict:
    from openai import OpenAI

    model = contender.system.model
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0, timeout=600)
    # The first request of a process pays one-time costs; the workloads measure the steady state.
    stream_once(client, model, [{"role": "user", "content": "Hi"}], 4, tokenizer)
    cells = {}
    for case in cases:
        if case.prediction is not None and contender.family != "tornchat":
            continue  # llama-server has no prediction field
        if case.predict_reply and (contender.family != "tornchat" or contender.speculate == "none" or not replies):
            continue  # needs tornchat-none's replies, and a tornchat that drafts
        for mode, options in MODES.items():
            if mode == "seeded" and contender.family != "tornchat":
                continue  # the exactness check is tornchat's; llama.cpp is compared greedy
            prediction = case.prediction
            if case.predict_reply:
                prediction = replies[f"{base_case(case, cases).name} / {mode}"]["runs"][0]["text"]
            extra = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
            runs = []
            for _ in range(repeats):
                before = scrape(port)
                run = stream_once(client, model, case.messages, max_tokens, tokenizer, **options, **extra)
                run["metrics"] = counter_delta(before, scrape(port))
                runs.append(run)
            cell = cells[f"{case.name} / {mode}"] = {"workload": case.name, "mode": mode, **summarize(runs)}
            print(f"  {case.name}, {mode}: TTFT {cell['ttft_s'] * 1000:.0f} ms, {cell['completion_tokens']} tokens, "
                  f"decode {fmt(cell['decode_tok_s'], '.1f')} tok/s, accepted/drafted {fmt(cell['accepted'])}/"
                  f"{fmt(cell['drafted'])}", flush=True)
    return cells


def base_case(case: workloads.SpeculationWorkload, cases: list[workloads.SpeculationWorkload]):
    """The case with the same messages and no prediction."""
    return next(other for other in cases if other.messages == case.messages and other.prediction is None
                and not other.predict_reply)


def exactness(report: dict, cases: list[workloads.SpeculationWorkload]) -> list[dict]:
    """Every tornchat reply against tornchat --speculate none's reply to the same messages, same mode, send by
    send: the first send of a request prefills the whole prompt, the later ones take it from a KV slot and
    re-run only its last token, which can flip a near-tie in greedy decoding with speculation on or off alike
    (docs/design.md, "Latency behaviour"), so send i meets the send that found the cache in the same state."""
    reference = report["systems"].get("tornchat-none", {}).get("result")
    if reference is None:
        return []
    def expected_for(case_name: str, mode: str) -> dict | None:
        """tornchat-none's cell of this case (it ignores a prediction), else of the latest earlier case with the
        same messages: sent in the same order, their sends find the prompt equally warm in the KV slots."""
        position = [case.name for case in cases].index(case_name)
        for earlier in reversed(cases[: position + 1]):
            if earlier.messages == cases[position].messages and f"{earlier.name} / {mode}" in reference["cells"]:
                return reference["cells"][f"{earlier.name} / {mode}"]
        return None

    checks = []
    for name, entry in report["systems"].items():
        if not name.startswith("tornchat") or "result" not in entry:
            continue
        for key, cell in entry["result"]["cells"].items():
            expected = expected_for(cell["workload"], cell["mode"])
            if expected is None or name == "tornchat-none":
                continue
            identical = [run["text"] for run in cell["runs"]] == [run["text"] for run in expected["runs"]]
            checks.append({"system": name, "workload": cell["workload"], "mode": cell["mode"], "identical": identical})
    return checks


def llamacpp_agreement(report: dict) -> dict[str, bool]:
    """Whether llama.cpp's prompt lookup leaves its greedy text as it was, send by send (for the reader;
    not a pass/fail check)."""
    systems = report["systems"]
    if "result" not in systems.get("llamacpp", {}) or "result" not in systems.get("llamacpp-lookup", {}):
        return {}
    plain, lookup = systems["llamacpp"]["result"]["cells"], systems["llamacpp-lookup"]["result"]["cells"]
    def texts(cell: dict) -> list[str]:
        return [run["text"] for run in cell["runs"]]

    return {key: texts(plain[key]) == texts(lookup[key]) for key in plain if key in lookup}


def markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    ran = {name: entry["result"] for name, entry in report["systems"].items() if "result" in entry}
    command = "python -m bench.speculate" + "".join(f" {arg}" for arg in s["argv"])
    lines = [
        "# Speculative decoding (prompt lookup)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; every server runs with {m['threads']} "
        f"threads. {report['started']}, `{command}`.",
        f"Packages: {', '.join(f'{k} {v}' for k, v in m['packages'].items())}; llama.cpp baseline: llama-server "
        f"{(m.get('llama_server') or {}).get('version', 'unknown')}; tornchat at "
        f"`{m.get('tornchat_commit', 'unknown')}`.",
        "",
        f"Model: {s['model']}. Each system is a real server on loopback, one at a time, driven through the openai "
        f"SDK with `stream=True`, after one tiny warm-up request; {s['max_tokens']} new tokens at most; medians over "
        f"{s['repeats']} sends of each request (later sends reuse the prompt's cache on every server, so TTFT is "
        f"mostly the cached figure). Greedy on every system; seeded (temperature 0.8, seed 1234) on tornchat only. "
        f"One run per system on a shared machine: compare ratios, not absolute figures.",
        "",
        "Systems:",
        "",
    ]
    lines += [f"- `{name}`: {entry['label']}" for name, entry in report["systems"].items()]
    prompt_tokens = s["prompt_tokens"]
    for mode in MODES:
        columns = [name for name, result in ran.items() if any(c["mode"] == mode for c in result["cells"].values())]
        ratios = [(a, b) for a, b in RATIOS if a in columns and b in columns]
        if not columns:
            continue
        lines += ["", f"Decode tokens/s, {mode}:", "",
                  "| workload | prompt tokens | " + " | ".join(f"`{c}`" for c in columns)
                  + "".join(f" | {a} / {b}" for a, b in ratios) + " |",
                  "|---|---|" + "---|" * (len(columns) + len(ratios))]
        for workload, count in prompt_tokens.items():
            rates = {c: ran[c]["cells"].get(f"{workload} / {mode}", {}).get("decode_tok_s") for c in columns}
            if not any(rates.values()):
                continue
            cells = [fmt(rates[c], ".1f") for c in columns]
            cells += [f"**{rates[a] / rates[b]:.2f}x**" if rates[a] and rates[b] else "-" for a, b in ratios]
            lines.append(f"| {workload} | {count} | " + " | ".join(cells) + " |")
    if "tornchat-lookup" in ran and "tornchat-none" in ran:
        verdicts = []
        for workload, target in TARGETS.items():
            key = f"{workload} / greedy"
            lookup, none = (ran[n]["cells"].get(key, {}).get("decode_tok_s") for n in ("tornchat-lookup", "tornchat-none"))
            if lookup and none:
                ratio = lookup / none
                verdicts.append(f"{workload} {ratio:.2f}x (target {target}x: {'met' if ratio >= target else 'not met'})")
        lines += ["", "Targets, tornchat lookup / none, greedy: " + "; ".join(verdicts) + "."]

    lines += ["", "Per request (medians; drafted tokens summed over the sends):", "",
              "| system | workload | mode | TTFT (ms) | completion tokens | decode tok/s | accepted / drafted "
              "| acceptance | tokens per forward | tokens per chunk |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, result in ran.items():
        for cell in result["cells"].values():
            lines.append(
                f"| `{name}` | {cell['workload']} | {cell['mode']} | {cell['ttft_s'] * 1000:.0f} "
                f"| {cell['completion_tokens']} | {fmt(cell['decode_tok_s'], '.1f')} "
                f"| {fmt(cell['accepted'])} / {fmt(cell['drafted'])} | {fmt(cell['acceptance'], '.0%')} "
                f"| {fmt(cell['tokens_per_forward'], '.2f')} | {fmt(cell['tokens_per_chunk'], '.2f')} |")

    checks = report["exactness"]
    if checks:
        lines += ["", "Identical text with speculation on and off (against `tornchat-none` without a prediction, "
                      "same mode; every send):", "",
                  "| system | workload | mode | identical |", "|---|---|---|---|"]
        lines += [f"| `{c['system']}` | {c['workload']} | {c['mode']} | {'yes' if c['identical'] else '**NO**'} |"
                  for c in checks]
    else:
        lines += ["", "Exactness not checked: it needs `tornchat-none` and another tornchat system to run."]
    agreement = report["llamacpp_agreement"]
    if agreement:
        lines += ["", "llama.cpp's greedy text with its prompt lookup equals its text without: "
                  + "; ".join(f"{key.split(' / ')[0]} {'yes' if same else 'no'}" for key, same in agreement.items()) + "."]

    lines += ["", "Decode tok/s: completion tokens (the server's `usage`; else max_tokens for a reply cut there, or "
              "the reply re-tokenized) after the first, over the time from the first to the last streamed chunk. Accepted / drafted: the response's "
              "`usage.completion_tokens_details` (`accepted_prediction_tokens`, `rejected_prediction_tokens`); "
              "on llama-server its last chunk's `timings.draft_n` and `draft_n_accepted` (left out, so 0, where it "
              "drafted nothing). Tokens per forward: completion tokens after the first over the engine's "
              "forwards after the prompt (`tornchat_engine_decode_steps_total` around each request), verifies "
              "included: 1.00 without speculation, 1 + the mean accepted draft length per forward with it. Tokens "
              "per chunk: "
              "above 1 where accepted drafts reach the client in one event. Load average after each system: "
              + ", ".join(f"`{name}` {result['load_average_after']:.1f}" for name, result in ran.items()) + "."]
    skipped = {name: entry for name, entry in report["systems"].items() if "skipped" in entry}
    if skipped:
        lines += ["", "Not measured:"] + [f"- `{name}`: {entry['skipped']}" for name, entry in skipped.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Prompt-lookup speculative decoding: tornchat on and off, and llama.cpp's")
    p.add_argument("--systems", default=",".join(CONTENDERS), help=f"comma-separated, from {', '.join(CONTENDERS)} "
                                                                   f"(default: all)")
    p.add_argument("--quick", action="store_true", help="32 new tokens, one send per request: a smoke run")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 256; 32 with --quick)")
    p.add_argument("--repeats", type=int, help="sends of each request, medians taken (default 3; 1 with --quick)")
    p.add_argument("--draft-tokens", type=int, default=10,
                   help="llama-server's --spec-ngram-simple-size-m for llamacpp-lookup: tokens drafted after a match "
                        "(default 10)")
    p.add_argument("--workloads", help="comma-separated workload names (default: all; a prediction case needs its "
                                       "plain one too)")
    add_baseline_arguments(p)
    args = p.parse_args(argv)
    model = args.checkpoint_path or checkpoint.default_gguf_path()
    max_tokens = args.max_tokens or (32 if args.quick else 256)
    repeats = args.repeats or (1 if args.quick else 3)
    # Turn kill into an exception, so the finally blocks stop the server being measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wanted = chosen_systems(p, args.systems, CONTENDERS)
    llama_server = find_llama_server(args.llama_server)
    if any(name.startswith("llamacpp") for name in wanted) and (problem := llama_server_problem(llama_server)):
        p.error(f"the llama.cpp baseline: {problem}\nor leave llamacpp and llamacpp-lookup out of --systems.")

    tokenizer = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(model))
    cases = workloads.speculation_workloads()
    if args.workloads:
        names = [name.strip() for name in args.workloads.split(",")]
        unknown = sorted(set(names) - {case.name for case in cases})
        if unknown:
            p.error(f"unknown workloads {', '.join(unknown)}; choose from {', '.join(case.name for case in cases)}")
        cases = [case for case in cases if case.name in names]
    started = stamp()
    report = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "machine": machine(args.threads, llama_server),
        "settings": {"argv": sys.argv[1:] if argv is None else argv, "model": model.name, "max_tokens": max_tokens,
                     "repeats": repeats, "systems": wanted, "draft_tokens": args.draft_tokens, "modes": MODES,
                     "prompt_tokens": {case.name: workloads.prompt_tokens(case.messages, tokenizer) for case in cases}},
        "systems": {},
    }
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, {args.threads} threads", flush=True)
    for name in wanted:
        port = free_port()
        contender = CONTENDERS[name](args.threads, port, model, args.draft_tokens, llama_server)
        system = contender.system
        entry = report["systems"][name] = {"label": system.label, "command": system.command,
                                           "family": contender.family, "speculate": contender.speculate}
        if system.skip:
            print(f"[{name}] skipped: {system.skip}", flush=True)
            entry["skipped"] = system.skip
            continue
        print(f"[{name}] starting: {' '.join(system.command)}", flush=True)
        try:
            replies = report["systems"].get("tornchat-none", {}).get("result", {}).get("cells", {})
            entry["result"] = measure(contender, port, args.threads, cases, max_tokens, repeats, tokenizer, replies)
        except Exception as exc:  # a system that fails is reported, and the others still run
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"[{name}] skipped: {reason}", flush=True)
            entry["skipped"] = reason
    report["exactness"] = exactness(report, cases)
    report["llamacpp_agreement"] = llamacpp_agreement(report)

    data = write_results(RESULTS / f"speculate-{started}.json", report)
    table = RESULTS / "speculate.md"
    table.write_text(markdown(report))
    print(f"wrote {data}, {table}", flush=True)
    print(table.read_text(), flush=True)
    differing = [check for check in report["exactness"] if not check["identical"]]
    for check in differing:
        print(f"DIFFERENT: {check['system']}, {check['workload']}, {check['mode']}", file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
