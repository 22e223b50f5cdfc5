"""What a speculative verify of k rows costs against a one-token decode step, in one process.

Issue "One answer per request" asks a verify of 4 rows at 1B to cost at most 1.3 steps. After a prompt of
--context positions, blocks of --block one-row steps and blocks of --block k-row verifies take turns (each
call's rows dropped from the cache after it, so every call starts at the same position), --pairs times; a
pair's ratio is the verify block's median over the step block's. Alternating blocks put a slow moment of a
shared machine (its memory's bandwidth drifts between phases here) on both sides of a ratio. The median and
quartiles of the pairs' ratios are printed with the step's and the verify's median times, then what the
engine's own measurement gives (``speculate.measure``, the fastest of a few calls per size: what a server
drafts by, in its start-up log as "a verify of 1..8 rows costs"). Writes bench/results/verify-<timestamp>.json.

    python -m bench.verify [--checkpoint-path FILE.gguf] [--rows 2,4,8] [--isa avx2] [--pairs 30]
"""
import argparse
import statistics

import torch

from bench.common import RESULTS, block_seconds, runner_after_prompt, stamp, write_results
from tornchat.engine import speculate
from tornchat.engine.cpu import describe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-path", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--rows", default="2,4,8", help="comma-separated verify sizes")
    parser.add_argument("--isa", help="the block kernels' path (default: this CPU's best, or TORNCHAT_ISA)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="positions in the cache before each call")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--block", type=int, default=8, help="calls per block")
    args = parser.parse_args()
    if args.context < speculate.MAX_DRAFT + 1:
        parser.error(f"--context must be at least {speculate.MAX_DRAFT + 1}: the engine's measurement verifies its tokens")
    torch.set_num_threads(args.threads)

    path, runner, cache, prompt = runner_after_prompt(args.checkpoint_path, args.isa, args.context)
    print(f"CPU: {describe()}; {args.threads} threads\nmodel: {path}; {runner.label()}")
    start = len(prompt)

    def step():
        runner.forward([7], cache, decode=True)

    rows_measured = []
    print("\n| rows | verify / step, median (quartiles; range) | step ms | verify ms |\n|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        def verify():
            runner.verify([7] * rows, cache)
        block_seconds(step, runner, cache, start, 2)
        block_seconds(verify, runner, cache, start, 2)
        steps, verifies = [], []
        for _ in range(args.pairs):
            steps.append(block_seconds(step, runner, cache, start, args.block))
            verifies.append(block_seconds(verify, runner, cache, start, args.block))
        ratios = [v / s for v, s in zip(verifies, steps)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        rows_measured.append({"rows": rows, "ratio": median, "quartiles": [q1, q3], "ratios": ratios,
                              "step_s": statistics.median(steps), "verify_s": statistics.median(verifies)})
        print(f"| {rows} | **{median:.2f}** ({q1:.2f}-{q3:.2f}; {min(ratios):.2f}-{max(ratios):.2f}) "
              f"| {1e3 * statistics.median(steps):.1f} | {1e3 * statistics.median(verifies):.1f} |", flush=True)

    costs = speculate.measure(runner, prompt)
    print("\nthe engine's measurement, a verify of 1..%d rows in steps: %s"
          % (len(costs.relative), ", ".join(f"{c:.2f}" for c in costs.relative)))
    print("wrote", write_results(RESULTS / f"verify-{stamp()}.json", {
        "model": path, "runner": runner.label(), "threads": args.threads, "context": args.context,
        "block": args.block, "rows": rows_measured, "engine_measurement": list(costs.relative)}))


if __name__ == "__main__":
    main()
