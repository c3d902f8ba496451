"""What `fitgpt train --init-from SRC` names: a fitgpt run or checkpoint, or a Hugging Face
checkpoint of a family whose folder has a Hugging Face name map (model/families/TABLE: GPT-2,
Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral), as the InitSource the trainer loads
(train/init_from.py).

A Hugging Face source is checked whole here, before any work (hf_read.py open_hf: every shard
there, every header sound, every tensor's dtype and shape as config.json implies), and carries
an HFSource: a WeightSource that each rank's engine reads its own ranges of, straight from the
safetensors files. Nothing is converted on disk; train/ loads any source without importing
interop/.
"""

from __future__ import annotations

import json
from pathlib import Path

from fitgpt.adapters.config import PEFT_CONFIG_FILE
from fitgpt.errors import UserError
from fitgpt.interop.hf_import import hf_tokenizer_spec
from fitgpt.interop.hf_read import HFSource, open_hf
from fitgpt.train.init_from import InitSource, fitgpt_source


def find_source(src: str) -> InitSource:
    """What --init-from names, with its architecture, read without loading any weights."""
    path = Path(src)
    if not path.exists():
        raise UserError(
            f"--init-from {src} does not exist; pass a fitgpt run or checkpoint, or a Hugging "
            "Face checkpoint folder"
        )
    source = fitgpt_source(path)
    if source is not None:
        return source
    _refuse_adapter_folder(path)
    ckpt = open_hf(path)  # the preflight: headers only, refused in one line
    tokenizer = hf_tokenizer_spec(ckpt.config_path.parent, ckpt.cfg)
    return InitSource(path, ckpt.cfg, HFSource(path, ckpt.cfg), tokenizer)


def _refuse_adapter_folder(path: Path) -> None:
    """A PEFT adapter folder (adapter_config.json, no config.json) given as the model: one line
    naming its base, which is what --init-from takes, the folder going to --lora-from."""
    adapter = path / PEFT_CONFIG_FILE
    if not path.is_dir() or (path / "config.json").exists() or not adapter.is_file():
        return
    try:
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):  # unreadable: --lora-from says why
        base = None
    raise UserError(
        f"--init-from {path} is a PEFT adapter folder, not a model: pass its base as "
        f"--init-from ({base or 'the model it adapts'}) and this folder as --lora-from"
    )
