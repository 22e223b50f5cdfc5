"""Concurrent streams: tornchat --parallel N against llama-server -np N, same file, same threads.

For 1, 2 and 4 streams at once (each a different short chat prompt, greedy,
--tokens new tokens, streamed over raw HTTP on loopback): the aggregate
decode rate (all the streams' generated tokens over the wall time from the
first request to the last reply's end), the worst time to first token, and
whether each concurrent reply's text equals the same request sent alone.
Each server runs with as many slots as the largest count (--parallel /
-np), so a count below it is measured on the same server. With --rounds N
the counts take turns N times on that server and the table gives medians
(and ranges) of the rates and of each round's ratio to its own one stream:
this machine's speed drifts by 10% from one minute to the next.

    python -m bench.parallel [--checkpoint-path FILE.gguf] [--tokens 128] [--threads 2] [--rounds 1] [--speculate none]
                             [--long-prompt 2000]

--speculate passes tornchat's option of that name: with its default a lone
stream may verify drafts of several rows a step, which is what more streams
share, so none gives the ratios of plain steps.

After the rounds, tornchat's `n`: 4 seeded choices of one prompt in one
request, against 4 separate requests of it (seeds 7 .. 10) at once and one
after another, in wall seconds (llama-server's chat endpoint has no `n`).

Then, per system and round, a stream's gaps while another request's prompt
of about --long-prompt tokens (workloads.long_messages, a fresh one each time,
so that no KV cache holds it) is read beside it: the stream's median wait
between two pieces, its longest while the prompt is read, and that prompt's
time to first token beside the stream and alone; and a short request's time
to first token when it comes half a second into another such prompt's
reading, and alone.

Prints a markdown table; the CPU it ran on comes first.
"""
import argparse
import http.client
import json
import statistics
import sys
import threading
import time

from bench import agents_apis, e2e, servers, workloads
from bench.common import free_port
from tornchat import checkpoint
from tornchat.weights import gguf_file

PROMPTS = [
    "Write a long story about a dragon who learns to bake bread.",
    "Write a long story about a robot who learns to paint.",
    "Describe a walk through a busy market in a foreign city.",
    "Write a detailed guide to planting a vegetable garden.",
]
COUNTS = (1, 2, 4)


def stream(port: int, model: str, text: str | list[dict], tokens: int, times: list[float] | None = None) -> dict:
    """One streamed greedy chat completion of a user's text (or of messages): its text, token count, and times of
    its first and last piece; each piece's time appended to ``times`` as it comes."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    body = {"model": model, "messages": messages, "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    pieces, first, usage = [], None, None
    for _, data in agents_apis.records(response):
        if data is None:  # [DONE]
            continue
        usage = data.get("usage") or usage
        for choice in data.get("choices") or ():
            if piece := (choice.get("delta") or {}).get("content"):
                first = first or time.perf_counter()
                pieces.append(piece)
                if times is not None:
                    times.append(time.perf_counter())
    connection.close()
    ended = time.perf_counter()
    return {"text": "".join(pieces), "tokens": usage["completion_tokens"] if usage else len(pieces),
            "started": started, "ttft": (first or ended) - started, "ended": ended}


def concurrent(port: int, model: str, count: int, tokens: int) -> list[dict]:
    results: list[dict | None] = [None] * count

    def one(i: int) -> None:
        results[i] = stream(port, model, PROMPTS[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def measure(system: e2e.System, port: int, threads: int, tokens: int, rounds: int = 1,
            choices: bool = False, long: list[tuple[list[dict], ...]] = ()) -> tuple[dict, dict | None, list]:
    """The rounds' summary, with ``choices`` the `n` timings (``choices_wall``), and per (beside, alone, under)
    triple of long prompts in ``long`` the gaps a stream sees while one is read (``gaps_while_reading``) and a
    short request's wait behind one (``short_while_reading``)."""
    server = e2e.launch(system, port, threads)
    try:
        servers.wait_ready(server, e2e.STARTUP_TIMEOUT_S)
        solo = [stream(port, system.model, text, tokens) for text in PROMPTS]  # also warms the server up
        rows = summarize([{count: one_count(port, system.model, count, tokens, solo) for count in COUNTS}
                          for _ in range(rounds)])
        wall = choices_wall(port, system.model, tokens) if choices else None
        return rows, wall, [gaps_while_reading(port, system.model, tokens, beside, alone)
                            | short_while_reading(port, system.model, under) for beside, alone, under in long]
    finally:
        servers.stop(server)


def complete(port: int, model: str, tokens: int, **fields) -> dict:
    """One sampled chat completion of the first prompt (not streamed)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": tokens,
            "temperature": 0.8, "seed": 7, **fields}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = json.loads(connection.getresponse().read())
    connection.close()
    return reply


def choices_wall(port: int, model: str, tokens: int) -> dict:
    """Wall seconds of 4 choices in one request (``n``), of 4 separate requests at once, and one after another."""
    started = time.perf_counter()
    reply = complete(port, model, tokens, n=4)
    one_request = time.perf_counter() - started
    if len(reply.get("choices") or ()) != 4:
        raise RuntimeError(f"n = 4 did not give 4 choices: {reply}")
    started = time.perf_counter()
    threads = [threading.Thread(target=complete, args=(port, model, tokens), kwargs={"seed": 7 + i}) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    at_once = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(4):
        complete(port, model, tokens, seed=7 + i)
    return {"one_request": one_request, "at_once": at_once, "one_after_another": time.perf_counter() - started}


def one_count(port: int, model: str, count: int, tokens: int, solo: list[dict]) -> dict:
    replies = concurrent(port, model, count, tokens)
    wall = max(r["ended"] for r in replies) - min(r["started"] for r in replies)
    return {
        "tokens_per_s": sum(r["tokens"] for r in replies) / wall,
        "worst_ttft_s": max(r["ttft"] for r in replies),
        "equal_to_solo": sum(r["text"] == s["text"] for r, s in zip(replies, solo)),
    }


def gaps_while_reading(port: int, model: str, tokens: int, beside: list[dict], alone: list[dict]) -> dict:
    """A stream's median wait between pieces and its longest while the long prompt ``beside`` is read next to it;
    that prompt's time to first token there, and of the same-sized ``alone`` with nothing else running."""
    ttft_alone = stream(port, model, alone, 4)["ttft"]
    times: list[float] = []
    streaming = threading.Thread(target=stream, args=(port, model, PROMPTS[0], tokens, times))
    streaming.start()
    while len(times) < 8 and streaming.is_alive():
        time.sleep(0.01)
    read = stream(port, model, beside, 4)
    streaming.join()
    if len(times) < 8 or times[-1] < read["started"] + read["ttft"]:
        raise RuntimeError("the stream ended before the long prompt was read: raise --tokens")
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    while_read = [gap for gap, at in gaps if read["started"] < at <= read["started"] + read["ttft"] + gap]
    return {"median_gap_s": statistics.median(gap for gap, at in gaps if at <= read["started"]),
            "longest_gap_s": max(while_read), "ttft_beside_s": read["ttft"], "ttft_alone_s": ttft_alone}


def short_while_reading(port: int, model: str, long: list[dict]) -> dict:
    """The first prompt's time to first token when it comes half a second after the long prompt ``long`` (read
    alone until then), and alone."""
    ttft_alone = stream(port, model, PROMPTS[1], 4)["ttft"]
    reading = threading.Thread(target=stream, args=(port, model, long, 4))
    reading.start()
    time.sleep(0.5)
    ttft = stream(port, model, PROMPTS[1], 4)["ttft"]
    reading.join()
    return {"short_ttft_s": ttft, "short_ttft_alone_s": ttft_alone}


def summarize(runs: list[dict]) -> dict:
    """Rounds of {count: one_count's row} -> per count: the median rate and its range, the median and range of
    each round's ratio to that round's one stream, the worst first token of all rounds, and the fewest
    replies equal to alone in any round."""
    rows = {}
    for count in runs[0]:
        rates = [run[count]["tokens_per_s"] for run in runs]
        ratios = [run[count]["tokens_per_s"] / run[1]["tokens_per_s"] for run in runs]
        rows[count] = {
            "tokens_per_s": statistics.median(rates), "tokens_per_s_range": (min(rates), max(rates)),
            "vs_one": statistics.median(ratios), "vs_one_range": (min(ratios), max(ratios)),
            "worst_ttft_s": max(run[count]["worst_ttft_s"] for run in runs),
            "equal_to_solo": min(run[count]["equal_to_solo"] for run in runs),
        }
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="the stream counts take turns this many times")
    parser.add_argument("--speculate", help="tornchat's --speculate (default: its own default)")
    parser.add_argument("--long-prompt", type=int, default=2000,
                        help="tokens of the prompt read beside a stream (default 2000; 0: skip that measure)")
    e2e.add_baseline_arguments(parser)
    args = parser.parse_args()
    model = args.checkpoint_path or checkpoint.default_gguf_path()
    tokenizer = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(model))
    long = [tuple(workloads.long_messages(3 * i + j, args.long_prompt, tokenizer) for j in (0, 1, 2))
            for i in range(args.rounds if args.long_prompt else 0)]
    slots = max(COUNTS)
    port = free_port()
    tornchat = e2e.tornchat_systems(args.threads, port, model)[0]
    tornchat.command += ["--parallel", str(slots)] + (["--speculate", args.speculate] if args.speculate else [])
    # -np splits -c between the slots: give each the 4096 a single slot had.
    llama = e2e.llamacpp_system(args.threads, port, model, e2e.find_llama_server(args.llama_server), 4096 * slots)
    llama.command += ["-np", str(slots)]
    print(e2e.machine(args.threads, e2e.find_llama_server(args.llama_server)))
    results, choices, gaps = {}, None, {}
    for system in (tornchat, llama):
        if system.skip:
            print(f"{system.name}: skipped ({system.skip})")
            continue
        results[system.name], wall, gaps[system.name] = measure(system, port, args.threads, args.tokens, args.rounds,
                                                                system is tornchat, long)
        if system is tornchat:
            choices = wall
    print(f"\n{model.name}, {args.tokens} new tokens a stream, greedy, {args.threads} threads, {slots} slots, "
          f"tornchat --speculate {args.speculate or 'default'}, {args.rounds} round(s): medians (ranges)\n")
    print("| system | streams | tokens/s (all) | vs 1 stream | worst TTFT | equal to alone |")
    print("|---|---|---|---|---|---|")
    spread = args.rounds > 1  # ranges only where there are rounds to span
    for name, rows in results.items():
        for count, row in rows.items():
            (low, high), (low_x, high_x) = row["tokens_per_s_range"], row["vs_one_range"]
            print(f"| {name} | {count} | {row['tokens_per_s']:.1f}" + (f" ({low:.1f}-{high:.1f})" if spread else "")
                  + f" | {row['vs_one']:.2f}x" + (f" ({low_x:.2f}-{high_x:.2f}x)" if spread else "")
                  + f" | {row['worst_ttft_s']:.2f} s | {row['equal_to_solo']} of {count} |")
    if choices:
        print(f"\ntornchat `n`, {args.tokens} tokens a choice, seeded: 4 choices in one request "
              f"{choices['one_request']:.2f} s, 4 separate requests at once {choices['at_once']:.2f} s, "
              f"one after another {choices['one_after_another']:.2f} s")
    if long:
        print(f"\nA stream's gaps while a prompt of about {args.long_prompt} tokens is read beside it (a fresh prompt "
              "each time), that prompt's time to first token beside the stream and alone; a short request's time to "
              "first token 0.5 s into such a prompt's reading, and alone:\n")
        print("| system | round | stream's median gap | longest gap while the prompt is read | TTFT beside | TTFT alone "
              "| short request's TTFT behind a prompt | alone |")
        print("|---|---|---|---|---|---|---|---|")
        for name, rounds in gaps.items():
            for i, row in enumerate(rounds, 1):
                print(f"| {name} | {i} | {1e3 * row['median_gap_s']:.0f} ms | {1e3 * row['longest_gap_s']:.0f} ms "
                      f"| {row['ttft_beside_s']:.2f} s | {row['ttft_alone_s']:.2f} s | {row['short_ttft_s']:.2f} s "
                      f"| {row['short_ttft_alone_s']:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
