"""How a family's Hugging Face checkpoints name and lay out its parameters: the data and the
interface each family's name map (model/families/<name>/hf.py) fills in. No file is read or
written here: interop/ does that (hf_read.py, hf_export.py) through these maps alone, so it
names no family.

An `HFMapping` says, for one family:
  config_from_hf / hf_config   config.json ⇄ ModelConfig, refusing in one line what fitgpt's
                               network cannot compute
  tensor_maps                  every HF tensor and its place in fitgpt's parameters
  canonical, layer_of          how stored keys are spelled, and which block a tensor is in
Which mapping reads a config.json is the registry's table (model/families/__init__.py: HF
model_type → family); interop/hf.py looks it up there.

A TensorMap ties one HF tensor to one fitgpt parameter, or to a part of one: fitgpt fuses some
projections that HF keeps apart (Llama's k and v into `attn.kv`, gate and up into `mlp.fc`),
and `part=(i, n)` says the HF tensor is the i-th of n equal row blocks of the fitgpt one. A
fused parameter is then read on import from its HF tensors, each into its rows (hf_read.py,
which reads any range of rows of it), and cut back into them on export, with no intermediate
copy of the whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fitgpt.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

    from fitgpt.model.config import ModelConfig


@dataclass(frozen=True)
class TensorMap:
    """One HF tensor and where it lives in fitgpt; `fitgpt` None means "zeros" (a GPT-2 bias
    of a bias-free model)."""

    hf: str  # name in the HF model's state dict, as `canonical` spells it
    fitgpt: str | None  # name of the fitgpt parameter, None when fitgpt has no such parameter
    transpose: bool = False  # GPT-2's Conv1D stores [in, out] against nn.Linear's [out, in]
    vocab_rows: bool = False  # dim 0 is the vocabulary: padded in fitgpt, exact in HF
    part: tuple[int, int] | None = None  # (i, n): rows block i of n of the fitgpt parameter
    # stored as MXFP4 (interop/mxfp4.py): `hf`_blocks and `hf`_scales, uint8, of this [E, I, O]
    # tensor; only in what stored_maps reads, never exported
    mxfp4: bool = False


def _rows(m: TensorMap, t: Tensor) -> Tensor:
    """The view of fitgpt tensor `t` that HF tensor `m` is: its part's rows, or all of it."""
    if m.part is None:
        return t
    i, n = m.part
    return t.chunk(n, dim=0)[i]


def hf_shape(m: TensorMap, fit_shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """The HF shape of map `m` of a fitgpt parameter of shape `fit_shape`."""
    shape = tuple(fit_shape)
    if m.part is not None:
        shape = (shape[0] // m.part[1], *shape[1:])
    if m.transpose:
        shape = tuple(reversed(shape))
    return (cfg.vocab_size, *shape[1:]) if m.vocab_rows else shape


def to_hf(m: TensorMap, t: Tensor, cfg: ModelConfig) -> Tensor:
    """A fitgpt parameter's share for HF tensor `m`, in HF's layout (its rows, Conv1D
    transposed, the vocabulary cut to the real size)."""
    t = _rows(m, t)
    if m.vocab_rows:
        t = t[: cfg.vocab_size]
    return (t.t() if m.transpose else t).contiguous()


class HFMapping(ABC):
    """How the HF architecture of one fitgpt family stores it (subclass it in the family's
    folder, as hf.py's MAPPING)."""

    layers_key: ClassVar[str]  # config.json's key for the number of blocks
    import_format: ClassVar[str]  # meta.json's imported_from.format
    # config.json keys an export always writes as hf_config does, though config_from_hf reads
    # the source's value as the same model (interop/carried.py carries the others back)
    owned: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def architecture(self, cfg: ModelConfig) -> str:
        """The transformers class, e.g. 'LlamaForCausalLM'."""

    @abstractmethod
    def config_from_hf(self, hf: dict, source: str) -> ModelConfig:
        """fitgpt's ModelConfig for config.json `hf`, or one UserError line naming the key."""

    @abstractmethod
    def hf_config(self, cfg: ModelConfig, ids: dict) -> dict:
        """config.json of the HF model equal to `cfg`; `ids` holds bos/eos_token_id if known."""

    @abstractmethod
    def check_exportable(self, cfg: ModelConfig) -> None:
        """Refuse, in one line, what the HF architecture has no place for."""

    @abstractmethod
    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        """Every tensor of the HF model, grouped as fitgpt's chunks are (embedding, each block,
        head), so an export reads each chunk once."""

    def stored_maps(self, cfg: ModelConfig, hf: dict, source: str) -> list[TensorMap]:
        """The maps of the tensors a folder with config.json `hf` stores: tensor_maps, some
        marked mxfp4 where its quantization_config says so (gpt-oss's experts); a
        quantization this family's map does not read refused in one line."""
        return self.tensor_maps(cfg)

    @abstractmethod
    def canonical(self, key: str) -> str | None:
        """A stored key as tensor_maps names it; None for what is no weight (buffers)."""

    @abstractmethod
    def layer_of(self, name: str) -> int | None:
        """The block a canonical tensor name belongs to, None outside the blocks."""

    def default_tied(self) -> bool:
        """tie_word_embeddings when config.json does not say (the HF class's default)."""
        return True


# ---- config.json helpers shared by the mappings ------------------------------------------
def int_field(hf: dict, key: str, source: str, default: int | None = None) -> int:
    v = hf.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{source}: {key}={v!r} must be a positive integer; fix the file")
    return v


def float_field(hf: dict, key: str, source: str, default: float) -> float:
    v = hf.get(key, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
        raise UserError(f"{source}: {key}={v!r} must be a positive number; fix the file")
    return float(v)


def tied(hf: dict, source: str, default: bool) -> bool:
    """tie_word_embeddings, `default` when absent; a string such as "false" is refused, not
    read as true (bool("false") is True), which would import an untied model as a tied one."""
    v = hf.get("tie_word_embeddings", default)
    if not isinstance(v, bool):
        raise UserError(f"{source}: tie_word_embeddings={v!r} must be true or false; fix the file")
    return v
