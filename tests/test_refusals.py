"""What cannot be stored is refused at save, naming the key; what is forged is refused at
load with the same CorruptCheckpointError by ``load`` and ``load_into``; read errors name
the file. Every error is a CheckpointError.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import shardpoint as sp
from shardpoint.errors import CorruptCheckpointError, InvalidStateError, StorageError

RESERVED = (
    "a tensor cannot be named '__metadata__': the safetensors format reserves that key for the "
    "file's metadata, and a tensor under it would make the file unreadable"
)


def _raises(cls: type[BaseException], text: str) -> Any:
    return pytest.raises(cls, match=re.escape(text))


# ------------------------------------------------------------------------ tensor names


def _save_paths() -> dict[str, Callable[[dict[str, torch.Tensor], Path], Any]]:
    def manager(state: dict[str, torch.Tensor], path: Path) -> None:
        sp.CheckpointManager(path).save(1, {"model": state, "step": 1})

    def async_save(state: dict[str, torch.Tensor], path: Path) -> None:
        sp.async_save(state, path).result()

    def convert(state: dict[str, torch.Tensor], path: Path) -> None:
        torch.save(state, path.parent / f"{path.name}.pt")
        sp.convert(path.parent / f"{path.name}.pt", path)

    return {
        "save-hf": lambda s, p: sp.save(s, p),
        "save-chunked": lambda s, p: sp.save(s, p, layout="chunked"),
        "save-nested": lambda s, p: sp.save({"model": s, "extra": {"n": 1}}, p),
        "async_save": async_save,
        "manager": manager,
        "convert": convert,
    }


@pytest.mark.parametrize("how", list(_save_paths()))
def test_a_tensor_named_metadata_is_refused_by_every_save(tmp_path: Path, how: str) -> None:
    """Before: it saved "successfully" and every load then refused the file as damaged."""
    path = tmp_path / "ckpt"
    state = {"w": torch.ones(2), "__metadata__": torch.zeros(3)}
    # convert reads a whole file that holds no checkpoint's state: unsupported, not an invalid state of the user's
    with _raises(sp.UnsupportedFormatError if how == "convert" else InvalidStateError, RESERVED):
        _save_paths()[how](state, path)
    assert not path.exists() or not any(path.rglob("*.safetensors"))


def test_save_pretrained_refuses_a_weight_named_metadata(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardpoint.integrations.transformers import save_pretrained

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32)
    model = LlamaForCausalLM(config)
    model.register_buffer("__metadata__", torch.ones(2))
    with _raises(InvalidStateError, RESERVED):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_name_with_a_lone_surrogate_is_refused(tmp_path: Path) -> None:
    with _raises(InvalidStateError, "tensor name 'w\\udc80' cannot be stored: it holds '\\udc80', which is "
                 "not valid Unicode text"):
        sp.save({"w\udc80": torch.ones(2)}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("name", ["", " ", "a\x00b", "line\nbreak", 'quote"s\\', "\u2028", "é.ß.名"])
def test_names_safetensors_accepts_round_trip(tmp_path: Path, name: str) -> None:
    """The rest of the class stores fine: we and the safetensors library read them back."""
    path = tmp_path / "ckpt"
    sp.save({name: torch.arange(3.0), "x": torch.ones(1)}, path)
    assert sp.load(path)[name].tolist() == [0.0, 1.0, 2.0]
    assert safetensors.torch.load_file(path / "model.safetensors")[name].tolist() == [0.0, 1.0, 2.0]


def test_a_header_past_the_readers_limit_is_refused_at_save(tmp_path: Path) -> None:
    from shardpoint._format.safetensors import TensorSpec, plan_file

    specs = [TensorSpec(f"{i:04d}" + "n" * 1_000_000, "U8", (0,), 0) for i in range(101)]
    with _raises(InvalidStateError, "over the 100000000-byte limit readers accept"):
        plan_file(specs, {"format": "pt"})


# ------------------------------------------------------------------------ exotic tensors


def test_a_nested_tensor_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Before: RuntimeError: NestedTensorImpl doesn't support sizes."""
    ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with _raises(InvalidStateError, "tensor 'ragged' is a nested (ragged) tensor; safetensors stores dense "
                 "tensors only"):
        sp.save({"ragged": ragged, "w": torch.ones(1)}, tmp_path / "ckpt")
    jagged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with _raises(InvalidStateError, "tensor 'j' is a nested (ragged) tensor"):
        sp.save({"j": jagged}, tmp_path / "ckpt")


def test_a_functorch_wrapped_tensor_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Before: NotImplementedError: Cannot access storage of TensorWrapper."""
    escaped: dict[str, torch.Tensor] = {}

    def f(x: torch.Tensor) -> torch.Tensor:
        escaped["x"] = x
        return x.sum()

    torch.func.grad(f)(torch.ones(3))
    with _raises(InvalidStateError, "tensor 'x' is a functorch-wrapped tensor"):
        sp.save({"x": escaped["x"]}, tmp_path / "ckpt")


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "quantized"])
def test_other_unstorable_kinds_are_refused(tmp_path: Path, kind: str) -> None:
    tensor = {
        "sparse_coo": lambda: torch.eye(2).to_sparse(),
        "sparse_csr": lambda: torch.eye(2).to_sparse_csr(),
        "quantized": lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
    }[kind]()
    with pytest.raises(InvalidStateError, match="tensor 't' "):
        sp.save({"t": tensor}, tmp_path / "ckpt")


def test_views_with_odd_strides_and_bits_round_trip_exactly(tmp_path: Path) -> None:
    """Expanded (zero stride), transposed, flipped, conjugate and negative-bit views, a
    non-leaf with grad, a tensor subclass: stored as their values. (``conj().imag[:1]`` of
    one element with stride 2 used to fail: "self.stride(-1) must be 1 to view Float as Byte";
    ``z.conj()`` saved beside ``z`` was stored as an alias of it and loaded as ``z``.)"""

    class Tagged(torch.Tensor):
        pass

    leaf = torch.ones(3, requires_grad=True)
    z = torch.tensor([1 + 2j, 3 - 1j])
    state = {
        "expanded": torch.arange(3.0).expand(4, 3),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "flipped": torch.arange(5.0).flip(0),
        "conj": z.conj(),
        "neg_bit": z.conj().imag,
        "neg_bit_one": torch.tensor([1 + 2j]).conj().imag,
        "non_leaf": leaf * 2,
        "subclass": torch.arange(4.0).as_subclass(Tagged),
        "complex": z,
    }
    sp.save(state, tmp_path / "ckpt")
    back = sp.load(tmp_path / "ckpt")
    for key, value in state.items():
        expected = value.detach().resolve_conj().resolve_neg().as_subclass(torch.Tensor)
        assert torch.equal(back[key], expected), key
    assert back["neg_bit"].tolist() == [-2.0, 1.0]
    # The same views as load_into targets: each shows the checkpoint's values after the load
    # (a lazily conjugated target raised torch's "view is not supported for conjugate view").
    base, neg_base = torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64)
    targets = {"conj": base.conj(), "neg_bit": neg_base.conj().imag, "complex": torch.zeros(2, dtype=torch.complex64)}
    assert sp.load_into(targets, tmp_path / "ckpt", strict=False).ok is False  # the other keys: unexpected
    assert torch.equal(targets["conj"].resolve_conj(), z.conj().resolve_conj())
    assert base.tolist() == [1 + 2j, 3 - 1j] and targets["neg_bit"].tolist() == [-2.0, 1.0]
    assert torch.equal(targets["complex"], z)


# --------------------------------------------------------------------- forged trees


def _forge_tree(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    path = tmp_path / "ckpt"
    model = torch.nn.Linear(2, 2)
    sp.save({"model": model, "extra": {"lr": 0.5, "names": ["a"]}}, path)
    doc = json.loads((path / "shardpoint.json").read_bytes())
    edit(doc["components"]["extra"]["tree"])
    (path / "shardpoint.json").write_text(json.dumps(doc))
    return path


def _set_lr(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(tree: dict[str, Any]) -> None:
        tree["items"][0][2] = value

    return edit


FORGED = {
    "huge-float": (_set_lr({"type": "float", "value": 10**400}), "float leaf 1000000000000000000000000"),
    "float-word": (_set_lr({"type": "float", "value": "lots"}), "float leaf 'lots' is not a number, 'nan'"),
    "unknown-type": (_set_lr({"type": "set", "items": []}), "unknown node type 'set'"),
    "not-an-object": (_set_lr(["x"]), "node \"['x']\" is not an object"),
    "dict-no-items": (_set_lr({"type": "dict"}), "dict node has no 'items' list"),
    "bad-key-kind": (_set_lr({"type": "dict", "items": [["int", "a", {"type": "json", "value": 1}]]}),
                     "dict key 'a' does not match its kind 'int'"),
    "duplicate-key": (_set_lr({"type": "dict", "items": [["str", "a", {"type": "json", "value": 1}]] * 2}),
                      "dict key 'a' appears twice"),
    "unknown-tensor": (_set_lr({"type": "tensor", "name": "nope"}),
                       "tensor leaf names 'nope', which is not a tensor of this component"),
    "json-object": (_set_lr({"type": "json", "value": {"a": 1}}), "json leaf \"{'a': 1}\" is not null"),
    "wrapper-no-value": (_set_lr({"type": "stateful"}), "stateful node has no 'value'"),
    "list-items": (_set_lr({"type": "list", "items": 3}), "list node has no 'items' list"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_forged_trees_raise_the_same_error_from_load_and_load_into(tmp_path: Path, case: str) -> None:
    """Before: OverflowError, AttributeError, KeyError or a bare ValueError from load_into
    where load raised CorruptCheckpointError (or nothing)."""
    edit, text = FORGED[case]
    path = _forge_tree(tmp_path, edit)
    prefix = f"{path / 'shardpoint.json'}, component 'extra': malformed state tree node at lr: "
    with _raises(CorruptCheckpointError, prefix + text) as from_load:
        sp.load(path)
    target = {"model": torch.nn.Linear(2, 2), "extra": {"lr": 0.1, "names": ["b"]}}
    with _raises(CorruptCheckpointError, prefix + text) as from_load_into:
        sp.load_into(target, path)
    assert str(from_load.value) == str(from_load_into.value)
    assert str(from_load.value).endswith("; the manifest is damaged or forged")


def test_a_deeply_nested_tree_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    node: dict[str, Any] = {"type": "json", "value": 1}
    for _ in range(300):
        node = {"type": "list", "items": [node]}
    path = _forge_tree(tmp_path, _set_lr(node))
    with _raises(CorruptCheckpointError, "the tree nests deeper than 200 levels"):
        sp.load(path)
    with _raises(CorruptCheckpointError, "the tree nests deeper than 200 levels"):
        sp.load_into({"model": torch.nn.Linear(2, 2), "extra": {"lr": 0.1, "names": ["b"]}}, path)


def test_a_forged_optimizer_state_is_refused_by_both(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "ckpt"
    sp.save({"model": model, "optim": optim}, path)
    doc = json.loads((path / "shardpoint.json").read_bytes())
    doc["components"]["optim"]["tree"]["value"]["items"] = []  # no state, no param_groups
    (path / "shardpoint.json").write_text(json.dumps(doc))
    text = "malformed state tree node at <root>: optimizer state has no 'state' dict"
    with _raises(CorruptCheckpointError, text):
        sp.load(path)
    with _raises(CorruptCheckpointError, text):
        sp.load_into({"model": torch.nn.Linear(2, 2), "optim": torch.optim.SGD(model.parameters(), lr=1)}, path)


def test_an_optimizer_refusing_its_saved_groups_is_a_load_mismatch(tmp_path: Path) -> None:
    """The saved state is well formed but the target optimizer has other groups."""
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "ckpt"
    sp.save({"opt": torch.optim.SGD(model.parameters(), lr=0.1)}, path)
    other = torch.nn.Linear(2, 2)
    target = torch.optim.SGD([{"params": [other.weight]}, {"params": [other.bias]}], lr=0.1)
    with pytest.raises(sp.CheckpointError):
        sp.load_into({"opt": target}, path)


# ------------------------------------------------------------------------- read errors


def test_eio_while_reading_a_header_names_the_file() -> None:
    """A real EIO from the kernel (reading unmapped memory through /proc/self/mem)."""
    from shardpoint._format.safetensors import read_header

    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        with _raises(StorageError, "/ckpt/model.safetensors: reading the safetensors header failed: "
                     "[Errno 5] Input/output error; the disk or file system reported an error") as info:
            read_header(fd, 100, name="/ckpt/model.safetensors", max_header_bytes=1000)
    finally:
        os.close(fd)
    assert isinstance(info.value, OSError) and info.value.errno == 5


def test_eio_while_reading_tensor_bytes_names_the_file() -> None:
    from shardpoint._io.reads import ReadTask, run_reads

    fd = os.open("/proc/self/mem", os.O_RDONLY)
    dest = torch.empty(16, dtype=torch.uint8)
    try:
        with _raises(StorageError, "/ckpt/model.safetensors: reading the file failed: [Errno 5] "
                     "Input/output error") as info:
            run_reads([ReadTask("/ckpt/model.safetensors", "/proc/self/mem", 0, 16, dest, torch.uint8,
                                None, "w", fd=fd)])
    finally:
        os.close(fd)
    assert info.value.errno == 5


def test_a_socket_in_place_of_a_data_file_is_refused(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "ckpt"
    sp.save({"w": torch.ones(2)}, path)
    (path / "model.safetensors").unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path / "model.safetensors"))
        with _raises(CorruptCheckpointError, f"{path / 'model.safetensors'} is not a regular file (a FIFO, "
                     "device, socket or directory); the checkpoint is damaged or forged"):
            sp.load(path)


def test_manager_warns_when_a_save_can_never_count(tmp_path) -> None:
    """Two saves that succeed but cannot do what the user meant get a warning each: a step
    older than every step keep_last keeps (removed at once), and metrics without the metric
    keep_best ranks by (a typo would otherwise leave best_steps() empty without a word)."""
    import warnings

    mgr = sp.CheckpointManager(tmp_path / "run", keep_last=2)
    mgr.save(10, {"w": torch.ones(2)})
    mgr.save(20, {"w": torch.ones(2)})
    with pytest.warns(UserWarning) as seen:
        info = mgr.save(5, {"w": torch.ones(2)})
    assert [str(w.message) for w in seen] == [
        f"step 5 was saved to {tmp_path / 'run' / 'step-000005'} and at once removed by retention: "
        "keep_last=2 keeps the newest steps, and 20 is newer. To train on from an earlier step, "
        "remove the later ones first (or raise keep_last)"
    ]
    assert not os.path.exists(info.path) and mgr.steps() == [10, 20]

    ranked = sp.CheckpointManager(tmp_path / "ranked", keep_last=1, keep_best=1, metric="val_loss")
    with pytest.warns(UserWarning) as seen:
        ranked.save(1, {"w": torch.ones(2)}, metrics={"val_los": 0.1})
    assert [str(w.message) for w in seen] == [
        "CheckpointManager.save(step 1): metrics holds no 'val_loss', the metric keep_best ranks "
        "steps by (given: 'val_los'); this step can never be kept as a best step"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranked.save(2, {"w": torch.ones(2)}, metrics={"val_loss": 0.5})
    assert ranked.best_steps() == [2]


def test_a_folder_of_checkpoints_is_named_as_such(tmp_path) -> None:
    """A CheckpointManager root (or a Trainer output_dir) is not a checkpoint; the error
    lists the checkpoints inside it (in step order) and names the newest to use."""
    mgr = sp.CheckpointManager(tmp_path / "run", keep_last=5)
    for step in (1, 2, 10, 11):
        mgr.save(step, {"w": torch.ones(2)})
    (tmp_path / "run" / "notes").mkdir()
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        sp.load(tmp_path / "run")
    assert str(exc.value).endswith(
        ". It holds checkpoints in subfolders (step-000001, step-000002, step-000010 and 1 more; a "
        "CheckpointManager root or a Trainer output_dir): name one of them, e.g. "
        f"{tmp_path / 'run' / 'step-000011'}"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        sp.load(empty)
    assert "subfolders" not in str(exc.value)


def test_load_into_refuses_a_copy_that_would_drop_part_of_each_value(tmp_path) -> None:
    """Fractions into an integer or bool tensor, an imaginary part into a real one: refused
    before anything is read (sp.load(dtype=int) is refused too). A module's buffers keep
    torch's copy rules (a mask stored as float32 loads into a bool buffer)."""
    sp.save({"a": torch.tensor([1.5, -2.5]), "c": torch.tensor([1 + 2j]), "n": torch.tensor([3, 4])}, tmp_path / "ck")
    target = {"a": torch.zeros(2, dtype=torch.int64), "c": torch.zeros(1), "n": torch.zeros(2)}
    with pytest.raises(sp.LoadMismatchError) as exc:
        sp.load_into(target, tmp_path / "ck")
    assert str(exc.value) == (
        f"{tmp_path / 'ck'}: 'a' (F32 -> int64), 'c' (C64 -> float32): stored as floating-point or "
        "complex values, and the target tensor is of an integer, bool or real dtype; copying would "
        "drop the fraction or the imaginary part. Make the target that dtype, or read the values "
        "with sp.load and convert them yourself; nothing was loaded"
    )
    assert torch.equal(target["n"], torch.zeros(2))  # nothing was loaded
    ok = {"a": torch.zeros(2, dtype=torch.bfloat16), "c": torch.zeros(1, dtype=torch.complex128),
          "n": torch.zeros(2)}
    assert sp.load_into(ok, tmp_path / "ck").ok and torch.equal(ok["n"], torch.tensor([3.0, 4.0]))

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.zeros(2, dtype=torch.bool))

    sp.save({"mask": torch.tensor([1.0, 0.0])}, tmp_path / "mask")
    module = Masked()
    assert sp.load_into(module, tmp_path / "mask").ok
    assert module.mask.tolist() == [True, False]


def test_unstorable_dtypes_get_advice_that_keeps_their_values(tmp_path) -> None:
    with pytest.raises(sp.InvalidStateError) as exc:
        sp.save({"c": torch.tensor([1 + 2j, 3 - 4j]).to(torch.complex32)}, tmp_path / "c")
    assert str(exc.value) == (
        "tensor 'c' has dtype torch.complex32, which safetensors cannot store; convert it with "
        "`.to(torch.complex64)` (complex values in float32 parts) before saving"
    )
    assert not (tmp_path / "c").exists()
    # A torch.ao quantized module: one sentence for the module, not advice for one tensor of it.
    quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4)), {torch.nn.Linear},
                                                       dtype=torch.qint8)
    with pytest.raises(sp.InvalidStateError, match=r"it is the packed weight of a torch\.ao quantized module, which "
                                                   r"safetensors cannot store\. Save the float model"):
        sp.save(quantized, tmp_path / "quantized")
    # complex128: the advice keeps every bit (complex64 rounded 1e-12j to 9.99999996e-13j).
    z = torch.tensor([1 + 1e-12j], dtype=torch.complex128)
    with pytest.raises(sp.InvalidStateError, match=r"store `torch.view_as_real\(t\)` \(its float64 parts, exactly\)"):
        sp.save({"z": z}, tmp_path / "z")
    sp.save({"z": torch.view_as_real(z)}, tmp_path / "z")
    assert torch.equal(torch.view_as_complex(sp.load(tmp_path / "z")["z"]), z)
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return  # torch < 2.8 has no FP4 dtype
    # FP4 packs two values a byte, and torch casts it to nothing: `.to(torch.float32)` failed.
    fp4 = torch.tensor([[0x12, 0x34]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(sp.InvalidStateError) as exc:
        sp.save({"q": fp4}, tmp_path / "q")
    assert str(exc.value) == (
        "tensor 'q' has dtype torch.float4_e2m1fn_x2, which shardpoint does not store (safetensors' F4: two 4-bit "
        "values a byte, where shardpoint's reads and resharding count whole bytes); store its bytes, "
        "`.view(torch.uint8)` (two 4-bit values each), and view them back with `.view(torch.float4_e2m1fn_x2)` "
        "after loading"
    )
    sp.save({"q": fp4.view(torch.uint8)}, tmp_path / "q")
    assert sp.load(tmp_path / "q")["q"].view(torch.float4_e2m1fn_x2).view(torch.uint8).tolist() == [[0x12, 0x34]]
    # A safetensors file holding F4 (safetensors writes it): said to be unread, not "unknown dtype".
    from safetensors.torch import save_file

    (tmp_path / "f4").mkdir()
    try:
        save_file({"w": fp4}, tmp_path / "f4" / "model.safetensors")
    except Exception:  # a safetensors older than its F4
        return
    with pytest.raises(sp.UnsupportedFormatError) as exc:
        sp.load(tmp_path / "f4")
    assert str(exc.value) == (
        f"{tmp_path / 'f4' / 'model.safetensors'}, tensor 'w': dtype F4 (4-bit floats packed two to a byte, "
        "torch.float4_e2m1fn_x2) is one shardpoint does not read: its elements are smaller than a byte. The file "
        "itself may be whole; read it with safetensors (safe_open or safetensors.torch.load_file)"
    )


def test_a_device_map_key_that_names_nothing_is_refused(tmp_path) -> None:
    """A typo or a trailing dot in a device_map key would place nothing where it says."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    sp.save(model.state_dict(), tmp_path / "ck")
    empty = sp.empty_model(torch.nn.Sequential, torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(sp.InvalidArgumentError) as exc:
        sp.load_into(empty, tmp_path / "ck", device_map={"": "cpu", "1.": "meta"})
    assert str(exc.value) == (
        "device_map['1.'] names no module, parameter or buffer of the Sequential being loaded (keys "
        "are module names as in named_modules(), '' for the whole model); did you mean '1'?"
    )
    assert sp.load_into(empty, tmp_path / "ck", device_map={"0": "cpu", "1.weight": "cpu", "1.bias": "cpu"}).ok


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, [True]])
def test_switches_take_only_true_or_false(tmp_path, value) -> None:
    """A switch given "no" read as true: trust_pickle="no" ran a pickle's code, and
    overwrite="no" replaced a checkpoint. Every switch of a public call takes a bool."""
    sp.save({"w": torch.ones(2)}, tmp_path / "ck")
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    calls = {
        "save(overwrite": lambda: sp.save({"w": torch.zeros(2)}, tmp_path / "ck", overwrite=value),
        "save(allow_pickle": lambda: sp.save({"w": torch.zeros(2)}, tmp_path / "new", allow_pickle=value),
        "save(durable": lambda: sp.save({"w": torch.zeros(2)}, tmp_path / "new", durable=value),
        "async_save(overwrite": lambda: sp.async_save({"w": torch.zeros(2)}, tmp_path / "ck", overwrite=value),
        "load(allow_pickle": lambda: sp.load(tmp_path / "ck", allow_pickle=value),
        "load(mmap": lambda: sp.load(tmp_path / "ck", mmap=value),
        "load_into(strict": lambda: sp.load_into({"w": torch.zeros(2)}, tmp_path / "ck", strict=value),
        "convert(trust_pickle": lambda: sp.convert(tmp_path / "m.pt", tmp_path / "out", trust_pickle=value),
        "convert(overwrite": lambda: sp.convert(tmp_path / "m.pt", tmp_path / "ck", overwrite=value),
        "CheckpointManager(async_save": lambda: sp.CheckpointManager(tmp_path / "run", async_save=value),
    }
    for call, run in calls.items():
        with pytest.raises(sp.InvalidArgumentTypeError) as exc:
            run()
        assert str(exc.value).startswith(f"{call}={value!r}): pass True or False"), (call, str(exc.value))
    assert torch.equal(sp.load(tmp_path / "ck")["w"], torch.ones(2))
    assert not (tmp_path / "new").exists() and not (tmp_path / "out").exists()
    # Optional switches still take None (their default: decided from the terminal / options).
    assert sp.load(tmp_path / "ck", progress=None, verify=None)["w"].tolist() == [1.0, 1.0]


def test_a_step_whose_manifest_is_json_but_not_a_manifest_is_damaged_not_whole(tmp_path) -> None:
    """'{}' parses: it used to count as a whole step, and with keep_last=2 retention kept it
    and deleted a real step. It is skipped as damaged: never counted, never deleted."""
    root = tmp_path / "run"
    mgr = sp.CheckpointManager(root, keep_last=2)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    (root / "step-000003").mkdir()
    (root / "step-000003" / "shardpoint.json").write_text("{}")
    with pytest.warns(UserWarning, match=r"step 3 under .* is damaged and is skipped .*it is not a shardpoint manifest"):
        mgr.save(4, {"w": torch.full((2,), 4.0)})
        mgr.save(5, {"w": torch.full((2,), 5.0)})
    assert sorted(p.name for p in root.iterdir()) == [".shardpoint-writer.lock", "latest", "step-000003", "step-000004",
                                                      "step-000005"]


def test_arguments_that_failed_deep_inside_are_refused_at_the_call(tmp_path) -> None:
    """Each used to pass the call's checks and fail later with a bare error: an option over
    what C sizes hold (OverflowError), a device of a backend this torch lacks (a bare
    AssertionError for 'xpu', an out-of-memory error for 'mps'), metadata nested past
    the recursion limit (RecursionError)."""
    sp.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(sp.InvalidArgumentError, match=r"^IOOptions.segment_bytes must be at most 2\*\*48, not 1180591620717411303424$"):
        sp.IOOptions(segment_bytes=2**70)
    for device in ("xpu", "mps"):
        if getattr(torch, device, None) is not None and torch.__dict__[device].is_available():
            continue
        with pytest.raises(sp.InvalidArgumentError) as exc:
            sp.load(tmp_path / "ck", device=device)
        assert str(exc.value) == f"device {device!r}: torch has no {device} device on this machine; load to 'cpu' (or check the torch build)"
    deep: Any = 1
    for _ in range(3000):
        deep = [deep]
    with pytest.raises(sp.InvalidStateError, match=r"^metadata nests too deeply to store as JSON; flatten it$"):
        sp.save({"w": torch.ones(2)}, tmp_path / "deep", metadata={"d": deep})
    assert not (tmp_path / "deep").exists()


@pytest.mark.parametrize("value", ["abc", "inf", [1], True, None])
def test_metrics_are_numbers(tmp_path, value) -> None:
    """A string metric was stored as it was, and "inf" / "nan" came back as floats (the
    encoding of non-finite numbers); a bool ranked as 0/1. Metrics are numbers."""
    mgr = sp.CheckpointManager(tmp_path / "run", keep_last=1)
    with pytest.raises(sp.InvalidStateError) as exc:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"note": value})
    assert str(exc.value) == (
        f"metrics['note'] = {str(value)!r}: metrics are JSON numbers by name (floats, ints, one-element "
        "tensors), what keep_best ranks steps by; put other values in the state"
    )
    assert mgr.steps() == []
    mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": float("inf"), "n": 3, "t": torch.tensor(0.5)})
    assert mgr.metrics(1) == {"loss": float("inf"), "n": 3, "t": 0.5}


def test_manager_save_arguments_are_checked_when_it_is_made(tmp_path) -> None:
    """A misspelled save argument (keep= for keep_last=) was kept and failed at the first
    save, possibly hours into training, with a bare TypeError from inside save()."""
    with pytest.raises(sp.InvalidArgumentTypeError) as exc:
        sp.CheckpointManager(tmp_path / "run", keep=3)
    assert str(exc.value) == (
        "CheckpointManager() got unsupported argument(s) keep (did you mean keep_last?); it takes "
        "keep_last, keep_best, metric, mode, async_save, storage_options, process_group, options and, "
        "for every save, max_shard_size, layout, durable, allow_pickle, progress, overwrite"
    )
    with pytest.raises(sp.InvalidArgumentTypeError, match=r"^CheckpointManager\(\) got unsupported argument\(s\) "
                       r"metadata \(did you mean metrics= of CheckpointManager.save\?\)"):
        sp.CheckpointManager(tmp_path / "run", metadata={"run": "a"})  # the manager writes it: was dropped
    with pytest.raises(sp.InvalidArgumentTypeError, match=r"^CheckpointManager\(durable='no'\): pass True or False"):
        sp.CheckpointManager(tmp_path / "run", durable="no")
    with pytest.raises(sp.InvalidSizeError, match=r"^CheckpointManager\(max_shard_size=\.\.\.\): cannot parse size '5XB'"):
        sp.CheckpointManager(tmp_path / "run", max_shard_size="5XB")
    mgr = sp.CheckpointManager(tmp_path / "run", max_shard_size="1KB", durable=False, progress=None)
    assert len(mgr.save(1, {"a": torch.ones(500), "b": torch.ones(500)}).files) == 2


@pytest.mark.parametrize("damage", ["manifest", "bytes", "file"])
def test_restore_of_a_damaged_newest_step_names_the_older_one(tmp_path, damage) -> None:
    """restore() never falls back to an older step by itself (that silently repeats
    training); the error names the newest older step and how to restore it, and says the
    target may hold part of the damaged step."""
    root = tmp_path / "run"
    mgr = sp.CheckpointManager(root, keep_last=3)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    newest = root / "step-000003"
    if damage == "manifest":
        (newest / "shardpoint.json").write_text("{garbage")
        cls, first = CorruptCheckpointError, f"{newest / 'shardpoint.json'} is not valid JSON"
    elif damage == "bytes":
        with open(newest / "model.safetensors", "r+b") as f:
            f.seek(-4, 2)
            f.write(b"XXXX")
        cls, first = sp.ChecksumMismatchError, f"{newest / 'model.safetensors'}, tensor 'w': crc32c"
    else:
        (newest / "model.safetensors").unlink()
        cls, first = sp.MissingShardError, f"{newest / 'model.safetensors'} is missing"
    target = {"w": torch.zeros(4)}
    with pytest.raises(cls) as exc:
        mgr.restore(target)
    message = str(exc.value)
    assert message.startswith(first), message
    assert message.endswith(f"Step 3 is the newest under {root}; restore(state, step=2) restores the newest "
                            "older step (committed: [1, 2])"), message
    assert ("The target may now hold part of this checkpoint's values" in message) == (damage == "bytes")
    assert mgr.restore(target, step=2) == 2 and target["w"].tolist() == [2.0] * 4


def test_manager_step_arguments_and_roots_are_checked(tmp_path) -> None:
    """restore(step='3') said "no committed step 3; it has [3, 4]", 3.0 was a bare
    ValueError, metrics() of a step never saved called it damaged; a root that is a step
    (the checkpoint to resume from) restored nothing, so training silently started over."""
    root = tmp_path / "run"
    mgr = sp.CheckpointManager(root, keep_last=3)
    for step in (3, 4):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    for bad, extra in (("3", " (convert it with int(...))"), (3.0, " (convert it with int(...))"), (True, "")):
        with pytest.raises(sp.InvalidArgumentTypeError) as exc:
            mgr.restore({"w": torch.zeros(2)}, step=bad)
        assert str(exc.value) == f"CheckpointManager.restore: step must be a non-negative int, not {bad!r}{extra}"
    with pytest.raises(sp.CheckpointNotFoundError) as exc:
        mgr.metrics(1)
    assert str(exc.value) == f"{root} has no committed step 1; it has [3, 4]"
    with pytest.raises(sp.InvalidArgumentError) as exc:
        sp.CheckpointManager(root / "step-000004")
    assert str(exc.value) == (
        f"CheckpointManager root {root / 'step-000004'} is a checkpoint (it holds shardpoint.json), not a folder "
        f"of steps; use CheckpointManager({str(root)!r}) and restore(state, step=4) to resume from it"
    )
    with pytest.raises(sp.InvalidArgumentError, match=r"^CheckpointManager root .*model.safetensors is a file, not a directory"):
        sp.CheckpointManager(root / "step-000004" / "model.safetensors")
    assert sorted(os.listdir(root / "step-000004")) == ["model.safetensors", "shardpoint.json"]


def test_saving_a_step_older_than_a_kept_one_warns_that_restore_takes_the_newer(tmp_path) -> None:
    """Rolled back to step 30 and saved step 40 of a new run: step 50 of the abandoned run
    stays the newest, and a crash would resume it without a word."""
    mgr = sp.CheckpointManager(tmp_path / "run", keep_last=3)
    for step in (30, 50):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    with pytest.warns(UserWarning) as seen:
        mgr.save(40, {"w": torch.full((2,), 40.0)})
    assert [str(w.message) for w in seen] == [
        f"step 40 was saved under {tmp_path / 'run'}, but step(s) [50] are newer: restore() and 'latest' choose "
        "the newest (50), so a resume would continue from there, not from step 40. If training went back to an "
        "earlier step, remove the newer steps (or save into another root)"
    ]


def test_manager_steps_of_any_integer_type_and_dict_targets_renamed_only_by_wrappers(tmp_path) -> None:
    """numpy integer steps (from a loop over np.arange) work as ints; a plain dict target is
    renamed only by wrapper prefixes: {p.a} into {q.a} is no rename to make silently."""
    import numpy as np

    mgr = sp.CheckpointManager(tmp_path / "run")
    mgr.save(np.int64(2), {"w": torch.ones(2)})
    assert mgr.steps() == [2] and mgr.restore({"w": torch.zeros(2)}, step=np.int32(2)) == 2
    sp.save({"p.a": torch.ones(2), "p.b": torch.ones(2)}, tmp_path / "p")
    with pytest.raises(sp.LoadMismatchError, match=r"not one of its 2 keys matches the 2 keys of the target"):
        sp.load_into({"q.a": torch.zeros(2), "q.b": torch.zeros(2)}, tmp_path / "p", strict=False)


def test_targets_sharing_part_of_their_memory_are_refused_before_loading(tmp_path) -> None:
    """x[0:10] and x[5:15] as two targets: the second load overwrote half of the first, with
    ok=True (load_state_dict does the same). Views that interleave without sharing an
    element (the halves of a fused weight's columns) still load."""
    sp.save({"a": torch.ones(10), "b": torch.full((10,), 2.0)}, tmp_path / "ab")
    base = torch.zeros(15)
    with pytest.raises(sp.LoadMismatchError) as exc:
        sp.load_into({"a": base[0:10], "b": base[5:15]}, tmp_path / "ab")
    assert str(exc.value) == (
        f"{tmp_path / 'ab'}: 'a' and 'b' share part of their memory in the target (overlapping views of one "
        "storage, not one tensor): loading both would leave one holding part of the other's values. Give each "
        "memory of its own (.clone()), or read the checkpoint with sp.load and copy what you need; nothing was "
        "loaded"
    )
    assert base.tolist() == [0.0] * 15

    class Overlapping(torch.nn.Module):  # a parameter and a buffer over one storage
        def __init__(self) -> None:
            super().__init__()
            store = torch.zeros(6)
            self.p = torch.nn.Parameter(store[0:4])
            self.register_buffer("q", store[2:6])

    sp.save({"p": torch.ones(4), "q": torch.full((4,), 2.0)}, tmp_path / "pq")
    with pytest.raises(sp.LoadMismatchError, match=r"'p' and 'q' share part of their memory"):
        sp.load_into(Overlapping(), tmp_path / "pq")

    fused = torch.zeros(3, 8)  # column halves: their spans meet, their elements do not
    sp.save({"left": torch.ones(3, 4), "right": torch.full((3, 4), 2.0)}, tmp_path / "halves")
    assert sp.load_into({"left": fused[:, :4], "right": fused[:, 4:]}, tmp_path / "halves").ok
    assert fused[:, :4].eq(1).all() and fused[:, 4:].eq(2).all()


def test_overlapping_targets_are_found_among_many_tensors_and_many_interleaved_views(tmp_path) -> None:
    """The check has no size cap (a model of 10^5 tensors is checked too), and a fused weight
    cut into many column views is one pass over its memory, not a comparison per pair."""
    n = 30_000
    sp.save({f"k{i}": torch.full((2,), float(i)) for i in range(n)}, tmp_path / "many")
    base = torch.zeros(2 * n + 1)
    target = {f"k{i}": base[2 * i:2 * i + 2] for i in range(n)}
    target[f"k{n - 1}"] = base[2 * n - 3:2 * n - 1]  # shares an element with k{n-2}
    with pytest.raises(sp.LoadMismatchError, match=rf"'k{n - 2}' and 'k{n - 1}' share part of their memory"):
        sp.load_into(target, tmp_path / "many")
    assert not base.any()

    columns = torch.zeros(4, 256)
    sp.save({f"c{i}": torch.full((4, 1), float(i)) for i in range(256)}, tmp_path / "columns")
    assert sp.load_into({f"c{i}": columns[:, i:i + 1] for i in range(256)}, tmp_path / "columns").ok
    assert columns.equal(torch.arange(256.0).expand(4, 256))
    sp.save({**{f"c{i}": torch.ones(4, 1) for i in range(256)}, "c7b": torch.ones(2, 2)}, tmp_path / "block")
    with pytest.raises(sp.LoadMismatchError, match=r"'c7' and 'c7b' share part of their memory"):
        sp.load_into({**{f"c{i}": columns[:, i:i + 1] for i in range(256)}, "c7b": columns[1:3, 7:9]},
                     tmp_path / "block")
