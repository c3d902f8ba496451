"""The declared benchmark suites (benchmarks/suites.py) and their runner (benchmarks/run.py): the
table parses and names real scripts, `--list` lists it, a GPU row on this CPU box is refused in
one line before any work, a CPU row runs, and the generated results index is current."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from cli_refusal import assert_refused, files

import fitgpt

# The tree under test is the one whose fitgpt is imported (PYTHONPATH may name another checkout).
ROOT = Path(fitgpt.__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def load_suites():
    spec = importlib.util.spec_from_file_location("bench_suites", BENCH / "suites.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def runner(*argv: str, env: dict | None = None, cwd: Path = ROOT):
    return subprocess.run(
        [sys.executable, str(BENCH / "run.py"), *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_table_parses_and_names_every_script():
    suites = load_suites()
    assert len({s.name for s in suites.SUITES}) == len(suites.SUITES)
    seen = set()
    for suite, row in suites.rows():
        name = f"{suite.name}/{row.name}"
        assert name not in seen, f"{name} declared twice"
        seen.add(name)
        assert (BENCH / row.script).is_file(), f"{name}: benchmarks/{row.script} does not exist"
        assert f"benchmarks/{row.script}" in row.command
        assert (row.gpus == 0) == (row.machine == "cpu"), f"{name}: {row.machine}, {row.gpus}"
        for res in row.results:  # a row that names a results folder names one that exists
            assert (BENCH / "results" / res).exists(), f"{name}: results/{res} does not exist"
    for past in suites.PAST:
        for res in past.results:
            assert (BENCH / "results" / res).exists(), f"{past.made_by}: results/{res}"
    # every script at the top of benchmarks/ or in one of its rooms (peers/, memory/, ...) is an
    # entry point (a row) or a declared helper
    rooms = [BENCH, *(d for d in BENCH.iterdir() if d.is_dir() and d.name != "results")]
    scripts = {
        str(p.relative_to(BENCH)) for d in rooms for p in d.iterdir() if p.suffix in (".py", ".sh")
    }
    declared = {r.script for _, r in suites.rows()} | set(suites.HELPERS)
    assert scripts <= declared, f"not declared in benchmarks/suites.py: {scripts - declared}"
    assert declared <= scripts, f"declared but missing: {declared - scripts}"


def test_list_names_every_row_and_command():
    suites = load_suites()
    out = runner("--list")
    assert out.returncode == 0, out.stderr
    for suite, row in suites.rows():
        assert f"{suite.name}/{row.name}" in out.stdout
        assert row.command in out.stdout
    one = runner("--list", "long")
    assert one.returncode == 0 and "long/train" in one.stdout and "user/" not in one.stdout


def test_gpu_row_refused_in_one_line_before_any_work(tmp_path):
    # CUDA_VISIBLE_DEVICES="" makes any box a 0-GPU one, as this CPU box is
    out = tmp_path / "out"
    before = files(ROOT / "benchmarks")
    got = runner("engine/gpu-check", "--out", str(out), env={"CUDA_VISIBLE_DEVICES": ""})
    assert_refused(got.returncode, got.stderr, "engine/gpu-check", "nvidia-h100-x1", "has 0")
    assert got.stdout == "" and not out.exists()  # nothing started, no folder made
    # a whole suite with a GPU row is refused before its CPU rows run
    got = runner("long", "--out", str(out), env={"CUDA_VISIBLE_DEVICES": ""})
    assert_refused(got.returncode, got.stderr, "long/kernels")
    assert got.stdout == "" and not out.exists()
    assert files(ROOT / "benchmarks") == before
    # no such row, and no output folder: one line each
    got = runner("engine/nope", "--out", str(out))
    assert_refused(got.returncode, got.stderr, "engine/nope", "--list")
    got = runner("llama/plan-check", env={"OUT": ""})
    assert_refused(got.returncode, got.stderr, "--out")


def test_cpu_row_runs_and_records(tmp_path):
    # from another folder, with a relative --out: the row still runs from the repository root
    got = runner("llama/plan-check", "--out", "o", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    folder = tmp_path / "o" / "llama"
    table = (folder / "llama_plan_check.txt").read_text()
    assert "|error| median" in table and table in got.stdout
    rec = json.loads((folder / "plan-check.run.json").read_text())
    assert rec["row"] == "llama/plan-check" and rec["exit"] == 0 and rec["machine"] == "cpu"
    assert (
        rec["command"]
        == "python3 benchmarks/memory/llama_plan_check.py | tee $OUT/llama_plan_check.txt"
    )


def test_results_index_is_current():
    got = runner("--index", "--check")
    assert got.returncode == 0, got.stderr
    index = (BENCH / "results" / "README.md").read_text()
    for entry in (BENCH / "results").iterdir():  # one row per results folder or file
        if entry.name != "README.md":
            assert f"]({entry.name}" in index, f"results/{entry.name} has no row in the index"


def test_history_left_the_tree_and_code_left_results():
    assert not (BENCH / "history").exists()
    code = [p for p in (BENCH / "results").rglob("*") if p.suffix in (".py", ".sh", ".patch")]
    assert not code, f"code inside results folders: {code}"
    # every place that names a history/ script names the commit that last held it
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    docs += [p for p in BENCH.rglob("*") if p.suffix in (".md", ".py", ".sh")]
    for doc in docs:
        text = doc.read_text(errors="replace")
        if "benchmarks/history/" in text:
            assert "7c35cee" in text, f"{doc} names benchmarks/history/ without commit 7c35cee"
