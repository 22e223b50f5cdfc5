"""A one-row decode step's share of the read bandwidth, block by block, beside memory's phase.

Issue "One answer per request" asks a 1B step to read at least 90% of the read bandwidth. On these VMs the
bandwidth switches between phases from minute to minute (an AMD Zen 5: 41-51 or 73-85 GB/s), and a step's
share differs between them: bound by memory in the slow phase, by the one-row tiles' arithmetic in the fast
one. So one figure over a run mixes the two. Here each block of --steps one-row steps (each from the same
--context positions) runs between two bandwidth measurements (a torch sum over 1 GiB, as
bench/decode_rounds.py's); the block's share is the bytes a step reads (weights and KV cache,
bench/decode_speed.py's count) x steps/s, over the faster of its two sums. Prints every block, then the
median share in each phase: blocks whose bandwidth lies above the middle of the run's range and those below,
where that range is wider than 20%, else one. Writes bench/results/step-share-<timestamp>.json.

To compare two builds of the kernels, run this from each tree in turns (each tree's own built extension);
the shares, each against its own block's bandwidth, compare across processes where raw step times do not.

    python -m bench.step_share [--checkpoint-path FILE.gguf] [--blocks 8] [--steps 12] [--isa avx2]
"""
import argparse
import statistics

import torch

from bench.blocks import bandwidth
from bench.common import RESULTS, block_seconds, runner_after_prompt, stamp, write_results
from bench.decode_speed import bytes_per_token
from tornchat.engine.cpu import describe


def phases(blocks: list[dict]) -> dict[str, list[dict]]:
    """The blocks by memory's phase: above and below the middle of their bandwidths' range where it spans more
    than 20%, else all in one."""
    rates = [b["bandwidth"] for b in blocks]
    if max(rates) < 1.2 * min(rates):
        return {"one phase": blocks}
    middle = (max(rates) + min(rates)) / 2
    return {"slow phase": [b for b in blocks if b["bandwidth"] < middle],
            "fast phase": [b for b in blocks if b["bandwidth"] >= middle]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-path", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--isa", help="the block kernels' path (default: this CPU's best, or TORNCHAT_ISA)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="positions in the cache before each step")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="one-row steps per block")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path, runner, cache, _ = runner_after_prompt(args.checkpoint_path, args.isa, args.context)
    step_bytes = bytes_per_token(runner, args.context)
    print(f"CPU: {describe()}; {args.threads} threads\nmodel: {path}; {runner.label()}; "
          f"a step reads {step_bytes / 1e9:.3f} GB")

    def step_seconds() -> float:
        """The median of --steps one-row steps, each from --context positions."""
        return block_seconds(lambda: runner.forward([7], cache, decode=True), runner, cache, args.context, args.steps)

    step_seconds()
    blocks = []
    print("\n| block | step ms | read GB/s before / after | share |\n|---|---|---|---|")
    for i in range(args.blocks):
        before = bandwidth()
        seconds = step_seconds()
        after = bandwidth()
        share = step_bytes / seconds / max(before, after)
        blocks.append({"step_s": seconds, "bandwidth": max(before, after), "share": share})
        print(f"| {i + 1} | {1e3 * seconds:.2f} | {before / 1e9:.1f} / {after / 1e9:.1f} | {share:.0%} |", flush=True)

    print()
    by_phase = phases(blocks)
    for name, members in by_phase.items():
        shares = [b["share"] for b in members]
        rates = [b["bandwidth"] / 1e9 for b in members]
        print(f"{name} ({len(members)} blocks, {min(rates):.1f}-{max(rates):.1f} GB/s): a step reads "
              f"{statistics.median(shares):.0%} of the bandwidth ({min(shares):.0%}-{max(shares):.0%})")
    print("wrote", write_results(RESULTS / f"step-share-{stamp()}.json", {
        "model": path, "runner": runner.label(), "threads": args.threads, "context": args.context,
        "step_bytes": step_bytes, "blocks": blocks,
        "phases": {name: statistics.median(b["share"] for b in members) for name, members in by_phase.items()}}))


if __name__ == "__main__":
    main()
