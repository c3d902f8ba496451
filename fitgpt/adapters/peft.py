"""PEFT's adapter folder, written and read: what `peft.PeftModel.from_pretrained(model, DIR)`
loads, and what `fitgpt train --init-from BASE --lora-from DIR` goes on training.

  adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
                              use_rslora, fan_in_fan_out (GPT-2's Conv1D), bias none, the base
  adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight [r, in] and
                              .lora_B.weight [out, r] for every target (PEFT's saved names:
                              get_peft_model_state_dict drops the adapter's name)

Refused on reading, in one line naming the key: what changes what PEFT computes beyond plain
LoRA on linears (DoRA, biases, per-layer ranks or alphas, a layer subset, modules trained whole,
a target given as a regular expression, an initialisation that rewrites the base such as PiSSA),
a missing, extra or misshapen tensor, a value that is not finite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from fitgpt.adapters.config import ALL_LINEAR, PEFT_CONFIG_FILE, AdapterConfig, flag, same
from fitgpt.adapters.lora import param_names
from fitgpt.adapters.targets import Target, lora_targets
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig

CONFIG_FILE = PEFT_CONFIG_FILE
WEIGHTS_FILE = "adapter_model.safetensors"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes taken
PREFIX = "base_model.model."  # PeftModel's own name for the model it wraps
# keys of adapter_config.json that, set, make PEFT compute more than plain LoRA on linears
UNSUPPORTED = (
    "use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "layers_to_transform",
    "layers_pattern", "exclude_modules", "modules_to_save", "trainable_token_indices",
    "layer_replication", "target_parameters", "use_qalora", "alora_invocation_tokens",
    "use_bdlora", "arrow_config", "kasa_config", "velora_config", "monteclora_config",
)  # fmt: skip
# init_lora_weights values that draw A and B alone, the base untouched (B·A need not start at
# zero: orthogonal's, MiCA's); the folder's saved A and B are then plain LoRA. The others
# (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ) subtract their start from the base's weights, which a
# folder does not hold.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")


def peft_key(t: Target, which: str) -> str:
    """The name PEFT saves target `t`'s lora_A or lora_B under."""
    return f"{PREFIX}{t.hf}.lora_{which}.weight"


def adapter_config_json(adapter: AdapterConfig, targets: list[Target], base: str | None) -> dict:
    """adapter_config.json of `adapter` over `targets`. all-linear is written as the module
    names it found (PEFT writes its expansion the same way)."""
    names = adapter.target_names or list(dict.fromkeys(t.name for t in targets))
    alpha = adapter.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": adapter.lora_rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": adapter.lora_dropout,
        "target_modules": list(names),
        "use_rslora": adapter.lora_rslora,
        "fan_in_fan_out": any(t.conv1d for t in targets),  # PEFT's flag for GPT-2's Conv1D
        "bias": "none",
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft(
    folder: Path,
    adapter: AdapterConfig,
    targets: list[Target],
    tensors: dict[str, Tensor],
    dtype: torch.dtype,
    base: str | None,
) -> int:
    """adapter_config.json and adapter_model.safetensors into `folder` (which exists: the
    caller's temporary one); `tensors`: A and B by their fitgpt names. The values written."""
    out = {}
    for t in targets:
        a, b = param_names(t)
        out[peft_key(t, "A")] = tensors[a].to(dtype).contiguous()
        out[peft_key(t, "B")] = tensors[b].to(dtype).contiguous()
    save_file(out, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config_json(adapter, targets, base)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return sum(t.numel() for t in out.values())


def _config_file(folder: Path) -> tuple[Path, dict]:
    where = f"--lora-from {folder}"
    if not folder.is_dir():
        raise UserError(f"{where} is not a folder; pass a PEFT adapter folder ({CONFIG_FILE})")
    path = folder / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        # PEFT saves an adapter not named "default" in a subfolder of its name, the HF Trainer
        # its checkpoints as checkpoint-N/: name those that are adapters
        inside = sorted(str(p.parent) for p in folder.glob(f"*/{CONFIG_FILE}"))
        hint = f"; its subfolders are: pass one of {', '.join(inside[:3])}" if inside else ""
        raise UserError(f"{where} has no {CONFIG_FILE}: not a PEFT adapter folder{hint}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); fix or replace it") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} must hold a JSON object")
    return path, cfg


def read_adapter_config(folder: Path) -> dict:
    """The AdapterConfig fields of PEFT folder `folder`'s adapter_config.json, or one line
    naming the key fitgpt's LoRA cannot honour."""
    path, cfg = _config_file(folder)
    if cfg.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type={cfg.get('peft_type')!r}; fitgpt trains LORA only")
    if cfg.get("target_parameters"):  # first: PEFT adds a rank_pattern for them on its own
        raise UserError(
            f"{path}: target_parameters={cfg['target_parameters']!r} adapts parameters that are "
            "no linear (a mixture's experts and router: PEFT's all-linear adds them), which "
            "fitgpt does not adapt yet; plain LoRA on linears only"
        )
    for key in UNSUPPORTED:
        v = cfg.get(key)
        if v not in (None, False, {}, [], "", "megatron.core"):
            raise UserError(f"{path}: {key}={v!r} has no fitgpt equivalent; plain LoRA only")
    if cfg.get("bias", "none") != "none":
        raise UserError(f"{path}: bias={cfg['bias']!r}; fitgpt's LoRA trains no bias (none)")
    init = cfg.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise UserError(
            f"{path}: init_lora_weights={init!r} rewrites the base's weights at the start; "
            "convert the adapter to plain LoRA first (PEFT's path_initial_model_for_weight_"
            "conversion)"
        )
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise UserError(
            f"{path}: target_modules={targets!r} is a regular expression; fitgpt takes a list "
            "of module names (or all-linear)"
        )
    if isinstance(targets, list) and targets and all(isinstance(n, str) for n in targets):
        targets = ",".join(targets)
    if not isinstance(targets, str):
        raise UserError(f"{path}: target_modules={targets!r} must be a list of module names")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)  # 8: PEFT's default alpha
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise UserError(f"{path}: r={r!r} must be a whole number >= 1")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 < alpha < math.inf:
        raise UserError(f"{path}: lora_alpha={alpha!r} must be a positive number")
    dropout = cfg.get("lora_dropout", 0.0)
    if not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise UserError(f"{path}: lora_dropout={dropout!r} must lie in [0, 1)")
    rs = cfg.get("use_rslora", False)
    if not isinstance(rs, bool):
        raise UserError(f"{path}: use_rslora={rs!r} must be true or false")
    return {
        "lora_rank": r,
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "lora_targets": targets,
        "lora_rslora": rs,
    }


def _wanted(cfg: ModelConfig, adapter: AdapterConfig) -> dict[str, tuple[str, tuple[int, int]]]:
    """PEFT key -> (the name in fitgpt's model, the shape) of every tensor `adapter` needs."""
    r, out = adapter.lora_rank, {}
    for t in lora_targets(cfg, adapter):
        shapes = ((r, t.in_features), (t.out_features, r))
        for which, name, shape in zip("AB", param_names(t), shapes):
            out[peft_key(t, which)] = (name, shape)
    return out


def check_peft_weights(folder: Path, cfg: ModelConfig, adapter: AdapterConfig) -> None:
    """The header of PEFT folder `folder`'s weights checked against the model `cfg`: exactly
    the tensors `adapter`'s targets need, each floating point and of its shape, or one line
    naming the key. Reads no tensor (a few KB), so a run refuses a folder of another model
    before its base is read, not after (train/request.py); their values: read_peft_weights."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = (
            " (it holds adapter_model.bin: save it with safe_serialization)"
            * (folder / "adapter_model.bin").is_file()
        )
        raise UserError(f"--lora-from {folder} has no {WEIGHTS_FILE}{other}")
    try:  # safetensors checks that the header's offsets cover the file: a truncation fails here
        with safe_open(str(path), framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 (no dict)
            stored = {k: (v.get_dtype(), v.get_shape()) for k, v in slices.items()}
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise UserError(f"{path} is unreadable ({e})") from None
    wanted = _wanted(cfg, adapter)
    for key, (_, shape) in wanted.items():
        if key not in stored:
            raise UserError(f"{path} lacks {key}; is it an adapter of this model?")
        dtype, got = stored[key]
        if tuple(got) != shape or dtype not in FLOAT_DTYPES:
            raise UserError(
                f"{path}: {key} is {dtype} {got}; this model's needs floating point {list(shape)}"
            )
    extra = sorted(set(stored) - set(wanted))
    whole = [k.removeprefix(PREFIX) for k in extra if ".lora_" not in k]
    if whole:  # save_pretrained adds the embedding and head once the vocabulary was resized
        raise UserError(
            f"{path} holds whole weights beside the adapters ({', '.join(whole[:3])}): PEFT "
            "saves them when tokens were added to the vocabulary; fitgpt's LoRA trains "
            "adapters alone: merge the folder with PEFT (merge_and_unload) and --init-from "
            "the merged model"
        )
    if extra:
        raise UserError(
            f"{path} holds {extra[0]}, which adapter_config.json's targets do not name "
            f"({len(extra)} such); fix target_modules"
        )


def read_peft_weights(folder: Path, cfg: ModelConfig, adapter: AdapterConfig) -> dict[str, Tensor]:
    """The adapters of PEFT folder `folder`, fp32, by their names in fitgpt's model: exactly
    the tensors `adapter`'s targets in the model `cfg` need (check_peft_weights), finite."""
    check_peft_weights(folder, cfg, adapter)
    path, out = folder / WEIGHTS_FILE, {}
    with safe_open(str(path), framework="pt") as f:
        for key, (name, _) in _wanted(cfg, adapter).items():
            v = f.get_tensor(key)
            if not torch.isfinite(v).all():
                raise UserError(f"{path}: {key} holds NaN or inf values")
            out[name] = v.float()
    return out


# the fields of an adapter folder (PEFT's adapter_config.json): its shape, not a training choice
FROM_FOLDER = ("lora_rank", "lora_alpha", "lora_targets", "lora_rslora")


def adapter_config(given: dict, model: ModelConfig | None = None) -> AdapterConfig:
    """The adapter the --lora-* flags `given` ask for: with --lora-from, the folder's (peft.py
    reads its adapter_config.json, refusing in one line what fitgpt's LoRA does not compute),
    each flag given again checked against it; its dropout, a training choice, may be set.
    --lora-targets agrees when it names the same modules of `model` (PEFT saves all-linear as
    the names it found), or, no model known yet, the same names."""
    path = given.get("lora_from")
    if not path:
        return AdapterConfig(**given)
    found = read_adapter_config(Path(path))
    for name in FROM_FOLDER:
        if name not in given or same(name, given[name], found[name]):
            continue
        if name == "lora_targets" and model is not None:
            asked = AdapterConfig(lora_rank=1, lora_targets=given[name])  # the flag's own checks
            folder = AdapterConfig(lora_rank=1, lora_targets=found[name], lora_from=path)
            theirs = {t.hf for t in lora_targets(model, folder)}
            if {t.hf for t in lora_targets(model, asked)} == theirs:
                continue
        raise UserError(
            f"{flag(name)} {given[name]}: the adapter --lora-from {path} has "
            f"{found[name]}; drop the flag (the adapter's shape is the folder's)"
        )
    return AdapterConfig(**{**found, **given})
