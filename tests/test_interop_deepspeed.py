"""DeepSpeed JSON configs as fitgpt flags: real-world config shapes, notes, precedence, errors."""

import json
import subprocess
import sys

import pytest

from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.scaler import LossScaler
from fitgpt.errors import UserError
from fitgpt.interop.deepspeed import apply_deepspeed_config, map_deepspeed
from fitgpt.train.config import TrainConfig

CLASSES = {
    "train": TrainConfig,
    "engine": EngineConfig,
    "precision": PrecisionConfig,
    "optim": OptimConfig,
}


def mapped(cfg: dict, world: int = 1):
    out = map_deepspeed(cfg, "ds.json", world)
    # every mapping must make valid configs: the same validation the flags go through
    # --offload-fraction is a command-line share that the CLI turns into --offload-blocks
    fields = {
        p: {k: x for k, x in v.items() if k != "offload_fraction"} for p, v in out.values.items()
    }
    built = {p: CLASSES[p](**v) for p, v in fields.items()}
    return out, built, {n.key: n.reason for n in out.notes}


def test_zero2_with_cpu_optimizer_offload():
    out, built, notes = mapped(
        {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 4,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": 5e8,
                "allgather_bucket_size": 5e8,
            },
            "gradient_clipping": 1.0,
            "steps_per_print": 10,
            "wall_clock_breakdown": False,
        }
    )
    assert out.values["train"] == {"micro_batch": 8, "grad_accum": 4, "log_every": 10}
    assert out.values["engine"] == {"engine": "zero", "zero_stage": 2, "offload_optimizer": "cpu"}
    assert built["precision"].precision == "bf16" and built["optim"].grad_clip == 1.0
    for key in (
        "zero_optimization.overlap_comm",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.offload_optimizer.pin_memory",
        "wall_clock_breakdown",
    ):
        assert "ignored" in notes[key]


def test_zero3_nvme_offload_of_params_and_optimizer_derives_accumulation():
    out, built, notes = mapped(
        {
            "train_batch_size": 64,
            "train_micro_batch_size_per_gpu": 4,
            "fp16": {"enabled": False},
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "ratio": 0.5},
                "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "max_in_cpu": 1e9},
                "stage3_max_live_parameters": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True,
            },
            "aio": {"block_size": 1048576, "queue_depth": 8},
        },
        world=2,
    )
    assert out.values["train"] == {"micro_batch": 4, "grad_accum": 8}  # 64 = 4 x 8 x 2 ranks
    e = built["engine"]
    assert (e.engine, e.zero_stage, e.offload_optimizer, e.offload_params) == (
        "zero",
        3,
        "nvme",
        "cpu",
    )
    assert e.nvme_path == "/local_nvme" and out.values["engine"]["offload_fraction"] == 0.5
    assert "host RAM" in notes["zero_optimization.offload_param.device"]
    assert "own I/O" in notes["aio"]
    assert "zero_optimization.stage3_max_live_parameters" in notes


def test_fp16_loss_scale_keys_reach_the_scaler():
    _, built, notes = mapped(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "loss_scale_window": 500,
                "initial_scale_power": 12,
                "hysteresis": 4,
                "min_loss_scale": 2,
                "consecutive_hysteresis": False,
            }
        }
    )
    p = built["precision"]
    assert (p.precision, p.initial_scale, p.growth_interval, p.hysteresis, p.min_scale) == (
        "fp16",
        4096.0,
        500,
        4,
        2.0,
    )
    scaler = LossScaler(p)
    for _ in range(4):  # four overflows halve the scale once (hysteresis 4), never below 2
        scaler.update(True)
    assert scaler.scale == 2048.0
    assert set(notes) == {"fp16.consecutive_hysteresis"}


HF_TRAINER_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_hf_trainer_config_with_auto_values():
    out, built, notes = mapped(HF_TRAINER_ZERO3)
    assert out.values["train"] == {"log_every": 2000}  # every "auto" is left to fitgpt
    assert out.values["optim"] == {} and "precision" not in out.values["precision"]
    e = built["engine"]
    assert (e.zero_stage, e.offload_optimizer, e.offload_params) == (3, "cpu", "cpu")
    auto_note = next(k for k in notes if "train_batch_size" in k)
    for key in ("fp16.enabled", "optimizer.params.lr", "gradient_clipping", "scheduler.params"):
        assert key in auto_note
    assert "HF Trainer" in notes[auto_note]


@pytest.mark.parametrize(
    "scheduler, expect",
    [
        (
            {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 6e-4}},
            {"lr": 6e-4, "min_lr": 1e-5},
        ),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4}}, {"lr": 3e-4, "min_lr": 3e-4}),
        (
            {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1}},
            {"lr": 3e-4, "min_lr": 3e-5},
        ),
    ],
)
def test_optimizer_and_scheduler_blocks(scheduler, expect):
    scheduler["params"] |= {
        "warmup_num_steps": 100,
        "total_num_steps": 1000,
        "warmup_type": "linear",
    }
    _, built, notes = mapped(
        {
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01},
            },
            "scheduler": scheduler,
        }
    )
    t, o = built["train"], built["optim"]
    assert (t.warmup, t.steps) == (100, 1000)
    assert t.lr == pytest.approx(expect["lr"]) and t.min_lr == pytest.approx(expect["min_lr"])
    assert (o.beta1, o.beta2, o.eps, o.weight_decay) == (0.9, 0.98, 1e-6, 0.01)
    if scheduler["type"] == "WarmupDecayLR":
        assert "cosine" in notes["scheduler.type"]


def test_other_optimizers_and_schedulers_are_named_not_honoured():
    _, _, notes = mapped(
        {
            "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
            "scheduler": {"type": "OneCycle", "params": {}},
        }
    )
    assert "AdamW" in notes["optimizer.type"] and "cosine" in notes["scheduler.type"]


@pytest.mark.parametrize(
    "cfg, train",
    [
        ({"train_batch_size": 32}, {"micro_batch": 32, "grad_accum": 1}),
        ({"train_micro_batch_size_per_gpu": 4}, {"micro_batch": 4}),
        (
            {"train_batch_size": 32, "gradient_accumulation_steps": 4},
            {"micro_batch": 8, "grad_accum": 4},
        ),
    ],
)
def test_minimal_configs(cfg, train):
    out, _, notes = mapped(cfg)
    assert out.values["train"] == train and notes == {}


def test_unknown_and_unsupported_keys_are_named():
    _, _, notes = mapped(
        {
            "zero_optimization": {"stage": 1, "shiny_new_knob": 2, "zero_quantized_weights": True},
            "pipeline": {"stages": 4},
            "my_own_key": 1,
        }
    )
    assert notes["my_own_key"] == "unknown key: ignored"
    assert notes["zero_optimization.shiny_new_knob"] == "unknown key: ignored"
    assert "cannot honour" in notes["zero_optimization.zero_quantized_weights"]
    assert "pipeline" in notes["pipeline"]


def test_explicit_flags_win_over_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 2},
                "gradient_clipping": 0.5,
            }
        )
    )
    changes, notes = apply_deepspeed_config(
        path, {"train": {"micro_batch": 2}, "engine": {"zero_stage": 2}}, world=1
    )
    assert changes["train"] == {"grad_accum": 2}  # micro_batch stays the typed 2
    assert changes["engine"] == {"engine": "zero"} and changes["optim"] == {"grad_clip": 0.5}
    assert "--micro-batch: yours (2) wins over the file's (8)" in notes
    assert not any("zero-stage" in n for n in notes)  # same value typed: nothing to say


def test_explicit_flags_enter_the_batch_derivation(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}))
    changes, _ = apply_deepspeed_config(path, {"train": {"micro_batch": 4}}, world=2)
    assert changes["train"] == {"grad_accum": 8}  # 64 / (4 x 2 ranks)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"train_micro_batch_size_per_gpu": "eight"}', "train_micro_batch_size_per_gpu: expected"),
        ('{"zero_optimization": {"stage": 5}}', "zero_optimization.stage"),
        ('{"zero_optimization": []}', "zero_optimization: expected a JSON object"),
        ('{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', "both true"),
        ('{"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}', "optimizer.params.betas"),
        (
            '{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, '
            '"gradient_accumulation_steps": 2}',
            "train_batch_size 30 != ",
        ),
        ('{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}', "not a multiple"),
    ],
)
def test_bad_files_are_one_line_errors_naming_file_and_key(tmp_path, text, needle):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        apply_deepspeed_config(path, {}, world=1)
    assert needle in str(e.value) and "ds.json" in str(e.value) and "\n" not in str(e.value)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot read it"):
        apply_deepspeed_config(tmp_path / "nope.json", {}, world=1)


def test_train_cli_takes_the_file_and_prints_each_note(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 1, "overlap_comm": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            }
        )
    )
    tiny = "--layers 2 --hidden 32 --heads 4 --seq-len 16 --vocab-size 64 --data synthetic"
    argv = [*tiny.split(), "--steps", "2", "--eval-every", "0", "--no-save", "--device", "cpu"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fitgpt",
            "train",
            *argv,
            "--plan",
            "off",
            "--lr",
            "2e-3",
            "--out",
            str(tmp_path / "run"),
            "--deepspeed-config",
            str(ds),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("--deepspeed-config")]
    assert "--micro-batch 2" in lines[0] and "--zero-stage 1" in lines[0]
    assert any("zero_optimization.overlap_comm: ignored" in x for x in lines)
    assert any("--lr: yours (0.002) wins over the file's (0.001)" in x for x in lines)

    ds.write_text("{oops")
    r = subprocess.run(
        [sys.executable, "-m", "fitgpt", "train", *argv, "--deepspeed-config", str(ds)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "not valid JSON" in r.stderr and "Traceback" not in r.stderr
