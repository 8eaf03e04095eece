"""The long-lived helper process the crash and fault tests drive.

A test file run as a script (``<file> helper``) imports torch once and forks a child per
round, so each round costs a fork, not an interpreter start. The test talks to it in JSON
lines: one command per line on its stdin, one reply per line on its stdout; its stderr goes
to ``helper.log`` in the test's work directory, quoted when the helper dies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


class HelperProcess:
    """Start ``script helper``; send commands, read replies, stop it."""

    def __init__(self, script: str, workdir: Path, *, env: dict[str, str] | None = None) -> None:
        self.log = workdir / "helper.log"
        self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, script, "helper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            bufsize=1,
            env=env,
        )

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise AssertionError(f"the helper died (rc={self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
        return json.loads(line)  # type: ignore[no-any-return]

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.send(cmd)
        return self.reply()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()
