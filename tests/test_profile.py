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


def test_a_run_stopped_inside_the_window_ends_the_profiler(tmp_path, monkeypatch):
    """An error in a profiled step ends the profile (nothing written, the profiler off), so the
    process can profile again."""
    import torch

    from fitgpt.train import loop

    real = loop.Trainer.step_once

    def fails_at_5(self, micro=None):
        if self.step == 4:
            raise RuntimeError("out of memory (injected)")
        return real(self, micro)

    monkeypatch.setattr(loop.Trainer, "step_once", fails_at_5)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected"):
        main([*TRAIN, "--steps", "8", "--profile", "3", "--out", str(out)])
    assert not (out / "profile").exists()
    assert not torch.autograd.profiler._is_profiler_enabled
    monkeypatch.undo()
    train("--steps", "5", "--profile", "1", "--out", str(tmp_path / "again"))
    assert (tmp_path / "again" / "profile" / "trace.json").is_file()


def test_a_resumed_run_does_not_profile_again_unless_asked(tmp_path, capsys):
    out = tmp_path / "run"
    train("--steps", "4", "--profile", "1", "--save-every", "2", "--out", str(out))
    trace = out / "profile" / "trace.json"
    first = trace.stat().st_mtime_ns
    capsys.readouterr()
    with pytest.raises(SystemExit):  # (TRAIN has --no-save: resume through the saved config)
        main(["train", "--out", str(out), "--resume", "--steps", "6"])
    assert "profile of steps" not in capsys.readouterr().out
    assert trace.stat().st_mtime_ns == first


def test_union_of_kernel_spans_counts_overlap_once():
    from fitgpt.train.profile import _union_us

    assert _union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert _union_us([]) == 0
