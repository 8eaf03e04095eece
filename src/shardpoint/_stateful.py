"""Objects that are not plain containers: modules, optimizers, anything ``Stateful``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(sd)`` can be saved and restored.

    Example:
        >>> class Counter:
        ...     def __init__(self): self.n = 0
        ...     def state_dict(self): return {"n": self.n}
        ...     def load_state_dict(self, sd): self.n = sd["n"]
        >>> isinstance(Counter(), Stateful)
        True
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def to_state(obj: Any, where: str) -> Any:
    """Plain state of a module / optimizer / Stateful, or NotImplemented."""
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, Stateful):
        return obj.state_dict()
    return NotImplemented
