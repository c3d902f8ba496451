"""Dynamic loss scaling for fp16, with hysteresis.

fp16 gradients underflow unless the loss is scaled up before backward. The scale starts at 2^16;
an overflow (inf/nan in any gradient on any rank) skips the step, and once `hysteresis` overflows
have been seen since the last growth, the scale halves. After `growth_interval` clean steps it
doubles. bf16 and fp32 use a fixed scale of 1 and never skip.
"""

from __future__ import annotations

from fitgpt.engine.config import PrecisionConfig


class LossScaler:
    def __init__(self, cfg: PrecisionConfig) -> None:
        self.dynamic = cfg.precision == "fp16"
        self.scale = cfg.initial_scale if self.dynamic else 1.0
        self.growth_interval, self.hysteresis, self.min_scale = (
            cfg.growth_interval,
            cfg.hysteresis,
            cfg.min_scale,
        )
        self.clean_steps = 0  # consecutive steps without overflow
        self.hysteresis_left = cfg.hysteresis
        self.skipped = 0  # steps skipped because of overflow, over the whole run

    def update(self, overflow: bool) -> None:
        """Record one step's outcome; the caller skips the update when overflow is True."""
        if not self.dynamic:
            return
        if overflow:
            self.skipped += 1
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "clean_steps", "hysteresis_left", "skipped")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
