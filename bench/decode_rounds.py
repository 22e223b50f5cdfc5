"""Decode rate against llama-server in alternating rounds, for a machine whose speed drifts.

bench/e2e.py runs each system once, one after the other: on a shared machine
whose memory bandwidth moves with other tenants' load (46 to 79 GB/s within
one session on an AMD Zen 5), the two halves of a run can land in different
phases and the ratio with them. Here tornchat (its defaults) and llama-server
take turns, a fresh server each round, on the same file and threads, each
decoding e2e's short workload (3 topics, 128 greedy tokens, streamed through
the openai SDK); each round's ratio compares neighbours in time, and the
median over rounds is the figure to report. Each round also measures the
machine's read bandwidth (a torch sum over 1 GiB, as bench/blocks.py) before,
between and after the two servers, and gives each system's decode rate as a
share of the mean of the two measurements beside its own run (this CPU's
bandwidth swung 33-61 GB/s within minutes): the bytes a token reads
(``token_bytes``) times tokens/s, over that bandwidth. A dense model's
figure: a mixture of experts reads only its chosen experts.

    python -m bench.decode_rounds [--checkpoint-path FILE.gguf] [--rounds 4] [--threads 2] [--speculate none]
                                  [--context 4000]

--speculate passes tornchat's option of that name (none: decode without drafts, the kernels' own rate).
--context N puts about N tokens of notes before each question (workloads.long_messages), so that every step
attends over a long cache (an agent's turn); llama-server then gets -c N + 1,024.
"""
import argparse
import statistics
from collections.abc import Callable

import openai
import torch

from bench import e2e, servers, workloads
from bench.blocks import bandwidth
from bench.common import free_port
from tornchat import checkpoint
from tornchat.engine.cpu import describe
from tornchat.weights import gguf_file


def decode_rate(make_system: Callable[[int], e2e.System], threads: int, tokenizer, context: int = 0) -> float:
    """The median decode tokens/s over the short workload's topics (after about ``context`` tokens of notes, where
    given), on a fresh server on a free port."""
    port = free_port()
    system = make_system(port)
    server = e2e.launch(system, port, threads)
    try:
        servers.wait_ready(server, 300)
        client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
        messages = [workloads.long_messages(i, context, tokenizer) if context else workloads.short_messages(i)
                    for i in range(workloads.FULL.short_repeats)]
        rates = [e2e.stream_once(client, system.model, m, workloads.FULL.short_max_tokens, tokenizer)["decode_tok_s"]
                 for m in messages]
    finally:
        servers.stop(server)
    return statistics.median(rates)


def token_bytes(file: gguf_file.GGUFFile, tokenizer, context: int) -> float:
    """What one decode step reads, in bytes: every matrix (the token embedding only where the head is its own
    tensor: then a token reads one row of it) and the KV cache at the short workload's reply's middle, 2 bytes a
    value (tornchat's bf16 cache, llama-server's f16)."""
    tensors = file.tensors
    weights = sum(t.nbytes for name, t in tensors.items()
                  if name != "token_embd.weight" or "output.weight" not in tensors)
    config = gguf_file.config_of(file)
    prompt = len(tokenizer.encode(" ".join(m["content"] for m in workloads.short_messages(0)))) + context
    positions = prompt + workloads.FULL.short_max_tokens / 2
    kv = int(file.meta("block_count")) * 2 * config.kv_heads * config.head_dim * 2 * positions
    return weights + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--speculate", help="tornchat's --speculate (default: its own default)")
    parser.add_argument("--context", type=int, default=0, help="tokens of notes before each question (default 0)")
    e2e.add_baseline_arguments(parser)
    args = parser.parse_args()
    model = args.checkpoint_path or checkpoint.default_gguf_path()
    llama_server = e2e.find_llama_server(args.llama_server)
    if problem := e2e.llama_server_problem(llama_server):
        raise SystemExit(problem)
    file = gguf_file.GGUFFile(model)  # the header only, as bench/e2e.py
    tokenizer = checkpoint.tokenizer_from_gguf(file)
    per_token = token_bytes(file, tokenizer, args.context)
    torch.set_num_threads(args.threads)
    print(f"CPU: {describe()}; {args.threads} threads; {model.name}; tornchat --speculate {args.speculate or 'default'}; llama-server "
          f"{e2e.llama_server_version(llama_server)}" + (f"; about {args.context} tokens of context" if args.context else ""))

    def tornchat(port: int) -> e2e.System:
        system = e2e.tornchat_systems(args.threads, port, model)[0]
        if args.speculate:
            system.command += ["--speculate", args.speculate]
        return system

    context = max(4096, args.context + 1024)  # llama-server's -c: the notes, the question and the reply
    print(f"a token reads about {per_token / 1e9:.3f} GB")
    print("| round | tornchat tok/s | llama-server tok/s | ratio | read GB/s before / between / after | tornchat of it "
          "| llama-server of it |\n|---|---|---|---|---|---|---|")
    ratios, shares, their_shares = [], [], []
    for round_ in range(1, args.rounds + 1):
        before = bandwidth()
        ours = decode_rate(tornchat, args.threads, tokenizer, args.context)
        between = bandwidth()
        theirs = decode_rate(lambda port: e2e.llamacpp_system(args.threads, port, model, llama_server, context), args.threads,
                             tokenizer, args.context)
        after = bandwidth()
        ratios.append(ours / theirs)
        shares.append(ours * per_token / ((before + between) / 2))
        their_shares.append(theirs * per_token / ((between + after) / 2))
        print(f"| {round_} | {ours:.1f} | {theirs:.1f} | {ratios[-1]:.2f}x | {before / 1e9:.1f} / {between / 1e9:.1f} / "
              f"{after / 1e9:.1f} | {shares[-1]:.0%} | {their_shares[-1]:.0%} |", flush=True)
    print(f"median ratio over {args.rounds} rounds: {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}x to {max(ratios):.2f}x); of the read bandwidth, tornchat at "
          f"{statistics.median(shares):.0%} (range {min(shares):.0%} to {max(shares):.0%}), llama-server at "
          f"{statistics.median(their_shares):.0%} (range {min(their_shares):.0%} to {max(their_shares):.0%})")


if __name__ == "__main__":
    main()
