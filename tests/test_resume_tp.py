"""`--tensor-parallel T` across a resume, by the fitgpt command on real files: the tiny model
trained 2 steps at T = 2 over 2 gloo ranks and saved, then `--resume` on one process without
typing T again, planned and with --plan off: the losses of one process's run throughout. T
splits the weights' columns, and checkpoints hold whole tensors (transforms/tp_state.py), so a
saved T that does not divide the new rank count is no reason to refuse the resume; a T typed
again is the user's and is checked as given.

Before 2026-11-28 both resumes were refused ("--tensor-parallel 2 does not divide the rank
count (--gpus), 1"), the flag never typed on the resume."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_refusal import run_main
from helpers import fitgpt_rank
from test_checkpoint import TINY_ARGS

STEPS = 4


def losses(run) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run saved at step 2 by 2 ranks at T = 2, and one process's uninterrupted losses (the
    same rows: T ranks read the same batch)."""
    from conftest import run_gloo

    from fitgpt.cli import main

    root = tmp_path_factory.mktemp("tp_resume")
    run_gloo(2, fitgpt_rank, ["train", *TINY_ARGS, "--log-every", 1, "--tensor-parallel", "2", "--steps", 2,
                              "--save-every", 2, "--out", root / "tp2"])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in ["train", *TINY_ARGS, "--log-every", 1, "--steps", STEPS, "--no-save", "--out",
                               root / "one"]])  # fmt: skip
    assert e.value.code in (0, None)
    return root, losses(root / "one")


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["auto", "off"])
def test_a_run_saved_at_t2_resumes_on_one_process_without_typing_t(saved, capsys, tmp_path, plan):
    root, want = saved
    run = tmp_path / "run"
    shutil.copytree(root / "tp2", run)
    code, out, err = run_main(capsys, "train", "--out", run, "--resume", "--steps", STEPS,
                              "--plan", plan)  # fmt: skip
    assert code == 0, err
    assert "world size 2 → 1" in out and "--tensor-parallel 2 → 1" in out, out
    got = losses(run)
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


@pytest.mark.slow
def test_a_t_typed_again_on_the_resume_is_checked_as_given(saved, capsys, tmp_path):
    root, _ = saved
    run = tmp_path / "run"
    shutil.copytree(root / "tp2", run)
    code, _, err = run_main(capsys, "train", "--out", run, "--resume", "--steps", STEPS,
                            "--tensor-parallel", "2")  # fmt: skip
    assert code != 0 and "--tensor-parallel 2 does not divide the rank count" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("tp, world, kept", [(4, 2, False), (4, 6, False), (2, 4, False),
                                             (4, 2, True)])  # fmt: skip
def test_a_saved_t_is_fitted_to_a_divisor_of_the_ranks_and_of_itself(tp, world, kept):
    from fitgpt.train.resume import fit_degree

    t, notes = fit_degree("--tensor-parallel", tp, world, kept)
    if kept or world % tp == 0:
        assert (t, notes) == (tp, [])
    else:
        assert world % t == 0 and tp % t == 0 and len(notes) == 1
