"""What ``load_into`` reports (:class:`LoadResult`) and the messages made from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoadResult:
    """What ``load_into`` found, as ``transformers`` reports a load."""

    missing_keys: list[str] = field(default_factory=list)
    """In the target but not in the checkpoint (left untouched)."""
    unexpected_keys: list[str] = field(default_factory=list)
    """In the checkpoint but not in the target (not read)."""
    mismatched_keys: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    """(name, saved shape, target shape) for keys whose shapes differ (not read)."""
    bytes_read: int = 0
    """Bytes read from the checkpoint's files by this process."""
    meta_keys: list[str] = field(default_factory=list)
    """Parameters and buffers still on the ``meta`` device after the load (a model that
    cannot run): missing from the checkpoint, or non-persistent buffers the module's own
    initialization could not rebuild. Those a ``device_map`` sends to ``"meta"`` are not
    listed (see ``kept_off_keys``)."""
    prefix_mapping: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Module path (``""`` for the whole target) -> ``(checkpoint prefix, target prefix)``
    where the keys matched only after a rename, as ``from_pretrained`` does: ``("",
    "model.")`` loaded the checkpoint's ``norm.weight`` into ``model.norm.weight`` (a base
    model's checkpoint into a model with a head), ``("model.", "")`` the other way."""
    kept_off_keys: list[str] = field(default_factory=list)
    """Parameters and buffers a ``device_map`` sent to ``"meta"``: left unloaded as asked
    (``strict=True`` does not raise for them), but the model cannot run until they are
    loaded, so ``ok`` is False."""

    @property
    def ok(self) -> bool:
        """True when every key matched and no tensor is left on ``meta``: the model is whole.

        Example:
            >>> import shardpoint as sp
            >>> sp.LoadResult().ok, sp.LoadResult(kept_off_keys=["lm_head.weight"]).ok
            (True, False)
        """
        return self.matched and not self.kept_off_keys

    @property
    def matched(self) -> bool:
        """True when every key matched and nothing is on ``meta`` that the call did not send
        there (what ``strict=True`` requires): ``ok`` but for ``kept_off_keys``."""
        return not (self.missing_keys or self.unexpected_keys or self.mismatched_keys or self.meta_keys)

    def summary(self) -> str:
        """The report in a few lines (what ``strict=True`` raises with, minus the advice).

        Example:
            >>> import shardpoint as sp
            >>> print(sp.LoadResult(missing_keys=["w"], prefix_mapping={"": ("", "model.")}).summary())
            keys renamed to match: checkpoint '<name>' -> target 'model.<name>'
            missing from the checkpoint: 'w'
        """
        return "\n".join(report_lines(self))


def _show(items: Sequence[Any], limit: int = 10) -> str:
    head = ", ".join(
        repr(i) if isinstance(i, str) else f"{i[0]!r} (saved {list(i[1])}, target {list(i[2])})"
        for i in items[:limit]
    )
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


def report_lines(result: LoadResult) -> list[str]:
    lines = []
    for path, (old, new) in result.prefix_mapping.items():
        where = f" of {path!r}" if path else ""
        lines.append(
            f"keys{where} renamed to match: checkpoint {old + '<name>'!r} -> target {new + '<name>'!r}"
        )
    listed: tuple[tuple[str, Sequence[Any]], ...] = (
        ("missing from the checkpoint", result.missing_keys),
        ("unexpected (in the checkpoint, not the target)", result.unexpected_keys),
        ("shape mismatch", result.mismatched_keys),
    )
    lines.extend(f"{what}: {_show(keys)}" for what, keys in listed if keys)
    if result.meta_keys:
        lines.append(
            f"left on the meta device (the model cannot run): {_show(result.meta_keys, len(result.meta_keys))}"
        )
    if result.kept_off_keys:
        lines.append(
            "left on the meta device as device_map asked (the model cannot run until they are loaded): "
            f"{_show(result.kept_off_keys)}"
        )
    if not lines:
        lines.append("every key matched")
    return lines


def mismatch_message(location: str, result: LoadResult) -> str:
    parts = [f"loading {location} into the target does not match (strict=True):", *report_lines(result)]
    if result.meta_keys:
        parts.append(
            "a tensor on meta is neither in the checkpoint nor rebuilt by its module's own "
            "initialization: build the model with sp.empty_model (which keeps non-persistent "
            "buffers real) or set those tensors yourself before loading"
        )
    parts.append("nothing was loaded; pass strict=False to load the matching tensors and get this report")
    return "\n  ".join(parts)


def no_match_message(location: str, path: str, target_keys: list[str], saved_keys: list[str]) -> str:
    where = f"{path!r} of the target" if path else "the target"
    return (
        f"loading {location}: not one of its {len(saved_keys)} keys matches the {len(target_keys)} "
        f"keys of {where}, even with a base-model prefix added or removed, so nothing would load.\n  "
        f"checkpoint keys: {_show(sorted(saved_keys), 5)}\n  target keys: {_show(sorted(target_keys), 5)}\n  "
        "is this the checkpoint of this model? If the names differ by a prefix, rename them "
        "(sd = {new + k.removeprefix(old): v for k, v in sp.load(path).items()}) and load that dict "
        "(module.load_state_dict(sd), or copy its values into the dict)"
    )
