"""The README's main command: `shardpoint demo`, end to end, in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_runs_end_to_end(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "shardpoint._cli.main", "demo", "--size-mb", "32", "--steps", "24",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"load_into preallocated tensors: .* bit-exact: True", text)
    assert "resumed loss curve equals the uninterrupted run bit for bit: True" in text
    for world in ("1 rank:", "3 ranks:"):
        line = next(row for row in text.splitlines() if row.startswith(world))
        assert "restored step 4" in line
        assert "bit for bit: True" in line and line.endswith(": True"), line
    assert re.search(r"demo passed in [0-9.]+ s", text)
