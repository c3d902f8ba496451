"""`fitgpt presets`: the named model configs with their exact parameter counts."""

from __future__ import annotations

from fitgpt.model import PRESETS


def register(sub) -> None:
    p = sub.add_parser("presets", help="list the named model configs")
    p.set_defaults(func=run)


def run(args) -> int:
    w = max(map(len, PRESETS))
    print(
        f"{'preset':<{w}} {'family':<7} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} "
        f"{'seq':>5} {'params':>14}  bytes of state*"
    )
    for name, c in PRESETS.items():
        n = c.num_params()
        print(
            f"{name:<{w}} {c.family:<7} {c.n_layer:>6} {c.n_embd:>6} {c.n_head:>5} {c.kv_heads:>3} "
            f"{c.seq_len:>5} {n:>14,}  {16 * n / 1e9:8.1f} GB"
        )
    print(
        "* mixed-precision Adam: 16 bytes per parameter (bf16 weight and gradient, fp32 master "
        "and two moments), before activations.\nParameter counts use the preset's vocabulary "
        "padded to a multiple of 128 (GPT-2: 50304)."
    )
    return 0
