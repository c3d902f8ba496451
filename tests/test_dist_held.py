"""A checkpoint a reader holds (`fitgpt generate --interactive` on a run folder) is skipped by
the run's prune while held, and goes when the reader exits, also after the run has ended:
before, it stayed beyond --keep for good unless a later run in the folder saved again."""

import subprocess
import sys

import pytest
from test_checkpoint import ENV, TINY_ARGS, fitgpt

from fitgpt.train import checkpoint as ckpt_io


@pytest.mark.slow
def test_a_checkpoint_held_by_generate_goes_when_it_exits(tmp_path):
    out = tmp_path / "run"
    text = [a for a in TINY_ARGS if a not in ("synthetic", "--vocab-size", "96")]
    text[text.index("--data") + 1 : text.index("--data") + 1] = ["stdlib"]  # a tokenizer: bytes
    run = [*text, "--save-every", "1", "--keep", "1", "--out", str(out)]
    r = fitgpt("train", *run, "--steps", "2")  # one process: the reader needs a checkpoint
    assert r.returncode == 0, r.stderr
    reader = subprocess.Popen(
        [sys.executable, "-m", "fitgpt", "generate", "--ckpt", str(out), "--interactive",
         "--max-new-tokens", "2", "--device", "cpu"],
        env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "type a prompt" in reader.stderr.readline()  # step 2 read and held
        r = fitgpt("train", *run, "--gpus", "2", "--steps", "4", "--resume")  # rank 0 prunes
        assert r.returncode == 0, r.stderr
        # steps 3 and 4 saved, step 3 pruned, step 2 kept while generate holds it
        assert [d.name for d in ckpt_io.step_dirs(out)] == ["step_00000002", "step_00000004"]
        _, err = reader.communicate("stop\n", timeout=60)
    finally:
        reader.kill()
    assert reader.returncode == 0, err
    assert [d.name for d in ckpt_io.step_dirs(out)] == ["step_00000004"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", ".step_"))) == [
        "step_00000004"
    ]
