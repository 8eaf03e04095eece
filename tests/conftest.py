"""Shared fixtures: one real S3 server (SeaweedFS on loopback) for the whole session, used
by ``test_remote.py`` and ``test_remote_faults.py``; ``use_options``, shardpoint's options
in effect for the rest of a test; ``tmpfs_1m``, a real 1 MiB tmpfs for full-disk tests."""

from __future__ import annotations

import contextlib
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import shardpoint as sp
from _s3_server import SeaweedS3, ServerUnavailable


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    try:
        server = SeaweedS3.start(tmp_path_factory.mktemp("seaweedfs"))
    except ServerUnavailable as exc:
        pytest.skip(f"the SeaweedFS S3 server cannot start here: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def opts(s3: SeaweedS3) -> dict[str, Any]:
    return s3.storage_options()


@pytest.fixture
def fs(s3: SeaweedS3) -> Any:
    return s3.filesystem()


@pytest.fixture
def url(s3: SeaweedS3, request: pytest.FixtureRequest) -> str:
    """A fresh prefix in the bucket for this test."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:60]
    return f"s3://{s3.bucket}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def use_options() -> Iterator[Callable[..., sp.Options]]:
    """``use_options(io=sp.IOOptions(...))`` puts those options in effect (``sp.using``) from
    there to the end of the test; returns the options then in effect. Later calls layer."""
    with contextlib.ExitStack() as stack:
        yield lambda *groups, **named: stack.enter_context(sp.using(*groups, **named))


@pytest.fixture
def tmpfs_1m(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (needs root and a kernel that lets this process mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(done.stderr or done.stdout).strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
