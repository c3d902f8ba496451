"""Write the Python standard library's source as JSON lines ({"text": ...}, one file a line,
sorted by path): the real text the device scripts feed `fitgpt data preprocess`.

    python3 benchmarks/stdlib_jsonl.py OUT.jsonl
"""

import contextlib
import json
import sys
import sysconfig
from pathlib import Path

with open(sys.argv[1], "w") as f:
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        with contextlib.suppress(UnicodeDecodeError, OSError):  # unreadable files are skipped
            f.write(json.dumps({"text": p.read_text(encoding="utf-8")}) + "\n")
