"""The CPU thread rule (fitgpt/dist/threads.py): only the cores nobody else is using."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fitgpt.dist.env import configure_process, thread_tuner
from fitgpt.dist.threads import PROBE_BUDGET, ThreadTuner, busy_cores, cpu_threads

CORES = len(os.sched_getaffinity(0))


def test_the_rule_leaves_busy_cores_alone():
    assert cpu_threads(1, busy=0.0) == CORES
    assert cpu_threads(1, busy=0.2) == CORES  # background daemons do not count
    assert cpu_threads(1, busy=0.3) == max(1, CORES - 1)
    assert cpu_threads(1, busy=CORES + 5.0) == 1  # never fewer than one
    assert cpu_threads(CORES + 1, busy=0.0) == 1  # several processes share the cores
    assert cpu_threads(1) == CORES  # unknown load: all cores


def test_a_competing_process_is_seen():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and busy >= 0.5


def test_an_explicit_omp_num_threads_wins(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    try:
        assert configure_process(device="cpu") == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_gpu_runs_share_the_cores_without_the_load_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("FITGPT_CPU_CORES", "6")
    before = torch.get_num_threads()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert configure_process(device="cuda") == 6  # a busy machine does not shrink it
    finally:
        spin.kill()
        spin.wait()
        torch.set_num_threads(before)


def test_cpu_runs_get_the_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        n = configure_process(device="cpu")
        assert 1 <= n <= CORES
        assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


# ---- the tuner: which count it keeps, given the step times each count gives ----------------
@pytest.fixture
def keep_threads():
    """The tuner sets torch's thread count: restore it after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def drive(tuner: ThreadTuner, seconds_at: dict[int, float], steps: int) -> list[int]:
    """Feed `tuner` the step time of whatever count torch runs with now; the counts used."""
    used = []
    for _ in range(steps):
        n = torch.get_num_threads()
        used.append(n)
        tuner.after_step(seconds_at[n])
    return used


def test_the_tuner_leaves_a_count_that_spins_behind_other_programs(keep_threads):
    torch.set_num_threads(2)  # what the start-up rule chose on a box that looked idle
    tuner = ThreadTuner(2, most=2, active=True)
    used = drive(tuner, {2: 7.0, 1: 0.1}, 200)  # 2 threads 70x slower: a competing job
    # one step to settle, three timed, then the other count: three steps at it, kept; more
    # threads are tried again only after FIRST_UP steps
    assert used[:7] == [2] * 4 + [1] * 3 and tuner.current == 1
    assert used[7:].count(2) <= 4


def test_a_losing_count_costs_at_most_its_budget(keep_threads):
    torch.set_num_threads(1)
    tuner = ThreadTuner(1, most=2, active=True)
    used = drive(tuner, {2: 7.0, 1: 0.1}, 5000)
    tries = used.count(2)
    # each try is one step (70x slower: given up at once); the waits between tries grow
    # so that the tries' cost stays within the budget
    cost = tries * (7.0 - 0.1)
    assert 1 <= tries <= 8 and cost <= 2 * PROBE_BUDGET * 5000 * 0.1 + 7.0
    assert tuner.current == 1 and torch.get_num_threads() == 1


def test_the_tuner_comes_back_when_the_machine_frees_up(keep_threads):
    torch.set_num_threads(1)
    tuner = ThreadTuner(1, most=2, active=True)
    drive(tuner, {2: 7.0, 1: 0.1}, 300)  # loaded: stays at 1
    assert tuner.current == 1
    used = drive(tuner, {2: 0.06, 1: 0.1}, 3000)  # idle again: 2 is faster
    assert tuner.current == 2 and used[-1] == 2


def test_user_threads_are_never_changed(monkeypatch, keep_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    tuner = thread_tuner(2, "cpu")  # --cpu-threads 2
    drive(tuner, {2: 7.0, 1: 0.1}, 50)
    assert torch.get_num_threads() == 2 and not tuner.active
    assert not thread_tuner(0, "cuda").active  # GPU runs share their cores out once
