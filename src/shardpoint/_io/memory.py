"""The bytes of a tensor in host memory, as the I/O engines move them: views without
copies where the tensor's memory already holds exactly its stored bytes."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import StateChangedError


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().reshape(-1)
    if flat.stride(0) != 1:  # one element with any stride (e.g. ``x.conj().imag[:1]``)
        flat = flat.as_strided((flat.numel(),), (1,))
    # ``ndarray.data`` is ``memoryview(array)``; numpy types ``__buffer__`` for Python 3.12+ only.
    return flat.view(torch.uint8).numpy().data.cast("B")


def local_tensor(dtensor: Any) -> torch.Tensor:
    """The local tensor of a DTensor itself, not an autograd node: ``to_local`` with grad
    mode on builds one (~35 us a tensor); a ``no_grad`` block costs ~8 us, so it is entered
    only when grad mode is on."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return dtensor.to_local()
    return dtensor.to_local()


def contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is a contiguous CPU tensor, else a contiguous CPU copy."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its memory holds exactly its stored bytes (contiguous CPU, no
    lazy conjugate or negative bit), else such a copy (:func:`contiguous_cpu`)."""
    if tensor.is_contiguous() and tensor.device.type == "cpu" and not (tensor.is_conj() or tensor.is_neg()):
        return tensor
    return contiguous_cpu(tensor)


def unchanged_size(key: str, got: int, planned: int, *, where: str = "") -> None:
    """Raise :class:`StateChangedError` when a tensor holds ``got`` bytes where the save
    planned ``planned``: another thread resized it while it was being saved."""
    if got != planned:
        raise StateChangedError(
            f"{where + ': ' if where else ''}tensor {key!r} changed size while it was being saved "
            "(another thread resized it); nothing was committed. Save when the state is not being changed"
        )


def storage_less(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no memory of its own to read into: a wrapper subclass (as
    torchao's quantized and float8 tensors are), whose values only its own ``copy_`` sets."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or type(tensor).__name__ == "DTensor" or tensor.is_meta:
        return False
    try:
        tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return True
    return False
