"""Fuzz targets: every parser of untrusted bytes, as one function each ``bytes -> outcome``.

A target returns ``"result"`` (the input was accepted) or ``"error"`` (it was refused with
a :class:`shardpoint.CheckpointError`), and raises :class:`Finding` for anything else:

- ``crash``: any other exception (a traceback where a CheckpointError belongs);
- ``looser``: the safetensors header parser accepted a file the ``safetensors`` library
  refuses (we may be stricter than it, never looser), or the two read it differently;
- ``alloc``: a tensor allocation beyond the bound (``torch.empty`` is guarded while a
  target runs: nothing may allocate more than the input could possibly hold);
- ``wrong``: an accepted input that breaks an invariant (``latest`` naming a step that
  is not the newest committed one, a tensor loaded through a forged index with other
  values than the file holds).

Hangs are caught by the drivers (a per-input deadline). The targets are shared by
``tests/test_fuzz.py`` (Hypothesis, bounded, in the normal suite) and ``fuzz/run.py``
(the long runs).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import struct
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import shardpoint as sp
from shardpoint._format.index import parse_index
from shardpoint._format.manifest import parse_manifest
from shardpoint._format.safetensors import read_header

PARSERS = ("header", "index", "manifest", "latest")
LOAD_TARGETS = ("load_into", "load_keys", "manager")
"""Targets that feed a fuzzed manifest to a public entry point beyond ``load``."""
MAX_HEADER = 1 << 20
"""Header bound while fuzzing (the default is 100 MB; the logic is the same)."""
ALLOC_BOUND = 1 << 22
"""Largest tensor a target may allocate, in bytes (the fixture files hold a few hundred)."""


class Finding(Exception):
    """An input that did not end in a result or a CheckpointError."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@contextlib.contextmanager
def bounded_allocations() -> Iterator[None]:
    """While a target runs, a ``torch.empty`` beyond ``ALLOC_BOUND`` bytes is a finding."""
    real = torch.empty

    def guarded(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        numel = math.prod(int(d) for d in shape)
        item = (kwargs.get("dtype") or torch.get_default_dtype()).itemsize
        if numel * item > ALLOC_BOUND:
            raise Finding("alloc", f"torch.empty{tuple(shape)} ({numel * item} bytes)")
        return real(*size, **kwargs)

    torch.empty = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = real  # type: ignore[assignment]


def _classify(run: Callable[[], Any]) -> str:
    try:
        with bounded_allocations():
            run()
    except Finding:
        raise
    except sp.CheckpointError:
        return "error"
    except Exception as exc:
        raise Finding("crash", "".join(traceback.format_exception(exc))[-3000:]) from exc
    return "result"


# ----------------------------------------------------------------------------- header


class _Memfile:
    """One anonymous in-memory file, rewritten for each input (the real ``read_header``
    reads through a file descriptor)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("shardpoint-fuzz")

    def put(self, data: bytes) -> int:
        os.ftruncate(self.fd, 0)
        view = memoryview(data)
        offset = 0
        while offset < len(view):
            offset += os.pwrite(self.fd, view[offset:], offset)
        return self.fd


_memfile: _Memfile | None = None


def _safetensors_view(data: bytes) -> list[tuple[str, str, list[int], bytes]] | None:
    """What the ``safetensors`` library reads from ``data``; None if it refuses it."""
    from safetensors import deserialize

    try:
        tensors = deserialize(data)
    except BaseException as exc:  # its errors, and a Rust panic (a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        return None
    return [(name, info["dtype"], list(info["shape"]), bytes(info["data"])) for name, info in tensors]


def header(data: bytes) -> str:
    """Parse ``data`` as a whole safetensors file's header; cross-check with safetensors."""
    global _memfile
    if _memfile is None:
        _memfile = _Memfile()
    fd = _memfile.put(data)
    parsed: list[Any] = []

    def run() -> None:
        parsed.append(read_header(fd, len(data), name="fuzz.safetensors", max_header_bytes=MAX_HEADER))

    outcome = _classify(run)
    if outcome == "error":
        return outcome
    ours = parsed[0]
    theirs = _safetensors_view(data)
    if theirs is None:
        raise Finding("looser", "shardpoint accepted a header the safetensors library refuses")
    mine = sorted(
        (e.key, e.dtype_name, list(e.shape), data[e.start : e.end]) for e in ours.entries.values()
    )
    if mine != sorted(theirs):
        raise Finding("looser", f"the two parsers disagree: {str(mine)[:500]} vs {str(sorted(theirs))[:500]}")
    return outcome


# ------------------------------------------------------------------------------ fixtures


def _fixture_dir() -> Path:
    """A directory with a small HF checkpoint (two shards + index) and shardpoint ones.

    ``SHARDPOINT_FUZZ_FIXTURES`` names where they are kept across runs (the saved corpus
    holds manifests of exactly these saves); otherwise a fresh temporary directory.
    """
    global _fixtures
    if _fixtures is None:
        from seeds import write_fixtures

        kept = os.environ.get("SHARDPOINT_FUZZ_FIXTURES")
        root = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="shardpoint-fuzz-"))
        if not (root / "steps").is_dir():
            root.mkdir(parents=True, exist_ok=True)
            for name in os.listdir(root):
                shutil.rmtree(root / name)
            write_fixtures(root)
        if not (root / "ranked").is_dir():
            from seeds import write_trained

            for name in ("trained", "ranked"):
                shutil.rmtree(root / name, ignore_errors=True)
            write_trained(root)
        for name in os.listdir(root):
            if name.startswith("work-"):
                shutil.rmtree(root / name)  # scratch copies of an earlier run
        _fixtures = root
    return _fixtures


_fixtures: Path | None = None


def _scratch(kind: str) -> Path:
    """A fresh copy of fixture ``kind`` (the target overwrites one file in it)."""
    src = _fixture_dir() / kind
    dst = _fixture_dir() / f"work-{kind}"
    if not dst.exists():
        shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------- index


def index(data: bytes) -> str:
    """Parse ``data`` as an HF index, then load a directory whose index it is."""
    outcome = _classify(lambda: parse_index(data, where="fuzz/model.safetensors.index.json"))
    if outcome == "error":
        return outcome
    work = _scratch("hf")
    (work / "model.safetensors.index.json").write_bytes(data)
    loaded = _classify(lambda: _check_values(sp.load(work), "hf"))
    return loaded


def _check_values(state: Any, kind: str) -> None:
    """What loads through an index must be exactly what the fixture saved: an index only
    says which file holds a name, and the file's own header decides the bytes."""
    from seeds import fixture_tensors

    expected = fixture_tensors(kind)
    flat = state if isinstance(state, dict) else {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and key in expected and not torch.equal(value, expected[key]):
            raise Finding("wrong", f"tensor {key!r} loaded with other values than were saved")


# ---------------------------------------------------------------------------- manifest


def manifest(data: bytes) -> str:
    """Parse ``data`` as a manifest, then load a checkpoint whose manifest it is."""
    outcome = _classify(lambda: parse_manifest(data, where="fuzz/shardpoint.json"))
    if outcome == "error":
        return outcome
    results = []
    for kind in ("nested", "chunked"):
        work = _scratch(kind)
        (work / "shardpoint.json").write_bytes(data)
        # A manifest is the root of trust (it may rename or reshape tensors): no value check.
        results.append(_classify(lambda w=work: sp.load(w)))
        results.append(_classify(lambda w=work: sp.load(w, allow_pickle=False, mmap=True)))
    return "result" if "result" in results else "error"


# ------------------------------------------------------------------------------ latest


def latest(data: bytes) -> str:
    """Write ``data`` as the ``latest`` pointer of a root with committed steps 2 and 7."""
    root = _fixture_dir() / "steps"
    (root / "latest").write_bytes(data)
    mgr = sp.CheckpointManager(root)
    got: list[Any] = []
    outcome = _classify(lambda: got.append(mgr.latest_step()))
    if outcome == "result" and got[0] != 7:
        raise Finding("wrong", f"latest_step() is {got[0]!r}, the newest committed step is 7")
    return outcome


# --------------------------------------------------------------- load_into / keys / manager


def load_into(data: bytes) -> str:
    """``data`` as the manifest of a saved module + optimizer + JSON leaves, loaded with
    ``load_into`` into a freshly built state of the same shape (strict, then not)."""
    from seeds import trained_target

    if _classify(lambda: parse_manifest(data, where="fuzz/shardpoint.json")) == "error":
        return "error"
    work = _scratch("trained")
    (work / "shardpoint.json").write_bytes(data)
    results = [
        _classify(lambda: sp.load_into(trained_target(), work)),
        _classify(lambda: sp.load_into(trained_target(), work, strict=False)),
        _classify(lambda: sp.load_into({"model": trained_target()["model"]}, work, strict=False)),
    ]
    return "result" if "result" in results else "error"


def load_keys(data: bytes) -> str:
    """``data`` as a manifest, loaded with ``keys=`` (a tensor or a component) and ``mmap``."""
    if _classify(lambda: parse_manifest(data, where="fuzz/shardpoint.json")) == "error":
        return "error"
    results = []
    for kind, keys in (("chunked", ["embed.weight", "scalar"]), ("nested", ["model"])):
        work = _scratch(kind)
        (work / "shardpoint.json").write_bytes(data)
        results.append(_classify(lambda w=work, k=keys: sp.load(w, keys=k)))
        results.append(_classify(lambda w=work, k=keys: sp.load(w, keys=k, mmap=True)))
        results.append(_classify(lambda w=work, k=keys: sp.load(w, keys=k[:1], verify=False, dtype=torch.float64)))
    return "result" if "result" in results else "error"


def manager(data: bytes) -> str:
    """``data`` as the manifest of step 2 of a ranked root (steps 1-3, metric ``loss``):
    ``steps``, ``latest_step``, ``best_steps``, ``metrics`` and ``restore`` must each end
    in a result or a CheckpointError, and the listing must stay right."""
    src = _fixture_dir() / "ranked"
    work = _fixture_dir() / "work-ranked"
    if not work.exists():
        shutil.copytree(src, work)
    (work / "step-000002" / "shardpoint.json").write_bytes(data)
    mgr = sp.CheckpointManager(work, metric="loss")
    got: dict[str, Any] = {}
    outcomes = [
        _classify(lambda: got.__setitem__("steps", mgr.steps())),
        _classify(lambda: got.__setitem__("latest", mgr.latest_step())),
        _classify(lambda: mgr.best_steps()),
        _classify(lambda: mgr.metrics(2)),
        _classify(lambda: mgr.restore({"x": torch.zeros(1, dtype=torch.int64)}, step=2)),
        _classify(lambda: mgr.restore({"x": torch.zeros(1, dtype=torch.int64)})),
    ]
    if "steps" in got and not set(got["steps"]) >= {1, 3}:
        raise Finding("wrong", f"steps() is {got['steps']!r}; steps 1 and 3 are committed and untouched")
    if got.get("latest") not in (None, 3):
        raise Finding("wrong", f"latest_step() is {got['latest']!r}, the newest committed step is 3")
    return "result" if "result" in outcomes else "error"


TARGETS: dict[str, Callable[[bytes], str]] = {
    "header": header,
    "index": index,
    "manifest": manifest,
    "latest": latest,
    "load_into": load_into,
    "load_keys": load_keys,
    "manager": manager,
}


def header_bytes(header_json: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header_json)) + header_json + data


# ------------------------------------------------------------------ CLI human output

CLI_MODES = ("manifest", "header", "index")
"""What the first byte of a ``cli`` input (modulo 3) overwrites; the rest is the content."""

CONTROL_NAMES = ["\x1b]0;pwned\x07", "\x1b[2J", "ok\rFAKE", "\u202e", "x\nOK: whole", "\x9b1m", "\ufeff"]
"""Tensor names of the ``cli`` fixtures: the fuzzer starts from names that try to drive the
terminal, and mutates around them."""


def _cli_fixtures() -> Path:
    """Checkpoints whose names, metadata and values hold control characters (made once):
    ``cli`` (shardpoint, nested, several files) and ``cli-hf`` (HF index + shards)."""
    root = _fixture_dir()
    if not (root / "cli-hf").is_dir():
        weights = {name: torch.full((2,), float(i)) for i, name in enumerate(CONTROL_NAMES)}
        sp.save(
            {"model": weights, "extra": {"\x1b[2J": "x\u202ey", "n": 1}},
            root / "cli",
            max_shard_size=16,
            metadata={"\x1b]0;t\x07": "\x9b31m\u2066"},
            progress=False,
        )
        sp.save(weights, root / "cli-hf", max_shard_size=16, progress=False)
        (root / "cli-hf" / "shardpoint.json").unlink()
    return root


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from shardpoint._cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def cli(data: bytes) -> str:
    """Write ``data[1:]`` as the manifest, a data file's header or the HF index of a
    checkpoint (``data[0]`` picks, see ``CLI_MODES``), then run ``inspect``, ``verify``,
    ``diff`` and ``convert`` (human output) on it. Each must exit 0, 1 or 2 without a traceback, and print
    no control or format character but the newlines ending its lines (``escape``)."""
    if not data:
        return "error"
    mode, body = CLI_MODES[data[0] % len(CLI_MODES)], data[1:]
    root = _cli_fixtures()
    kind = "cli" if mode == "manifest" else "cli-hf"
    work = _scratch(kind)
    if mode == "manifest":
        target = work / "shardpoint.json"
    elif mode == "index":
        target = work / "model.safetensors.index.json"
    else:
        target = work / sorted(p.name for p in work.glob("*.safetensors"))[0]
    original = target.read_bytes()
    target.write_bytes(body)
    codes: list[int] = []
    try:
        converted = _fixture_dir() / f"converted-{kind}"
        shutil.rmtree(converted, ignore_errors=True)
        commands = (
            ["inspect", str(work)],
            ["verify", str(work)],
            ["diff", str(work), str(root / kind)],
            ["convert", str(work), str(converted)],
        )
        for argv in commands:
            got: list[tuple[int, str, str]] = []
            if _classify(lambda a=argv, g=got: g.append(_run_cli(a))) == "error":
                raise Finding("crash", f"{argv[0]} let a CheckpointError out of main()")
            code, out, err = got[0]
            if code not in (0, 1, 2) or "Traceback" in err:
                raise Finding("crash", f"{argv[0]} exited {code}: {err[-2000:]}")
            _check_printable(argv[0], out, err)
            codes.append(code)
    finally:
        target.write_bytes(original)
    return "result" if codes[0] == 0 else "error"


def _check_printable(command: str, out: str, err: str) -> None:
    from shardpoint._cli.output import has_control

    for stream, text in (("stdout", out), ("stderr", err)):
        if has_control(text, allow="\n"):
            bad = sorted({repr(ch) for ch in text if ch != "\n" and has_control(ch)})
            raise Finding("escape", f"{command} printed {', '.join(bad)} on {stream}: {text[:500]!r}")


TARGETS["cli"] = cli
