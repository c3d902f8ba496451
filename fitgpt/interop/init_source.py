"""What `fitgpt train --init-from SRC` names: a fitgpt run or checkpoint, or a Hugging Face
checkpoint of a family hf.py maps (GPT-2, Llama, Qwen2, Qwen3, Mistral), as the InitSource the
trainer loads (train/init_from.py).

A Hugging Face source carries its conversion, an import into the scratch folder the trainer
gives it (hf_import.py, tensor by tensor): so train/ loads any source without importing interop/.
"""

from __future__ import annotations

import functools
from pathlib import Path

from fitgpt.errors import UserError
from fitgpt.interop.hf import model_config_from_hf
from fitgpt.interop.hf_import import import_hf, locate, read_config
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
    config, _ = locate(path)
    model = model_config_from_hf(read_config(config), str(path))
    return InitSource(path, model, functools.partial(import_hf, path, overwrite=True))
