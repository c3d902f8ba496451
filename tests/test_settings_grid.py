"""`fitgpt plan` and `fitgpt train` judge a run's settings alike (plan/validate.py).

One grid of TP / SP / precision / master / moments / offload settings on 1-4 ranks, GPUs and
CPUs, each case driven through both commands in this process: `fitgpt plan` through
`fitgpt.cli.main` on a planned GPU machine (`--device cuda --gpu-mem`, so it runs anywhere),
`fitgpt train` through the function its `run` calls before launching anything (the flags
parsed by the real parser, then `settled`: the run asked for, settled and validated). Whenever train refuses, plan
refuses with the same line; whenever plan chooses a plan, train accepts both the flags as typed
and the chosen plan as flags with --plan off (the line plan prints to run it).
"""

from __future__ import annotations

import itertools
import shlex

import pytest

from fitgpt.cli import build_parser, main
from fitgpt.cli.train import settled_by
from fitgpt.errors import UserError

# 6 heads and 4·96 and a 192-row vocabulary divide by 2, 3 and 4 (T=3 fits 3 ranks); the
# 20-token sequence divides by 2 and 4, not 3 (--sequence-parallel at T=3 is refused)
MODEL = (
    "--preset tiny --layers 2 --hidden 96 --heads 6 --seq-len 20 --data synthetic --vocab-size 192"
)
HARDWARE = "--gpu-mem 80GB --cpu-mem 500GB"

# each dimension's values, "" for the flag left out
DIMS: dict[str, tuple[str, ...]] = {
    "world": ("1", "2", "3", "4"),
    "device": ("cuda", "cpu"),
    "tp": ("", "--tensor-parallel 2", "--tensor-parallel 3", "--tensor-parallel auto"),
    "sp": ("", "--sequence-parallel"),
    "precision": ("", "--precision bf16", "--precision fp16", "--precision fp32"),
    "master": ("", "--master split", "--master fp32"),
    "moments": ("", "--moments int8", "--moments bf16"),
    "offload": ("", "--offload-optimizer none", "--offload-optimizer cpu"),
    "more": (
        "",
        "--zero-stage 1",
        "--initial-scale 1024",
        "--offload-blocks 1",
        "--offload-fraction 0.5",
    ),
}

# the cases of issue 33, on the grid's model
ISSUE = [
    ("8", "cuda", "--tensor-parallel 5"),
    ("6", "cuda", "--tensor-parallel 4"),
    ("3", "cuda", "--tensor-parallel 3 --sequence-parallel"),
    ("1", "cuda", "--master split --precision fp16"),
    ("1", "cuda", "--master split --precision fp32"),
    ("1", "cuda", "--moments int8 --offload-optimizer none"),
    ("1", "cpu", "--precision fp16"),
    ("1", "cpu", "--precision fp16 --initial-scale 0"),
    ("2", "cuda", "--offload-optimizer cpu --offload-params cpu --zero-stage 1"),
    ("4", "cuda", "--tensor-parallel auto --sequence-parallel"),
]


def pairwise() -> list[tuple[str, str, str]]:
    """Cases covering every pair of values of two dimensions, ~30 where the whole product is
    9,216: each case starts from the first pair not yet covered and takes, dimension by
    dimension, the value that covers the most pairs not yet covered (deterministic)."""
    names = list(DIMS)

    def pair(a: str, x: str, b: str, y: str) -> tuple:
        return ((a, x), (b, y)) if names.index(a) < names.index(b) else ((b, y), (a, x))

    todo = {
        pair(a, x, b, y)
        for a, b in itertools.combinations(names, 2)
        for x in DIMS[a]
        for y in DIMS[b]
    }
    out = []
    while todo:
        (a, x), (b, y) = min(todo)
        case = {a: x, b: y}
        for n in names:
            if n not in case:
                gains = {v: sum(pair(m, case[m], n, v) in todo for m in case) for v in DIMS[n]}
                case[n] = max(DIMS[n], key=gains.__getitem__)
        todo -= {pair(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}
        flags = " ".join(case[k] for k in names[2:] if case[k])
        out.append((case["world"], case["device"], flags))
    return out


CASES = ISSUE + pairwise()


def plan(world: str, device: str, flags: str, capfd) -> tuple[str | None, str | None]:
    """(the chosen plan as train flags, None) or (None, plan's error line)."""
    argv = f"plan {MODEL} {HARDWARE} --gpus {world} --device {device} {flags}"
    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        main(shlex.split(argv))
    out, err = capfd.readouterr()
    assert "Traceback" not in err, err
    if done.value.code not in (0, None):
        lines = err.strip().splitlines()
        assert done.value.code == 2 and len(lines) == 1, err
        return None, lines[0].removeprefix("fitgpt plan: error: ")
    chosen = next(ln for ln in out.splitlines() if ln.startswith("as train flags: "))
    return chosen.removeprefix("as train flags: "), None


def train_refuses(world: str, device: str, flags: str) -> str | None:
    """The line `fitgpt train --gpus WORLD` refuses these flags with, or None: the checks its
    `run` makes before torchrun starts (nothing is launched or allocated)."""
    args = build_parser().parse_args(shlex.split(f"train {MODEL} --device {device} {flags}"))
    try:
        settled_by(args, int(world))
    except UserError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world, device, flags", CASES, ids=[" ".join(c) for c in CASES])
def test_plan_chooses_only_what_train_runs_and_refuses_what_train_refuses(
    world, device, flags, capfd
):
    chosen, plan_error = plan(world, device, flags, capfd)
    train_error = train_refuses(world, device, flags)
    if train_error is not None:
        assert plan_error == train_error
        return
    assert plan_error is None, f"plan refused what train runs: {plan_error}"
    # the chosen plan, run as flags without the planner: precision as typed, the engine chosen
    words = shlex.split(flags)
    precision = [f"--precision {v}" for f, v in itertools.pairwise(words) if f == "--precision"]
    assert train_refuses(world, device, " ".join([*precision, chosen])) is None, chosen


def test_the_grid_reaches_both_outcomes():
    """The grid is not vacuous: it holds accepted plans with TP and SP, and refusals."""
    refused = [c for c in CASES if train_refuses(*c)]
    assert 5 <= len(refused) < len(CASES) - 5
    assert any("--sequence-parallel" in f and not train_refuses(w, d, f) for w, d, f in CASES)


def test_plan_prices_the_batch_and_vocabulary_train_runs(capfd):
    """The same flags, the same run: train's default batch (24 × 1) and its default data's
    vocabulary (the Python standard library through the bytes tokenizer), not plan's own."""
    from fitgpt import units

    args = build_parser().parse_args(["train", "--preset", "tiny", "--device", "cpu"])
    run = settled_by(args, 1).config
    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["plan", "--preset", "tiny", "--device", "cpu"])
    assert done.value.code in (0, None)
    head = capfd.readouterr().out.splitlines()[0]
    t, m = run.train, run.model
    assert f"{units.params(m.num_params())} parameters" in head
    assert f"micro-batch {t.micro_batch} × {t.grad_accum} accumulation" in head
