"""Every docstring example in ``src/shardpoint`` runs, as ``doctest`` runs it.

Examples that cannot run standalone (a trained model, a GPU, a cluster) are marked
``# doctest: +SKIP`` in the source; everything else must produce exactly the output shown.
Each module runs in a fresh temporary working directory, so examples that write
``out/...`` leave nothing behind.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
from pathlib import Path

import pytest

import shardpoint

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(shardpoint.__path__, prefix="shardpoint.")
    if not m.name.endswith(".__main__")  # running it is running the command
)


def test_every_module_is_collected() -> None:
    assert {"shardpoint._verify", "shardpoint._cli.output", "shardpoint._format.companions"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module(name)
    monkeypatch.chdir(tmp_path)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (output above)"
    assert os.getcwd() == str(tmp_path)
