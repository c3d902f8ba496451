import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import TINY, assembled, run_config, train

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.scaler import LossScaler
from fitgpt.engine.state_io import CorruptCheckpoint
from fitgpt.errors import UserError
from fitgpt.train.loop import Trainer

CPU = DistContext(0, 1, 0, torch.device("cpu"))


def batches(n, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (n * b, TINY.seq_len + 1), generator=g)
    return [(x[i * b : (i + 1) * b, :-1], x[i * b : (i + 1) * b, 1:]) for i in range(n)]


def engine(ecfg=None, pcfg=None, ocfg=None):
    return build_engine(
        TINY,
        ecfg or EngineConfig(engine="ddp"),
        pcfg or PrecisionConfig(precision="fp32"),
        ocfg or OptimConfig(),
        CPU,
        seed=0,
    )


def weights(e):
    return {n: p.detach().clone() for n, p in e.inference_model().named_parameters()}


def test_loss_falls_on_synthetic_data(tmp_path):
    out = train(
        run_config(tmp_path, steps=150, micro_batch=8, lr=1e-2, min_lr=1e-3, log_every=50), CPU
    )
    first, last = sum(out["losses"][:5]) / 5, sum(out["losses"][-5:]) / 5
    assert last < first - 1.0, (first, last)


def test_grad_accumulation_4x2_equals_1x8():
    big = batches(1, 8)
    x, y = big[0]
    small = [(x[i * 2 : (i + 1) * 2], y[i * 2 : (i + 1) * 2]) for i in range(4)]
    a, b = engine(), engine()
    sa = a.train_step(big, 1e-3)
    sb = b.train_step(small, 1e-3)
    assert abs(sa.loss - sb.loss) < 1e-5 and abs(sa.grad_norm - sb.grad_norm) < 1e-5
    # atol 1e-5 (1% of one step of lr 1e-3): Adam's first step is lr·g/(|g|+eps), so an element
    # whose gradient is near eps (1e-8, the rounding left of a cancelling sum) moves by an amount
    # that depends on that rounding; a wrong accumulation moves every element by ~lr.
    for (n, p), q in zip(weights(a).items(), weights(b).values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=n)


def test_activation_checkpointing_gives_the_same_gradients():
    data = batches(2, 4)
    plain, ckpt = engine(), engine(EngineConfig(engine="ddp", checkpointing="full"))
    for _ in range(2):
        s1, s2 = plain.train_step(data, 1e-3), ckpt.train_step(data, 1e-3)
        assert s1.grad_norm == pytest.approx(s2.grad_norm, rel=1e-6)
    for (n, p), q in zip(weights(plain).items(), weights(ckpt).values()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_scaler_halves_after_hysteresis_skips_and_grows_after_window():
    s = LossScaler(
        PrecisionConfig(precision="fp16", initial_scale=1024, growth_interval=3, hysteresis=2)
    )
    s.update(overflow=True)
    assert s.scale == 1024 and s.skipped == 1  # first overflow absorbed by hysteresis
    s.update(overflow=True)
    assert s.scale == 512 and s.skipped == 2
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 512
    s.update(overflow=False)
    assert s.scale == 1024  # grew after 3 clean steps
    bf16 = LossScaler(PrecisionConfig(precision="bf16"))
    bf16.update(overflow=True)
    assert bf16.scale == 1.0


def test_fp16_overflow_skips_the_update():
    e = engine(pcfg=PrecisionConfig(precision="fp16", initial_scale=2.0**100, hysteresis=1))
    before = weights(e)
    stats = e.train_step(batches(1, 2), 1e-3)
    assert stats.skipped and e.scaler.scale == 2.0**99
    for n, p in weights(e).items():
        assert torch.equal(p, before[n]), n


def test_resume_continues_exactly(tmp_path):
    cfg = run_config(
        tmp_path, steps=12, save_every=6, dropout=0.1
    )  # dropout: RNG state matters too
    full = train(cfg, CPU)
    shutil.rmtree(tmp_path / "step_00000012")  # as if the run had died after step 6's checkpoint
    resumed = train(cfg, CPU, resume="")
    assert resumed["losses"] == full["losses"][6:]


def test_existing_run_is_not_overwritten_by_accident(tmp_path):
    train(run_config(tmp_path, steps=2), CPU)
    with pytest.raises(UserError, match="already holds checkpoints"):
        train(run_config(tmp_path, steps=2), CPU)


def test_corrupted_checkpoint_is_refused_and_previous_kept(tmp_path):
    train(run_config(tmp_path, steps=4, save_every=2), CPU)
    good, bad = tmp_path / "step_00000002", tmp_path / "step_00000004"
    # flip one byte inside a tensor: the size is right, the CRC is not
    f = sorted(bad.glob("c0000-*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(
        CorruptCheckpoint, match=r"CRC.*previous good checkpoint is .*step_00000002"
    ):
        train(run_config(tmp_path, steps=6), CPU, resume="")
    # truncation is caught from the recorded sizes before anything is read
    f.write_bytes(bytes(data[:100]))
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        train(run_config(tmp_path, steps=6), CPU, resume=str(bad))
    assert (good / "meta.json").is_file()
    resumed = train(run_config(tmp_path, steps=6), CPU, resume=str(good))
    assert len(resumed["losses"]) == 4


def test_resume_with_another_architecture_is_refused(tmp_path):
    train(run_config(tmp_path, steps=2), CPU)
    with pytest.raises(UserError, match="another architecture"):
        train(run_config(tmp_path, steps=4, n_layer=3), CPU, resume="")


def test_metrics_jsonl_has_a_line_per_log_interval(tmp_path):
    train(run_config(tmp_path, steps=10, log_every=5, eval_every=5, eval_batches=2), CPU)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in lines if r["kind"] == "train"]
    assert [r["step"] for r in train_lines] == [5, 10]
    assert {"loss", "lr", "grad_norm", "ms_per_step", "tokens_per_s"} <= set(train_lines[0])
    assert any(r["kind"] == "eval" and r["val_loss"] > 0 for r in lines)


# What a real process shows for a user error: exit 2, one stderr line. Two commands, a flag and
# a path refused; every refusal's line is a case of tests/test_cli_bad_inputs.py (in this
# process, through the same fitgpt.cli.main), among them the preset, the heads and --steps 0.
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--data", "/no/such/prefix"], "--data /no/such/prefix"),
        (["generate", "--ckpt", "/no/such/run"], "does not exist"),
    ],
)
def test_user_errors_are_one_line_without_traceback(argv, needle):
    r = subprocess.run(
        [sys.executable, "-m", "fitgpt", *argv], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_export_writes_whole_parameters_that_reload(tmp_path):
    from safetensors.torch import load_file

    from fitgpt.model import GPT

    train(run_config(tmp_path / "run", steps=3, engine="zero", zero_stage=1), CPU)
    out = tmp_path / "model.safetensors"
    from fitgpt.cli import main  # the command's own path, in this process

    with pytest.raises(SystemExit) as done:
        main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(out)])
    assert done.value.code in (0, None)
    model = GPT(TINY)
    model.load_state_dict(load_file(out))
    from fitgpt.infer.generate import load_model

    ref, _ = load_model(tmp_path / "run", torch.device("cpu"))
    x = torch.randint(0, TINY.vocab_size, (1, 8))
    torch.testing.assert_close(model(x), ref(x))


def test_train_records_carry_the_step_breakdown(tmp_path):
    # an offloaded run: each record has the last step's phases and the host optimizer's seconds
    # per step since the record before, so the records add up to the worker's run total when the
    # last one was written (no more than its final total: the last step's host work may finish
    # after it; per-step figures that kept the run totals in would add up to about twice that)
    cfg = run_config(tmp_path, steps=6, log_every=2, engine="zero", offload_optimizer="cpu")
    trainer = Trainer(assembled(cfg, CPU))
    trainer.fit()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in recs] == [2, 4, 6]
    for r in recs:
        assert r["forward_backward_s"] > 0 and r["update_s"] >= 0
        assert r["host_adamw_busy_s"] > 0 and r["host_wait_s"] >= 0 and r["slot_wait_s"] >= 0
    total = trainer.engine.breakdown()["host_adamw_busy_total"]
    assert 0 < sum(2 * r["host_adamw_busy_s"] for r in recs) <= total
