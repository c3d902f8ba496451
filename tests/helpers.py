"""Tiny configs for fast CPU tests, and the engines' two-rank training comparison."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from fitgpt.data.config import DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.model import ModelConfig
from fitgpt.train.config import RunConfig, TrainConfig

TINY = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=32, vocab_size=96)


# the C++ compiler TorchInductor (and CPU FlexAttention) compiles CPU code with; None: none here
CXX = shutil.which("g++") or shutil.which("c++")


def run_config(out, **overrides) -> RunConfig:
    """A tiny synthetic-data run; overrides go to the sub-config that has the field."""
    parts = {
        "model": TINY,
        "data": DataConfig(data="synthetic"),
        "train": TrainConfig(
            steps=10,
            micro_batch=4,
            grad_accum=1,
            lr=3e-3,
            min_lr=3e-4,
            warmup=2,
            eval_every=0,
            log_every=5,
            out=str(out),
            device="cpu",
        ),
        "engine": EngineConfig(engine="ddp"),
        "precision": PrecisionConfig(precision="fp32"),
        "optim": OptimConfig(),
    }
    per_part: dict[str, dict] = {}
    for key, value in overrides.items():
        for name, cfg in parts.items():
            if key in {f.name for f in dataclasses.fields(cfg)}:
                per_part.setdefault(name, {})[key] = value
                break
        else:
            raise KeyError(key)
    # one replace per sub-config: its checks see every override together
    for name, fields in per_part.items():
        parts[name] = dataclasses.replace(parts[name], **fields)
    return RunConfig(**parts)


def assembled(config: RunConfig, ctx, **settings):
    """`config` assembled on `ctx` the one way (train/assemble.py): as given (--plan off) unless
    `settings` say otherwise (fixed, force, resume, init_from, overwrite, ...)."""
    from fitgpt.train.assemble import Settings, assemble

    return assemble(Settings(config, **settings), ctx, log=lambda *_: None)


def train(config: RunConfig, ctx, **settings) -> dict:
    """fitgpt.train.loop.train on `config` assembled on `ctx` (`assembled`)."""
    from fitgpt.train.loop import train as train_run

    return train_run(assembled(config, ctx, **settings))


def step_batches(e, model_cfg, step: int) -> list:
    """Step `step`'s 2 micro-batches of a global batch of 8 rows for engine e's rank:
    data-parallel rank d takes rows [d·b, (d+1)·b) (every rank of a TP group the same rows)."""
    import torch

    dp, d = (e.ctx.dp_world, e.ctx.dp_rank) if e.ctx.distributed else (1, 0)
    b = 8 // dp
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, model_cfg.vocab_size, (16, model_cfg.seq_len + 1), generator=g)
    micro = [x[m * 8 : (m + 1) * 8][d * b : (d + 1) * b] for m in range(2)]
    return [(r[:, :-1], r[:, 1:]) for r in micro]


def engine_losses(model_cfg, ecfg: EngineConfig, ctx, steps: int, clip: float) -> dict:
    """`steps` steps of 2 micro-batches of a global batch of 8 rows through build_engine (fp32,
    gradients clipped at `clip`); data-parallel rank d takes rows [d·b, (d+1)·b) (every rank of a
    TP group the same rows). The losses, gradient norms, the model's parameter shapes and module
    classes, and the engine's memory report."""

    from fitgpt.engine.factory import build_engine

    ctx = ctx.laid_out(ecfg.tensor_parallel, ecfg.context_parallel, ecfg.expert_parallel)
    e = build_engine(
        model_cfg, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(grad_clip=clip), ctx
    )
    out = {"loss": [], "norm": []}
    for step in range(steps):
        st = e.train_step(step_batches(e, model_cfg, step), 3e-3)
        out["loss"].append(st.loss)
        out["norm"].append(st.grad_norm)
    out["shapes"] = {n: list(p.shape) for n, p in e.model.named_parameters()}
    out["classes"] = sorted({type(m).__name__ for m in e.model.modules()})
    out["mem"] = e.memory_report()
    e.close()
    return out


# world 2: data parallel over both ranks, or TP 2 (one data-parallel rank)
TWO_RANK_ENGINES = {
    "ddp": EngineConfig(engine="ddp"),
    "zero1": EngineConfig(engine="zero", zero_stage=1),
    "zero2": EngineConfig(engine="zero", zero_stage=2, checkpointing="full"),
    "zero3": EngineConfig(engine="zero", zero_stage=3),
    "zero3_offload_stream": EngineConfig(engine="zero", zero_stage=3, offload_optimizer="cpu",
                                         offload_blocks=1, offload_params="cpu"),
    "tp2_ddp": EngineConfig(engine="ddp", tensor_parallel=2),
    "tp2_zero1_offload": EngineConfig(engine="zero", zero_stage=1, tensor_parallel=2,
                                      offload_optimizer="cpu", offload_blocks=1),
    "tp2_zero2_sp": EngineConfig(engine="zero", zero_stage=2, tensor_parallel=2,
                                 sequence_parallel=True),
}  # fmt: skip


def two_rank_losses(runs: dict, tmp: str, steps: int, clip: float) -> None:
    """Inside each rank of a world-2 gloo job (conftest's gloo): for each name -> (model
    config, keys of TWO_RANK_ENGINES) of `runs`, engine_losses of every engine named; rank 0
    writes {name: {key: result}} to tmp/results.json. A test-defined family must be registered
    in the worker's process: call this from a worker function of the module that defines it."""
    from fitgpt.dist import init_distributed

    ctx = init_distributed("cpu")
    res = {
        name: {key: engine_losses(cfg, TWO_RANK_ENGINES[key], ctx, steps, clip) for key in keys}
        for name, (cfg, keys) in runs.items()
    }
    if ctx.rank == 0:
        (Path(tmp) / "results.json").write_text(json.dumps(res))


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def full_tp_grads(tp_model, mesh, split, sp: bool) -> dict:
    """Each parameter's gradient of a tensor-parallel model, gathered over its TP group of 2
    and unsharded into the full parameter's shape; under sequence parallelism the replicated
    parameters' gradients are first summed over the group, as the engines do."""
    import torch
    import torch.distributed as dist

    from fitgpt.engine.transforms.tp_state import sync_replicated
    from fitgpt.parallel.shard import unshard

    if sp:
        sync_replicated([p.grad for n, p in tp_model.named_parameters() if split(n) is None], mesh)
    full = {}
    for name, p in tp_model.named_parameters():
        parts = [torch.empty_like(p.grad) for _ in range(2)]
        dist.all_gather(parts, p.grad.contiguous())
        full[name] = unshard(split(name), parts)
    return full


def fitgpt_rank(rank: int, world: int, argv: list) -> None:
    """`fitgpt ARGV` in one rank of a gloo job (conftest's run_gloo): the command's own path at
    world size `world`, as torchrun would start it. Here, not in the test's module, so a worker
    imports nothing more (transformers costs each one ~1 s of CPU). The run ends the job's
    process group: one job a run."""
    from fitgpt.cli import main

    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"fitgpt {' '.join(map(str, argv))}: exit status {e.code}") from e


def saved_hf_models(build, cases, root: Path) -> dict:
    """{name: (model, folder)}: each case's transformers model, `build(name)`, saved under
    `root` by save_pretrained (the interop tests' module fixtures: one build and save each)."""
    out = {}
    for name in cases:
        model = build(name)
        model.save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


def tiny_llama_folder(root: Path, vocab: int) -> Path:
    """A 3-layer Llama of width 64 (8 query heads, 2 kv heads) with random weights (seed 0),
    saved by transformers under `root`/llama: the frozen-base tests' module fixture."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = root / "llama"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def imported_runs(hf_folders: dict, root: Path) -> dict:
    """{name: run folder}: each saved folder imported once by `fitgpt import` (interop/hf.py)."""
    from fitgpt.interop.hf_import import import_hf

    return {n: import_hf(folder, root / n).ckpt.parent for n, (_, folder) in hf_folders.items()}


def tensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors files, by name."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            out |= {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (no dict)
    return out


def assert_config_carried(source: Path, export: Path, skip: tuple[str, ...] = ()) -> None:
    """Every field transformers reads from `source`'s config.json has the same value in
    `export`'s (interop/carried.py), but those naming how the files were stored or written,
    and `skip`."""
    from transformers import AutoConfig

    from fitgpt.interop.carried import STORAGE

    src, out = (
        AutoConfig.from_pretrained(p, local_files_only=True).to_dict() for p in (source, export)
    )
    differ = {
        k: (v, out.get(k)) for k, v in src.items() if k not in (*STORAGE, *skip) and out.get(k) != v
    }
    assert not differ, differ
