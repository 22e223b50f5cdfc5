"""bench/common.py: what every benchmark script shares."""
import json

from bench import common
from tornchat.engine import cpu


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
