"""The dtypes of the safetensors format and their torch equivalents."""

from __future__ import annotations

import torch

from ..errors import InvalidStateError, UnsupportedFormatError

_CANDIDATES: list[tuple[str, str]] = [
    ("F64", "float64"),
    ("F32", "float32"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I64", "int64"),
    ("I32", "int32"),
    ("I16", "int16"),
    ("I8", "int8"),
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("C64", "complex64"),
]

NAME_TO_DTYPE: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _CANDIDATES if hasattr(torch, attr)
}
DTYPE_TO_NAME: dict[torch.dtype, str] = {dtype: name for name, dtype in NAME_TO_DTYPE.items()}


def dtype_from_name(name: object, *, where: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype string; ``where`` names the file and tensor."""
    if not isinstance(name, str) or name not in NAME_TO_DTYPE:
        raise UnsupportedFormatError(
            f"{where}: unknown dtype {repr(name)[:80]}; known dtypes are {', '.join(NAME_TO_DTYPE)}"
        )
    return NAME_TO_DTYPE[name]


def dtype_name(dtype: torch.dtype, *, key: str) -> str:
    """The safetensors dtype string for a torch dtype; ``key`` names the tensor."""
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        raise InvalidStateError(
            f"tensor {key!r} has dtype {dtype}, which safetensors cannot store; "
            f"convert it (e.g. `.to(torch.float32)`) before saving"
        ) from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return int(dtype.itemsize)
