"""The Hugging Face index ``<component>.safetensors.index.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from .names import check_file_name
from .safetensors import parse_json_object


@dataclass(frozen=True)
class HFIndex:
    weight_map: dict[str, str]
    """Tensor name -> file name."""
    metadata: dict[str, Any]


def index_name(component: str) -> str:
    return f"{component}.safetensors.index.json"


def render_index(weight_map: dict[str, str], total_size: int, total_parameters: int) -> bytes:
    """The index byte for byte as ``transformers`` 5's ``save_pretrained`` writes it: keys
    sorted at every level, two-space indent, ASCII escapes, a final newline.

    ``total_size`` is the bytes of tensor data stored; ``total_parameters`` the parameter
    count (``model.num_parameters()`` in ``transformers``).

    >>> print(render_index({"b": "m-2", "a": "m-1"}, 8, 2).decode(), end="")
    {
      "metadata": {
        "total_parameters": 2,
        "total_size": 8
      },
      "weight_map": {
        "a": "m-1",
        "b": "m-2"
      }
    }
    """
    doc = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": weight_map,
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode("utf-8") + b"\n"


def parse_index(raw: bytes, *, where: str) -> HFIndex:
    doc = parse_json_object(raw, where=where)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{where}: 'weight_map' is missing or not an object")
    for key, fname in weight_map.items():
        check_file_name(fname, where=f"{where}, tensor {key!r}")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"{where}: 'metadata' is not an object")
    return HFIndex(dict(weight_map), metadata)
