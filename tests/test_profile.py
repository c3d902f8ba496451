"""`fitgpt train --profile N`: the profiled steps, the files in the run folder, the log line."""

import json

import pytest

from fitgpt.cli import main

TRAIN = [
    "train", "--preset", "tiny", "--layers", "2", "--hidden", "32", "--heads", "2",
    "--seq-len", "16", "--micro-batch", "2", "--device", "cpu", "--data", "synthetic",
    "--vocab-size", "64", "--no-save", "--eval-every", "0", "--log-every", "1",
]  # fmt: skip


def train(*args: str) -> None:
    with pytest.raises(SystemExit) as done:
        main([*TRAIN, *args])
    assert done.value.code in (0, None)


def test_profile_writes_a_trace_and_a_table_of_the_steps_after_the_first_three(tmp_path, capsys):
    out = tmp_path / "run"
    train("--steps", "7", "--profile", "2", "--out", str(out))
    log = capsys.readouterr().out
    assert "profile of steps 4-5: 2 step(s)" in log and str(out / "profile") in log
    trace = json.loads((out / "profile" / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)  # the ops of a real step
    table = (out / "profile" / "summary.txt").read_text()
    assert table.startswith("2 step(s)") and "aten::" in table
    assert not list((out / "profile").glob("*.tmp"))  # written through temporary names
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in steps if r["kind"] == "train") == 7  # the run went on


def test_a_run_shorter_than_the_warm_up_profiles_its_last_steps(tmp_path, capsys):
    out = tmp_path / "run"
    train("--steps", "3", "--profile", "2", "--out", str(out))
    assert "profile of steps 2-3" in capsys.readouterr().out
    assert (out / "profile" / "trace.json").is_file()


def test_no_profile_by_default(tmp_path):
    out = tmp_path / "run"
    train("--steps", "2", "--out", str(out))
    assert not (out / "profile").exists()
