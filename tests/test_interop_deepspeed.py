"""DeepSpeed JSON configs as fitgpt flags: real-world config shapes, notes, precedence, errors."""

import json

import pytest
from cli_refusal import run_in_process, run_main

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
    """Each "auto" leaves fitgpt's own default and names it; fp16/bf16 "auto" is --precision
    auto, never "neither enabled"; steps_per_print 2000 would hide progress: not taken."""
    out, built, notes = mapped(HF_TRAINER_ZERO3)
    assert out.values["train"] == {} and out.values["optim"] == {}
    assert "precision" not in out.values["precision"]  # "auto": --precision auto stays
    assert built["precision"] == PrecisionConfig()  # the scaler keys given are the defaults
    e = built["engine"]
    assert (e.zero_stage, e.offload_optimizer, e.offload_params) == (3, "cpu", "cpu")
    for key, default in [
        ("fp16.enabled", "--precision auto (bf16 on GPUs, fp32 on CPUs)"),
        ("bf16.enabled", "--precision auto"),
        ("optimizer.params.lr", "--lr by the model's width"),
        ("optimizer.params.betas", "--beta1 0.9 --beta2 0.95"),
        ("optimizer.params.weight_decay", "--weight-decay 0.1"),
        ("gradient_clipping", "--grad-clip 1"),
        ("gradient_accumulation_steps", "--grad-accum 1"),
        ("train_micro_batch_size_per_gpu", "--micro-batch 24"),
        ("scheduler.params.warmup_num_steps", "--warmup GPT-3's 375 M tokens"),
    ]:
        assert notes[key].startswith('"auto" (an HF Trainer placeholder)'), key
        assert default in notes[key], (key, notes[key])
    assert not any("neither" in n or "no block is enabled" in n for n in notes.values())
    assert "2000 not taken as --log-every" in notes["steps_per_print"]


@pytest.mark.parametrize(
    "blocks, precision, note",
    [
        ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": False}}, None, None),
        ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, None, "fp32 to match"),
        ({"fp16": {"enabled": False, "loss_scale": 0}, "bf16": {"enabled": True}}, "bf16", None),
        ({"bfloat16": {"enabled": True}}, "bf16", None),
        ({"fp16": {"enabled": True, "auto_cast": False}}, "fp16", None),
    ],
)
def test_precision_blocks(blocks, precision, note):
    out, _, notes = mapped(blocks)
    assert out.values["precision"].get("precision") == precision
    said = " ".join(notes.values())
    assert (note in said) if note else "fp32 to match" not in said
    if "loss_scale" in blocks.get("fp16", {}):
        assert notes["fp16.loss_scale"] == "ignored: fp16 is off"


@pytest.mark.parametrize(
    "zero, optimizer, offload_params",
    [
        ({"cpu_offload": True}, "cpu", None),
        ({"cpu_offload": True, "cpu_offload_params": True, "cpu_offload_use_pin_memory": True}, "cpu", "cpu"),
        ({"cpu_offload": False}, None, None),
        ({"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "nvme", None),
    ],
)  # fmt: skip
def test_older_cpu_offload_spellings(zero, optimizer, offload_params):
    out, _, notes = mapped({"zero_optimization": {"stage": 2, **zero}})
    eng = out.values["engine"]
    assert eng.get("offload_optimizer") == optimizer and eng.get("offload_params") == offload_params
    if "cpu_offload_use_pin_memory" in zero:
        assert "ignored" in notes["zero_optimization.cpu_offload_use_pin_memory"]
    if "offload_optimizer" in zero:
        assert "which wins" in notes["zero_optimization.cpu_offload"]


@pytest.mark.parametrize("every, log_every", [(10, 10), (100, 100), (101, None), (2000, None)])
def test_steps_per_print_is_taken_only_when_it_keeps_progress_visible(every, log_every):
    out, _, notes = mapped({"steps_per_print": every})
    assert out.values["train"].get("log_every") == log_every
    assert (log_every is None) == ("steps_per_print" in notes)


def test_bias_correction_false_is_not_supported_true_is_honoured():
    opt = {"type": "Adam", "params": {"bias_correction": False, "adam_w_mode": True}}
    out, _, notes = mapped({"optimizer": opt})
    assert notes["optimizer.params.bias_correction"] == (
        "false is not supported: fitgpt's AdamW always corrects bias"
    )
    assert "optimizer.params.adam_w_mode" in out.mapped  # true: what fitgpt does
    opt["params"]["bias_correction"] = True
    out, _, notes = mapped({"optimizer": opt})
    assert "optimizer.params.bias_correction" in out.mapped and not notes


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


def test_a_moe_block_names_fitgpts_own_experts():
    """DeepSpeed's "moe" block configures its own MoE layers, which fitgpt does not run; the
    note says where fitgpt's experts are instead (it said fitgpt had none, after Qwen3-MoE,
    Mixtral and gpt-oss had come)."""
    import importlib

    from fitgpt.model.families import TABLE, module

    moe = [n for n in TABLE if importlib.import_module(module(n, "family")).FAMILY.has_experts]
    _, _, notes = mapped({"moe": {"enabled": True, "ep_size": 2}})
    note = notes["moe"]
    assert moe and "cannot honour" in note and "--expert-parallel" in note
    assert all(n in note for n in moe), (moe, note)


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


def test_train_cli_takes_the_file_and_prints_each_note(tmp_path, capsys):
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
    code, out, err = run_main(
        capsys, "train", *argv, "--plan", "off", "--lr", "2e-3", "--out", str(tmp_path / "run"),
        "--deepspeed-config", str(ds),
    )  # fmt: skip
    assert code == 0, err
    lines = [x for x in out.splitlines() if x.startswith("--deepspeed-config")]
    assert "--micro-batch 2" in lines[0] and "--zero-stage 1" in lines[0]
    assert any("zero_optimization.overlap_comm: ignored" in x for x in lines)
    assert any("--lr: yours (0.002) wins over the file's (0.001)" in x for x in lines)
    # the same lines are kept with the run
    assert (tmp_path / "run" / "deepspeed_notes.txt").read_text().splitlines() == lines

    ds.write_text("{oops")
    code, err = run_in_process(capsys, "train", *argv, "--deepspeed-config", str(ds))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not valid JSON" in err and "Traceback" not in err


# Every key of DeepSpeed's documented config schema (deepspeed.ai/docs/config-json, its
# runtime/config.py and zero/config.py), with values of the documented types.
EVERY_KEY = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
            "bias_correction": True, "adam_w_mode": True, "amsgrad": False, "torch_adam": False,
        },
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
            "warmup_type": "linear", "total_num_steps": 100, "last_batch_iteration": -1,
        },
    },
    "communication_data_type": "fp32",
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "sparse_gradients": False,
    "fp16": {
        "enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
        "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": True, "immediate_grad_update": False, "check_grad_overflow": False},
    "amp": {"enabled": False, "opt_level": "O1"},
    "gradient_clipping": 1.0,
    "graph_harvesting": False,
    "zero_optimization": {
        "stage": 3, "allgather_partitions": True, "allgather_bucket_size": 5e8,
        "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
        "contiguous_gradients": True, "load_from_fp32_weights": True, "grad_hooks": True,
        "round_robin_gradients": False,
        "offload_param": {
            "device": "cpu", "nvme_path": "/nvme", "pin_memory": True, "buffer_count": 5,
            "buffer_size": 1e8, "max_in_cpu": 1e9,
        },
        "offload_optimizer": {
            "device": "cpu", "nvme_path": "/nvme", "pin_memory": True, "ratio": 1.0,
            "buffer_count": 4, "fast_init": False,
        },
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e5,
        "stage3_gather_16bit_weights_on_model_save": False, "sub_group_size": 1e9,
        "elastic_checkpoint": False, "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False, "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False, "zero_quantized_gradients": False,
        "cpu_offload": True, "cpu_offload_params": True, "cpu_offload_use_pin_memory": True,
        "ignore_unused_parameters": True, "legacy_stage1": False, "memory_efficient_linear": True,
        "log_trace_cache_warnings": False,
    },
    "aio": {
        "block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
        "single_submit": False, "overlap_events": True, "use_gds": False,
    },
    "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False,
        "contiguous_memory_optimization": False, "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False, "profile": False,
    },
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "dump_state": False,
    "memory_breakdown": False,
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "detailed": True},
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "x"},
    "wandb": {"enabled": False, "project": "x"},
    "csv_monitor": {"enabled": False, "output_path": ""},
    "comet": {"enabled": False},
    "comms_logger": {"enabled": False, "verbose": False},
    "elasticity": {"enabled": False, "max_train_batch_size": 2000},
    "autotuning": {"enabled": False},
    "compression_training": {"weight_quantization": {}},
    "data_efficiency": {"enabled": False},
    "curriculum_learning": {"enabled": False},
    "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False},
    "data_types": {"grad_accum_dtype": "fp32"},
    "pipeline": {"stages": "auto", "partition": "best"},
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "dataloader_drop_last": False,
    "sequence_parallel_size": 1,
    "hybrid_engine": {"enabled": False},
    "eigenvalue": {"enabled": False},
    "progressive_layer_drop": {"enabled": False},
    "timers": {"throughput": {"enabled": True, "synchronized": True}},
    "compile": {"disable": False},
    "torch_autocast": {"enabled": False},
    "weight_quantization": {"post_init_quant": {}},
    "nebula": {"enabled": False},
    "load_universal_checkpoint": False,
}  # fmt: skip


def leaves(cfg: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        path = f"{prefix}{k}"
        out += leaves(v, path + ".") if isinstance(v, dict) and v else [path]
    return out


@pytest.mark.parametrize("cfg", [EVERY_KEY, HF_TRAINER_ZERO3], ids=["every-key", "hf-trainer"])
def test_every_key_is_mapped_or_named(cfg):
    """Each key of the file is mapped to a flag (or honoured as fitgpt does), or named in a
    note; a note on a whole block (`aio`, `pipeline`) names what is inside it."""
    out, _, notes = mapped(cfg)
    named = set(out.mapped) | set(notes)
    unnamed = [
        leaf
        for leaf in leaves(cfg)
        if not any(leaf == k or leaf.startswith(k + ".") for k in named)
    ]
    assert unnamed == []
    assert out.values["engine"]["offload_optimizer"] == "cpu"  # cpu_offload and the block agree
