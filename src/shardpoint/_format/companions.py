"""The files found beside a checkpoint's data files, and which of them are weights.

A model directory holds more than weights: ``config.json``, tokenizer files, a README, and
after ``transformers.Trainer`` also ``training_args.bin``, ``optimizer.pt``,
``scheduler.pt``, ``rng_state.pth``... ``verify`` and ``inspect`` list those as files they
do not check, without a warning. A file that looks like weights of the checkpoint's own
format but that the checkpoint does not reference (a stale
``model-00003-of-00003.safetensors`` missing from the index) is another matter: it is
warned about, since it usually means a save was mixed with an older one.
"""

from __future__ import annotations

import re

SAFETENSORS_WEIGHTS = (".safetensors", ".safetensors.index.json")
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt")
PICKLE_INDEXES = (".bin.index.json", ".pt.index.json")
OTHER_FORMAT_WEIGHTS = (".h5", ".msgpack", ".gguf", ".onnx", ".tflite", ".mlmodel", ".ot")
"""Weights in formats shardpoint never reads (TensorFlow, Flax, GGUF, ONNX, ...)."""

_TRAINING_FILES = re.compile(
    r"""^(training_args\.bin
        |(optimizer|scheduler|scaler|lr_scheduler)(_\d+)?\.(pt|pth|bin)
        |rng_state(_\d+)?\.pth
        |.*\.(json|jsonl|txt|md|model|jinja|yaml|yml|py|tiktoken|vocab|spm)
        |\.gitattributes|\.gitignore|LICENSE.*|NOTICE.*)$""",
    re.VERBOSE,
)
"""Names that are never weights: training state the ``Trainer`` saves beside them, configs,
tokenizer files, docs (a ``.json`` that is a weights index is caught before this)."""


def role(name: str, family: str) -> str:
    """How a file the checkpoint does not reference is reported.

    ``family`` is the format the checkpoint's data files are in: ``safetensors`` or
    ``pickle`` (``torch.save`` ``.bin`` / ``.pt``). Returns ``"weights"`` (looks like data
    of this checkpoint's own format: warned about), ``"other-weights"`` (weights in a format
    the loaders do not read here) or ``"other"`` (configs, tokenizers, training state).

    >>> role("model-00003-of-00003.safetensors", "safetensors")
    'weights'
    >>> role("pytorch_model.bin", "safetensors"), role("pytorch_model.bin", "pickle")
    ('other-weights', 'weights')
    >>> role("training_args.bin", "pickle"), role("tokenizer.json", "safetensors")
    ('other', 'other')
    """
    if name.endswith(SAFETENSORS_WEIGHTS):
        return "weights"
    if name.endswith(PICKLE_INDEXES) or (
        name.endswith(PICKLE_WEIGHTS) and not _TRAINING_FILES.match(name)
    ):
        return "weights" if family == "pickle" else "other-weights"
    if name.endswith(OTHER_FORMAT_WEIGHTS):
        return "other-weights"
    return "other"


_DESCRIBES_MODEL = re.compile(
    r"^(.*\.(json|txt|md|model|jinja|yaml|yml|py|tiktoken|vocab|spm)|LICENSE.*|NOTICE.*)$"
)
"""Configs, tokenizer and processor files, custom code, model card and license."""
_NOT_THE_MODELS = re.compile(
    r"^(\..*|shardpoint(-r\d+)?\.json|.*\.index\.json|trainer_state\.json)$"
)
"""Hidden files, shardpoint's manifests, weights indexes, the Trainer's progress record."""


def travels_with_weights(name: str) -> bool:
    """Whether a file beside a model's weights describes the model and so belongs beside
    its converted weights too: config, generation config, tokenizer and processor files,
    custom modeling code, the model card and license. Never weights of any format, indexes,
    shardpoint's manifests, DCP files, hidden files, nor the training state a ``Trainer``
    leaves (``training_args.bin``, ``trainer_state.json``, optimizer...).

    >>> [n for n in ["config.json", "tokenizer.json", "model.safetensors", "trainer_state.json",
    ...              "optimizer.pt", "README.md", "shardpoint.json", "shardpoint-r00001.json",
    ...              ".gitattributes", "merges.txt", "__0_0.distcp", "model.safetensors.index.json"]
    ...  if travels_with_weights(n)]
    ['config.json', 'tokenizer.json', 'README.md', 'merges.txt']
    """
    return bool(_DESCRIBES_MODEL.match(name)) and not _NOT_THE_MODELS.match(name)


def torch_weights_file(names: list[str]) -> tuple[str | None, list[str]]:
    """The one ``torch.save`` weights file of a directory without safetensors or an index:
    ``pytorch_model.bin`` when present, else the only ``.bin/.pt/.pth/.ckpt`` file that is
    not training state (``training_args.bin``, ``optimizer.pt``, ...); (name or None, the
    candidates considered).

    >>> torch_weights_file(["pytorch_model.bin", "training_args.bin", "config.json"])
    ('pytorch_model.bin', ['pytorch_model.bin'])
    >>> torch_weights_file(["a.pt", "b.pt"])
    (None, ['a.pt', 'b.pt'])
    """
    candidates = sorted(
        n for n in names if n.endswith(PICKLE_WEIGHTS) and role(n, "pickle") == "weights"
    )
    if "pytorch_model.bin" in candidates:
        return "pytorch_model.bin", candidates
    return (candidates[0] if len(candidates) == 1 else None), candidates
