"""`fitgpt --help`, and the commands that plan or load a model but train none (plan, generate,
export), run without torch._dynamo: importing it costs 1-1.5 s of every such command's start
(fitgpt/cli/__init__.py imports each subcommand's heavy dependencies inside its function;
model/loss.py's never-compiled loss is marked so at its first call; model/decoder.py's
embedding skips its fill on the meta device, which went through torch's reference kernels).
A run that trains imports it anyway (torch.optim)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import runpy, sys
sys.argv[1:] = ["--help"]
try:
    runpy.run_module("fitgpt", run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
import fitgpt.model  # the model's modules, which every command imports, load without it too
from fitgpt.model import get_preset
from fitgpt.plan.memory import layout_of

for name in ("tiny", "llama3.2-1b"):  # each family's network built on the meta device
    layout_of(get_preset(name))
print("torch" in sys.modules, "torch._dynamo" in sys.modules)
"""


def test_help_and_a_model_on_the_meta_device_need_no_torch_dynamo():
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert "train" in r.stdout  # the help was printed
    assert r.stdout.splitlines()[-1] == "True False", r.stdout[-500:]
