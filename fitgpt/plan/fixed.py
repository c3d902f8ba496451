"""The engine fields a user fixed; the planner (plan/planner.py) chooses the rest.

A `Fixed` comes from the flags typed under `--plan auto`, a DeepSpeed config's mapped keys or a
benchmark system's ablation. It travels typed from the CLI through the one validation
(plan/validate.py: a fixed field is settled, any other is the planner's to choose) into the
planner, which asks it questions by name (`fixed.offload_optimizer`, `fixed.format("moments")`)
instead of reading a dict with defaults repeated at every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fitgpt.engine.config import EngineConfig, Tier

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclass(frozen=True)
class Fixed:
    """The engine fields a user set, by name (sorted: two Fixed of the same fields are equal).
    Names are checked against EngineConfig's fields; values are checked where they are applied
    (EngineConfig's own __post_init__)."""

    fields: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, values: Mapping[str, Any] | Fixed | None = None) -> Fixed:
        """`values` as a Fixed; a Fixed is returned as it is (the planner's entry points take
        either, so a test or a script may write the fields as a dict)."""
        if isinstance(values, Fixed):
            return values
        values = dict(values or {})
        unknown = set(values) - ENGINE_FIELDS
        if unknown:
            raise ValueError(f"not engine fields: {sorted(unknown)}")
        return cls(tuple(sorted(values.items())))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.fields)

    @property
    def names(self) -> frozenset[str]:
        """The fields the user set (empty: the planner chooses every one)."""
        return frozenset(name for name, _ in self.fields)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def with_(self, **values: Any) -> Fixed:
        """These fields and `values` (which replace any of the same name)."""
        return Fixed.of({**self.as_dict(), **values})

    def applied(self, e: EngineConfig) -> EngineConfig:
        """`e` with the fixed fields set (a UserError where they rule `e`'s engine out)."""
        return dataclasses.replace(e, **self.as_dict())

    def agrees(self, e: EngineConfig, names: Iterable[str]) -> bool:
        """Whether `e` has the fixed value of each of `names` that the user fixed."""
        fixed = self.as_dict()
        return all(getattr(e, k) == fixed[k] for k in names if k in fixed)

    def _get(self, name: str, default: Any = None) -> Any:
        return self.as_dict().get(name, default)

    # ---- the planner's questions: the value fixed, or what an unset field means ----------------
    @property
    def tensor_parallel(self) -> int:
        """T as given: 1 when not given, 0 for auto (every T that divides is priced)."""
        return self._get("tensor_parallel", 1)

    @property
    def offload_experts(self) -> bool:
        return self._get("offload_experts", False)

    @property
    def expert_parallel(self) -> int:
        """P as given, 0 for auto (every P that divides is priced); not given: auto as well.
        Unlike T (which splits every matmul and its activations), P only moves whole experts,
        so a run's losses are the unsplit model's (docs/engine.md): the planner may choose it.
        It is what lets gpt-oss-120b fit 4 H200s: at P = 1 ZeRO-3 gathers a 3.2 B-element
        experts' chunk per block and holds its gradient's reductions in flight, 40 GiB per GPU."""
        return self._get("expert_parallel", 0)

    @property
    def context_parallel(self) -> int:
        """C as given: 1 when not given (the planner never chooses it)."""
        return self._get("context_parallel", 1)

    @property
    def shard_within(self) -> str:
        """Where ZeRO shards: "world" when not given (on several nodes the planner prices both)."""
        return self._get("shard_within", "world")

    @property
    def sequence_parallel(self) -> bool:
        return bool(self._get("sequence_parallel"))

    @property
    def offload_optimizer(self) -> Tier | None:
        """The optimizer state's tier; None: the planner's to choose."""
        return self._get("offload_optimizer")

    @property
    def offload_params(self) -> Tier | None:
        """Where offloaded blocks' weights live; None: the planner's to choose."""
        return self._get("offload_params")

    @property
    def offload_blocks(self) -> int | None:
        return self._get("offload_blocks")

    @property
    def nvme_blocks(self) -> int | None:
        return self._get("nvme_blocks")

    def within(self, layers: int) -> Fixed:
        """These fields for the same model cut to `layers` blocks (the refusal's "what fits"
        search): a fixed block count above it means every block, the nearest plan to the
        one asked for; the engine would refuse the count itself (so would a --keep-activations
        above it, which the refusal's search for fewer layers once raised instead of its line)."""
        cut = {
            k: min(v, layers)
            for k in ("offload_blocks", "nvme_blocks", "keep_activations")
            if (v := self._get(k)) is not None and v > layers
        }
        return self.with_(**cut) if cut else self

    def format(self, name: str) -> str:
        """A storage format field (master, moments, device_moments) as fixed; "auto" if not."""
        return self._get(name, "auto")
