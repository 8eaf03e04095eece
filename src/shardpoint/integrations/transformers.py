"""``save_pretrained`` / ``from_pretrained`` for ``transformers`` models, through shardpoint.

>>> import shardpoint as sp
>>> sp.integrations.transformers.save_pretrained(model, "out/llama")  # doctest: +SKIP
>>> model = sp.integrations.transformers.from_pretrained(AutoModelForCausalLM, "out/llama")  # doctest: +SKIP

``save_pretrained`` writes what ``transformers``' own ``save_pretrained`` writes for a
model's weights: the same ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``
files holding the same tensors (the tied names ``transformers`` keeps, ``"format": "pt"``)
and the same index byte for byte (``total_parameters``, ``total_size``, sorted keys);
``config.json`` and, for models that generate, ``generation_config.json``; all in one
atomic commit: the directory appears at
``path`` only when every file is on disk, next to shardpoint's manifest (so ``shardpoint
verify`` checks every byte, and ``sp.load_into`` reads it). Adapters (PEFT), quantized
models and remote code are not handled: use ``transformers``' ``save_pretrained`` for those.
"""

from __future__ import annotations

import copy
import inspect
import os
from typing import Any

import torch

from .._flags import check_flags
from .._hf_conversions import weights_to_save
from .._module_fit import unwrapped
from .._prepare import hf_storage, prepare_state
from .._sizes import parse_size
from .._write import SaveInfo, json_metadata, write_checkpoint
from ..errors import InvalidArgumentTypeError, InvalidStateError

__all__ = ["from_pretrained", "save_pretrained"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TRANSFORMERS_SHARD_SIZE = "50GB"
"""``transformers`` 5's default ``max_shard_size``, where the model's own cannot be read."""
_SAVE_KWARGS = ("durable", "metadata", "overwrite", "progress")


def _default_shard_size(model: Any) -> int | str:
    """The ``max_shard_size`` default of the model's own ``save_pretrained``."""
    try:
        default = inspect.signature(type(model).save_pretrained).parameters["max_shard_size"].default
    except (AttributeError, KeyError, TypeError, ValueError):
        return TRANSFORMERS_SHARD_SIZE
    return default if isinstance(default, (int, str)) and not isinstance(default, bool) else TRANSFORMERS_SHARD_SIZE


def _config_files(model: Any) -> dict[str, bytes]:
    """``config.json`` (and ``generation_config.json``) as ``model.save_pretrained`` writes them."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).split(".")[1]
    files = {CONFIG_NAME: config.to_json_string(use_diff=True).encode("utf-8")}
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(can_generate) and can_generate():
        files[GENERATION_CONFIG_NAME] = generation.to_json_string(use_diff=True).encode("utf-8")
    return files


def save_pretrained(
    model: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
    **save_kwargs: Any,
) -> SaveInfo:
    """Save a ``transformers`` model as a directory ``from_pretrained`` loads, atomically.

    Args:
        model: a ``PreTrainedModel``.
        path: the directory to create, or an existing one: one holding no weights (a
            tokenizer saved there first) is written into; one holding weights needs
            ``overwrite=True``. Either way the new weight files, index and config replace
            the old ones (stale shards are removed) and every other file is kept.
        max_shard_size: largest weight file, e.g. ``"5GB"`` (10^9 bytes) or ``"5GiB"``;
            default: the installed ``transformers``' own default (``"50GB"`` in
            ``transformers`` 5), so both write the same files.
        **save_kwargs: ``overwrite``, ``metadata``, ``durable``, ``progress``, as for
            :func:`shardpoint.save`.

    Returns:
        The :class:`~shardpoint.SaveInfo` of the weights.

    Raises:
        CheckpointExistsError: ``path`` holds weights and ``overwrite`` is not set.
        InvalidStateError: the model is not a ``transformers`` model, or has weights on the
            meta device.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> model = LlamaForCausalLM(config)
        >>> info = save_pretrained(model, "out/llama", max_shard_size="2GB")
        >>> sorted(info.files)
        ['model.safetensors']
        >>> type(LlamaForCausalLM.from_pretrained("out/llama")).__name__
        'LlamaForCausalLM'
    """
    unknown = sorted(set(save_kwargs) - set(_SAVE_KWARGS))
    if unknown:
        raise InvalidArgumentTypeError(
            f"save_pretrained() got unsupported argument(s) {', '.join(unknown)}; "
            f"it takes max_shard_size and {', '.join(_SAVE_KWARGS)}"
        )
    if isinstance(model, torch.nn.Module):  # torch.compile / DDP: the model's own names, as transformers writes them
        model = unwrapped(model)[0]
    adapters: Any = getattr(model, "peft_config", None) if isinstance(model, torch.nn.Module) else None
    if adapters:
        # peft's names (base_layer, lora_A.default) match no transformers class: from_pretrained
        # would start every weight from random values.
        raise InvalidStateError(
            f"save_pretrained() writes a transformers model, and this {type(model).__name__} holds PEFT adapters "
            f"({', '.join(sorted(map(str, adapters))) or 'default'}): save the adapters with the model's own "
            "save_pretrained(path) (adapter_model.safetensors, which PeftModel.from_pretrained reads), or merge them "
            "first (model = model.merge_and_unload()) and save the merged model here"
        )
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise InvalidStateError(
            f"save_pretrained() takes a transformers PreTrainedModel, not {type(model).__name__}; "
            "save other modules with sp.save(module.state_dict(), path)"
        )
    sharded = next((n for n, t in model.state_dict().items() if type(t).__name__ == "DTensor"), None)
    if sharded is not None:
        raise InvalidStateError(
            f"save_pretrained() writes a model from one process, and this one is sharded across ranks ({sharded!r} "
            "is a DTensor: FSDP2 or tensor parallel). Save it from every rank with sp.save(model.state_dict(), path, "
            "layout='hf') (the files from_pretrained reads, each rank writing its shards) and "
            "model.config.save_pretrained(path) on rank 0; or gather a full state dict first "
            "(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))"
        )
    max_bytes = parse_size(_default_shard_size(model) if max_shard_size is None else max_shard_size)
    metadata = json_metadata(save_kwargs.get("metadata"))
    weights, kept, reverted = weights_to_save(model)
    prepared = prepare_state(weights, keep=kept)
    comp = prepared.components[0]
    for name in reverted & set(comp.hf_storage):  # planned by their real storage, as save_pretrained plans them
        comp.hf_storage[name] = hf_storage(comp.tensors[name])
    num_parameters = getattr(model, "num_parameters", None)
    if callable(num_parameters):
        prepared.components[0].parameters = int(num_parameters())
    overwrite = save_kwargs.get("overwrite")
    check_flags("save_pretrained", overwrite=overwrite, durable=save_kwargs.get("durable", True),
                progress=save_kwargs.get("progress"), optional=("overwrite", "progress"))
    if overwrite is None:  # not given: write into a folder holding no weights, as transformers does
        overwrite = _holds_no_weights(path)
    return write_checkpoint(
        prepared,
        path,
        max_shard_bytes=max_bytes,
        overwrite=bool(overwrite),
        metadata=metadata,
        durable=bool(save_kwargs.get("durable", True)),
        progress=save_kwargs.get("progress"),
        extra_files=_config_files(model),
    )


def _holds_no_weights(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a local directory with neither a checkpoint nor weight files in
    it (say a tokenizer saved first): ``save_pretrained`` then writes into it without
    ``overwrite=True``, keeping its files, as ``transformers``' own does."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return not os.path.islink(path) and not any(
        n == "shardpoint.json" or n.endswith((".safetensors", ".safetensors.index.json", ".bin.index.json"))
        or (n.endswith(".bin") and n.startswith(("pytorch_model", "model")))  # not the Trainer's training_args.bin
        for n in names
    )


def from_pretrained(cls_or_auto: Any, path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``cls_or_auto.from_pretrained(path, **kwargs)``: ``transformers``' own loader.

    A directory written by :func:`save_pretrained` is a plain Hugging Face model
    directory, so ``LlamaForCausalLM``, ``AutoModelForCausalLM`` & co. load it as-is.

    Example:
        >>> from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> _ = save_pretrained(LlamaForCausalLM(config), "out/tiny-llama")
        >>> model = from_pretrained(AutoModelForCausalLM, "out/tiny-llama")
        >>> model.config.num_hidden_layers
        2
    """
    return cls_or_auto.from_pretrained(os.fspath(path), **kwargs)
