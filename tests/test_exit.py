"""A process that joined a gloo group ends through fitgpt.dist.context.exit_process: its atexit
handlers run, its output is flushed, its exit code is kept, and interpreter teardown (where
gloo's worker threads can abort it, issue 33) is skipped."""

import subprocess
import sys

SCRIPT = """
import atexit, datetime, sys
import torch, torch.distributed as dist
from fitgpt.dist.context import exit_process, gloo_threads_alive
before = gloo_threads_alive()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
dist.all_reduce(torch.ones(4))
group = dist.group.WORLD  # held, as a run's DistContext holds it: its threads outlive destroy
dist.destroy_process_group()
atexit.register(lambda: open(sys.argv[1], "w").write("ran"))
print("before", before, "after", gloo_threads_alive(), end="")  # no newline: must be flushed
exit_process(int(sys.argv[2]))
"""


def test_a_gloo_process_exits_with_its_code_handlers_and_output(tmp_path):
    for code in (0, 3):
        mark = tmp_path / f"atexit{code}"
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(mark), str(code)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == code, r.stderr
        # the group's threads outlive destroy_process_group(): the case exit_process is for
        assert r.stdout == "before False after True", r.stdout
        assert mark.read_text() == "ran" and "terminate called" not in r.stderr
