"""`fitgpt presets`: the named model configs with their exact parameter counts."""

from __future__ import annotations

from fitgpt.model import PRESETS


def register(sub) -> None:
    p = sub.add_parser("presets", help="list the named model configs")
    p.set_defaults(func=run)


def run(args) -> int:
    rows = [
        (name, c.family, c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.seq_len, c.num_params())
        for name, c in PRESETS.items()
    ]
    head = ("preset", "family", "layers", "hidden", "heads", "kv", "seq", "params")
    cells = [head, *[(*r[:-1], f"{r[-1]:,}") for r in rows]]
    # each column as wide as its widest cell: names and counts grow with the presets
    # (qwen3_moe, 235,093,634,560 outgrew fixed widths and shifted their rows)
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(head))]

    def line(row) -> str:
        names = [f"{row[0]:<{widths[0]}}", f"{row[1]:<{widths[1]}}"]
        return " ".join(names + [f"{v:>{w}}" for v, w in zip(row[2:], widths[2:])])

    print(line(head) + "  bytes of state*")
    for r, shown in zip(rows, cells[1:]):
        print(line(shown) + f"  {16 * r[-1] / 1e9:8.1f} GB")
    print(
        "* mixed-precision Adam: 16 bytes per parameter (bf16 weight and gradient, fp32 master "
        "and two moments), before activations.\nParameter counts use the preset's vocabulary "
        "padded to a multiple of 128 (GPT-2: 50304)."
    )
    return 0
