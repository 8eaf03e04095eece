"""Saving an unchanged state by hard-linking the previous checkpoint's files (``_reuse``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint import _reuse
from shardpoint._prepare import prepare_state
from shardpoint._verify import verify_checkpoint


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((4, 4), value), "b.bias": torch.arange(3.0) + value}


def _link(state: dict[str, torch.Tensor], previous: Path, path: Path) -> sp.SaveInfo | None:
    return _reuse.link_unchanged(prepare_state(state), previous, path, save_id=None, overwrite=False,
                                 metadata={}, durable=False)


def test_unchanged_state_is_linked_not_written(tmp_path: Path) -> None:
    sp.save(_state(1.0), tmp_path / "prev", max_shard_size=70)
    info = _link(_state(1.0), tmp_path / "prev", tmp_path / "new")
    assert info is not None and sorted(info.files) == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"]
    for name in [*info.files, "model.safetensors.index.json"]:
        assert os.path.samestat(os.stat(tmp_path / "prev" / name), os.stat(tmp_path / "new" / name)), name
    got = sp.load(tmp_path / "new")
    assert got["a.weight"].tolist() == [[1.0] * 4] * 4 and got["b.bias"].tolist() == [1.0, 2.0, 3.0]
    assert verify_checkpoint(tmp_path / "new").ok


def test_a_changed_state_is_not_linked(tmp_path: Path) -> None:
    sp.save(_state(1.0), tmp_path / "prev")
    assert _link(_state(2.0), tmp_path / "prev", tmp_path / "new") is None
    assert not (tmp_path / "new").exists()


def test_an_overwrite_of_the_previous_checkpoint_meanwhile_links_no_other_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The previous checkpoint is overwritten with other values between the moment it is
    opened and the moment its files are linked: the new checkpoint holds the opened
    version's files (what its manifest describes) or is not made by linking, never the
    other version's files under this manifest."""
    prev = tmp_path / "prev"
    sp.save(_state(1.0), prev, max_shard_size=70)
    compare = _reuse._matching_records

    def overwritten_meanwhile(*args: object) -> object:
        records = compare(*args)  # type: ignore[arg-type]
        sp.save(_state(7.0), prev, max_shard_size=70, overwrite=True)
        return records

    monkeypatch.setattr(_reuse, "_matching_records", overwritten_meanwhile)
    info = _link(_state(1.0), prev, tmp_path / "new")
    if info is not None:  # linked from the opened version (moved aside, not yet removed)
        assert verify_checkpoint(tmp_path / "new").ok
        assert sp.load(tmp_path / "new")["a.weight"].tolist() == [[1.0] * 4] * 4
    else:
        assert not (tmp_path / "new").exists()
    assert sp.load(prev)["a.weight"].tolist() == [[7.0] * 4] * 4
