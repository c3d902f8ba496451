"""The CPU thread rule (fitgpt/dist/threads.py): only the cores nobody else is using."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from fitgpt.dist.env import configure_process
from fitgpt.dist.threads import busy_cores, cpu_threads

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
