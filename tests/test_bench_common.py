"""bench/common.py: what every benchmark script shares."""
import json
import subprocess
import sys
from pathlib import Path

from bench import common
from tornchat.engine import blocks, cpu, speculate


def test_results_carry_the_cpu_and_date_in_the_record_and_each_row(tmp_path):
    path = common.write_results(tmp_path / "r" / "x.json", {"rows": [{"tok/s": 1.5}, {"tok/s": 2.0}], "note": "n"})
    written = json.loads(path.read_text())
    assert written["cpu"] == cpu.describe() and written["date"] and written["note"] == "n"
    assert [row["tok/s"] for row in written["rows"]] == [1.5, 2.0]
    assert all(row["cpu"] == written["cpu"] and row["date"] == written["date"] for row in written["rows"])


def test_percentile_is_the_nearest_rank():
    assert common.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 3.0  # rank round(0.5 x 3) = 2 of the sorted values
    assert common.percentile([4.0, 1.0, 3.0, 2.0], 0.0) == 1.0 and common.percentile([5.0], 0.99) == 5.0
    assert common.percentile([], 0.5) is None


def test_parallel_rounds_give_medians_and_each_rounds_own_ratio():
    """bench.parallel --rounds: a round's ratio is to its own one stream (the machine's speed drifts between
    rounds), the first token the worst of all rounds, replies equal to alone the fewest of any round."""
    from bench import parallel

    def row(rate, ttft=0.1, equal=1):
        return {"tokens_per_s": rate, "worst_ttft_s": ttft, "equal_to_solo": equal}

    runs = [{1: row(100.0), 2: row(180.0, 0.2, 2)}, {1: row(200.0), 2: row(300.0, 0.5, 1)}, {1: row(150.0), 2: row(300.0)}]
    two = parallel.summarize(runs)[2]
    assert two["tokens_per_s"] == 300.0 and two["tokens_per_s_range"] == (180.0, 300.0)
    assert two["vs_one"] == 1.8 and two["vs_one_range"] == (1.5, 2.0)  # 1.8, 1.5, 2.0: not 300 / 150
    assert two["worst_ttft_s"] == 0.5 and two["equal_to_solo"] == 1
    assert parallel.summarize(runs)[1]["vs_one"] == 1.0


def test_long_messages_reach_their_length_and_share_no_notes(tokenizer):
    from bench import workloads

    first, second = (workloads.long_messages(i, 1000, tokenizer) for i in range(2))
    assert workloads.prompt_tokens(first, tokenizer) >= 1000
    # Each repeat its own notes: no server answers one from another's cache past the opening words.
    assert first[1]["content"].splitlines()[1] != second[1]["content"].splitlines()[1]


def test_verify_bench_prints_each_size_and_the_engines_measurement():
    """bench/verify.py, the issue's figure for a verify's cost in steps, end to end on the embedded model (a
    few calls: its timings are not asserted, only that every size and the engine's costs are reported), on
    the AVX2 path where the CPU has it: a path other than the default lays the file's blocks out its own way."""
    run = subprocess.run([sys.executable, "-m", "bench.verify", "--rows", "2,3", "--pairs", "2", "--block", "1",
                          "--context", "8", "--isa", "avx2" if "avx2" in blocks.isas() else blocks.isa()],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1].strip() for line in run.stdout.splitlines() if line.startswith("| ") and "**" in line]
    assert rows == ["2", "3"]
    sizes = speculate.MAX_DRAFT + 1
    engine = run.stdout.split(f"a verify of 1..{sizes} rows in steps: ")[1].splitlines()[0].split(", ")
    assert len(engine) == sizes and float(engine[0]) == 1.0 and all(float(c) >= 1.0 for c in engine)
    results = Path(run.stdout.split("wrote ")[1].strip())
    written = json.loads(results.read_text())
    results.unlink()
    assert [r["rows"] for r in written["rows"]] == [2, 3] and written["cpu"] == cpu.describe()


def test_step_share_splits_blocks_by_memory_phase_only_where_the_bandwidth_spans_a_fifth():
    from bench.step_share import phases

    def block(gbs, share):
        return {"bandwidth": gbs * 1e9, "share": share}

    steady = [block(45.0, 0.95), block(50.0, 0.93)]
    assert phases(steady) == {"one phase": steady}
    split = phases([block(45.0, 0.95), block(80.0, 0.78), block(50.0, 0.93), block(75.0, 0.80)])
    assert [b["share"] for b in split["slow phase"]] == [0.95, 0.93]
    assert [b["share"] for b in split["fast phase"]] == [0.78, 0.80]


def test_step_share_bench_reports_every_block_and_a_phase():
    """bench/step_share.py end to end on the embedded model (two short blocks: the shares are not asserted,
    only that each block and a phase's median are reported and written)."""
    run = subprocess.run([sys.executable, "-m", "bench.step_share", "--blocks", "2", "--steps", "2", "--context", "8"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1].strip() for line in run.stdout.splitlines() if line.startswith("| ") and "%" in line]
    assert rows == ["1", "2"]
    assert "phase (" in run.stdout and "of the bandwidth" in run.stdout
    results = Path(run.stdout.split("wrote ")[1].strip())
    written = json.loads(results.read_text())
    results.unlink()
    assert len(written["blocks"]) == 2 and 0 < written["step_bytes"] and written["phases"]
