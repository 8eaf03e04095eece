"""``sp.diff`` / ``shardpoint diff``: keys, shapes, dtypes, values and tolerance, across formats."""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import math
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint._cli.main import main


def _state() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "layer.weight": torch.full((2, 2), 2.0),
        "layer.bias": torch.tensor([1.0, -1.0], dtype=torch.bfloat16),
        "steps": torch.tensor([3, 4], dtype=torch.int64),
    }


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def base(tmp_path: Path) -> Path:
    sp.save(_state(), tmp_path / "a")
    return tmp_path / "a"


def test_equal_across_formats(
    tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(_state(), tmp_path / "b.pt")
    report = sp.diff(base, tmp_path / "b.pt")
    assert report.equal and not report.only_in_a and not report.only_in_b
    assert [t.status for t in report.tensors] == ["equal"] * 4
    assert report.compared_bytes == 48 + 16 + 4 + 16

    code, out, err = run_cli(capsys, "diff", base, tmp_path / "b.pt")
    assert code == 0, err
    assert out.splitlines()[-1] == "equal: 4 tensors (84 B) match (atol=0, rtol=0)"


def test_changed_value_shows_key_and_max_abs(
    tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _state()
    state["layer.weight"][1, 0] = 2.5
    sp.save(state, tmp_path / "b")
    report = sp.diff(base, tmp_path / "b")
    assert not report.equal
    [changed] = report.differences
    assert (changed.key, changed.status, changed.max_abs, changed.max_rel, changed.mismatched) == (
        "layer.weight",
        "changed",
        0.5,
        0.2,
        1,
    )

    code, out, _ = run_cli(capsys, "diff", base, tmp_path / "b")
    assert code == 1
    lines = out.splitlines()
    assert lines[2].split() == ["KEY", "STATUS", "DTYPE", "SHAPE", "MAX", "ABS", "MAX", "REL"]
    assert lines[3].split() == [
        "layer.weight",
        "changed",
        "F32",
        "[2,",
        "2]",
        "5.000e-01",
        "2.000e-01",
    ]
    assert lines[-1] == "DIFFERENT: 1 of 4 tensors differ (1 changed) (atol=0, rtol=0)"


def test_changed_shape_and_dtype(tmp_path: Path, base: Path) -> None:
    state = _state()
    state["embed.weight"] = torch.zeros(4, 4)
    state["steps"] = state["steps"].to(torch.int32)
    torch.save(state, tmp_path / "b.pt")
    report = sp.diff(base, tmp_path / "b.pt")
    by_key = {t.key: t for t in report.tensors}
    shape = by_key["embed.weight"]
    assert (shape.status, shape.shape_a, shape.shape_b, shape.max_abs) == (
        "shape",
        (3, 4),
        (4, 4),
        None,
    )
    dtype = by_key["steps"]
    assert (dtype.status, dtype.dtype_a, dtype.dtype_b, dtype.max_abs) == (
        "dtype",
        "I64",
        "I32",
        0.0,
    )
    assert {t.key for t in report.differences} == {"embed.weight", "steps"}


def test_renamed_key_is_only_in_a_and_only_in_b(
    tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _state()
    state["layer.w"] = state.pop("layer.weight")
    sp.save(state, tmp_path / "b")
    report = sp.diff(base, tmp_path / "b")
    assert (report.only_in_a, report.only_in_b) == (["layer.weight"], ["layer.w"])
    assert not report.differences and not report.equal

    code, out, _ = run_cli(capsys, "diff", base, tmp_path / "b")
    assert code == 1
    assert any(line.split() == ["layer.weight", "only", "in", "A"] for line in out.splitlines())
    assert any(line.split() == ["layer.w", "only", "in", "B"] for line in out.splitlines())
    assert (
        out.splitlines()[-1]
        == "DIFFERENT: 0 of 3 tensors differ, 1 only in A, 1 only in B (atol=0, rtol=0)"
    )


def test_tolerance_is_respected(
    tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _state()
    state["embed.weight"] = state["embed.weight"] + 1e-3  # |b| up to 11: relative 1e-3 .. 1
    sp.save(state, tmp_path / "b")
    assert run_cli(capsys, "diff", base, tmp_path / "b")[0] == 1
    code, out, _ = run_cli(capsys, "diff", base, tmp_path / "b", "--atol", "1e-2")
    assert code == 0
    assert out.splitlines()[-1] == (
        "equal: 4 tensors (84 B) match, 1 within tolerance but not identical (atol=0.01, rtol=0)"
    )
    assert run_cli(capsys, "diff", base, tmp_path / "b", "--atol", "1e-4")[0] == 1
    # relative: b holds 0.001 where a holds 0, so rtol alone (< 1) never covers that element
    assert run_cli(capsys, "diff", base, tmp_path / "b", "--rtol", "0.5")[0] == 1
    assert run_cli(capsys, "diff", base, tmp_path / "b", "--rtol", "1.0")[0] == 0
    report = sp.diff(base, tmp_path / "b", atol=1e-4)
    [t] = report.differences
    assert t.mismatched == 12 and t.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert t.max_rel == pytest.approx(1.0, rel=1e-3)  # 0.001 / |0.001| at the first element


def test_nan_equal_at_same_position_and_json_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = {"x": torch.tensor([1.0, math.nan, 3.0])}
    sp.save(a, tmp_path / "a")
    torch.save({"x": torch.tensor([1.0, math.nan, 3.0])}, tmp_path / "same.pt")
    torch.save({"x": torch.tensor([1.0, 2.0, 3.0])}, tmp_path / "other.pt")
    assert sp.diff(tmp_path / "a", tmp_path / "same.pt").equal

    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "other.pt", "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["equal"] is False and doc["only_in_a"] == [] and doc["only_in_b"] == []
    assert doc["tensors"] == [
        {
            "key": "x",
            "status": "changed",
            "dtype_a": "F32",
            "dtype_b": "F32",
            "shape_a": [3],
            "shape_b": [3],
            "max_abs": "nan",
            "max_rel": "nan",
            "mismatched": 1,
        }
    ]


def test_nested_states_compare_tensors_and_plain_values(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    sp.save({"model": model, "epoch": 3, "lr": 0.1}, tmp_path / "a")
    sp.save({"model": model, "epoch": 4, "lr": 0.1}, tmp_path / "b")
    report = sp.diff(tmp_path / "a", tmp_path / "b")
    assert [t.key for t in report.tensors] == ["model/weight", "model/bias"]
    assert not report.differences
    assert [(v.key, v.a, v.b) for v in report.values] == [("epoch", 3, 4)]
    assert not report.equal


class Shade(enum.Enum):
    DARK = 1
    LIGHT = 2


def test_typed_values_are_compared(tmp_path: Path) -> None:
    """Paths, Enum members, datetimes and the fields of Namespaces and dataclasses are values too."""
    base = {"p": Path("a"), "ns": argparse.Namespace(n=1), "t": datetime.date(2024, 1, 1), "c": Shade.DARK}
    sp.save({"hp": base}, tmp_path / "a")
    sp.save({"hp": {**base, "p": Path("b"), "ns": argparse.Namespace(n=2)}}, tmp_path / "b")
    sp.save({"hp": {**base, "c": Shade.LIGHT, "t": datetime.date(2025, 1, 1)}}, tmp_path / "c")
    report = sp.diff(tmp_path / "a", tmp_path / "b")
    assert [(v.key, v.a, v.b) for v in report.values] == [("hp/p", "Path(a)", "Path(b)"), ("hp/ns.n", 1, 2)]
    report = sp.diff(tmp_path / "a", tmp_path / "c")
    assert [(v.key, v.a, v.b) for v in report.values] == [
        ("hp/t", "date(2024-01-01)", "date(2025-01-01)"),
        ("hp/c", f"{__name__}:Shade.DARK", f"{__name__}:Shade.LIGHT"),
    ]
    same = sp.diff(tmp_path / "a", tmp_path / "a")
    assert same.equal and not same.values


def test_values_that_differ_in_structure_or_type_are_differences(tmp_path: Path) -> None:
    """diff said "equal" (exit 0) where sp.load returns other objects: int against str keys
    (torch's Optimizer.load_state_dict tells them apart), a tuple against a list, {} against
    [] or against nothing, and a Path against the string that reads the same."""
    ones = torch.ones(2)
    sp.save({"model": {"w": ones}, "opt": {"state": {0: {"step": 5}}, "param_groups": [{"betas": (0.9, 0.99)}]},
             "extra": {"history": {}, "cb": [], "p": Path("/data")}}, tmp_path / "a")
    sp.save({"model": {"w": ones}, "opt": {"state": {"0": {"step": 5}}, "param_groups": [{"betas": [0.9, 0.99]}]},
             "extra": {"history": [], "gone": {}, "p": "Path(/data)"}}, tmp_path / "b")
    report = sp.diff(tmp_path / "a", tmp_path / "b")
    assert not report.equal and not report.differences
    assert [(v.key, repr(v.a), repr(v.b)) for v in report.values] == [
        ("opt/state", "dict (int keys)", "dict (str keys)"),
        ("opt/param_groups.0.betas", "tuple", "list"),
        ("extra/history", "empty dict", "empty list"),
        ("extra/cb", "empty list", "<absent>"),
        ("extra/p", "Path(/data)", "'Path(/data)'"),
        ("extra/gone", "<absent>", "empty dict"),
    ]
    assert sp.diff(tmp_path / "a", tmp_path / "a").equal


def test_errors_exit_2(tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "diff", base, tmp_path / "missing")
    assert code == 2 and out == "" and "does not exist" in err

    torch.save({"w": torch.ones(1), "c": argparse.Namespace(lr=0.1)}, tmp_path / "pickled.pt")
    code, _, err = run_cli(capsys, "diff", base, tmp_path / "pickled.pt")
    assert code == 2 and str(tmp_path / "pickled.pt") in err and "--trust-pickle" in err
    with pytest.raises(sp.CheckpointError, match="atol and rtol must be >= 0"):
        sp.diff(base, base, atol=-1)


def test_diff_a_converted_dcp_checkpoint(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(4, 4), "b": torch.zeros(4)}, "step": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(sp.UnsafePickleError):
        sp.diff(tmp_path / "dcp", tmp_path / "dcp")
    sp.convert(tmp_path / "dcp", tmp_path / "out", trust_pickle=True, dtype="bf16")
    report = sp.diff(tmp_path / "dcp", tmp_path / "out", trust_pickle=True)
    assert [t.status for t in report.tensors] == ["dtype", "dtype"]
    assert report.tensors[0].max_rel is not None and report.tensors[0].max_rel < 2**-8
    assert not report.values and not report.only_in_a and not report.only_in_b


# ------------------------------------------------------------------------------ ties


def _tied_state() -> dict[str, torch.Tensor]:
    emb = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {"emb.weight": emb, "mid": torch.ones(2), "head.weight": emb}


def test_alias_against_separately_stored_copy_is_equal_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sp.save(_tied_state(), tmp_path / "tied")
    untied = {k: v.clone() for k, v in _tied_state().items()}
    sp.save(untied, tmp_path / "untied")
    report = sp.diff(tmp_path / "tied", tmp_path / "untied")
    assert report.equal and not report.only_in_a and not report.only_in_b
    assert [t.key for t in report.tensors] == ["emb.weight", "mid", "head.weight"]
    [note] = report.notes
    assert (note.key, note.a, note.b, note.alias_of_a, note.alias_of_b, note.compared_as) == (
        "head.weight", "alias", "stored", "emb.weight", None, None,
    )
    code, out, _ = run_cli(capsys, "diff", tmp_path / "tied", tmp_path / "untied")
    assert code == 0
    assert out.splitlines()[-2:] == [
        "note: head.weight: an alias of emb.weight in A (tied, stored once), stored in B; values compared",
        "equal: 3 tensors (56 B) match, 1 tied name stored differently (notes above) (atol=0, rtol=0)",
    ]
    # A separately stored copy that differs is a difference, tie or not.
    untied["head.weight"] = untied["head.weight"] + 1
    sp.save(untied, tmp_path / "changed")
    report = sp.diff(tmp_path / "tied", tmp_path / "changed")
    assert not report.equal and [t.key for t in report.differences] == ["head.weight"]
    assert run_cli(capsys, "diff", tmp_path / "tied", tmp_path / "changed")[0] == 1


def test_tied_name_absent_on_the_other_side_compares_through_its_twin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    sp.save(_tied_state(), tmp_path / "tied")
    (tmp_path / "hf").mkdir()
    dropped = {k: v.clone() for k, v in _tied_state().items() if k != "head.weight"}
    save_file(dropped, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    for a, b, side in [("tied", "hf", "a"), ("hf", "tied", "b")]:
        report = sp.diff(tmp_path / a, tmp_path / b)
        assert report.equal and not report.only_in_a and not report.only_in_b, (a, b)
        [note] = report.notes
        assert (note.key, getattr(note, side), note.compared_as) == ("head.weight", "alias", "emb.weight")
    code, out, _ = run_cli(capsys, "diff", tmp_path / "hf", tmp_path / "tied", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["equal"] is True and doc["only_in_a"] == [] and doc["only_in_b"] == []
    assert doc["notes"] == [
        {
            "key": "head.weight",
            "a": "absent",
            "b": "alias",
            "alias_of_a": None,
            "alias_of_b": "emb.weight",
            "compared_as": "emb.weight",
            "message": "head.weight: absent from A (tied weight not saved), an alias of emb.weight in B "
            "(tied, stored once); compared as emb.weight",
        }
    ]
    # The twin's values still decide: a changed embedding is a difference.
    save_file({**dropped, "emb.weight": dropped["emb.weight"] * 2}, str(tmp_path / "hf" / "model.safetensors"),
              metadata={"format": "pt"})
    report = sp.diff(tmp_path / "tied", tmp_path / "hf")
    assert [t.key for t in report.differences] == ["emb.weight"] and not report.equal


def test_a_missing_name_that_is_no_tie_stays_only_in_one_side(tmp_path: Path) -> None:
    sp.save(_tied_state(), tmp_path / "tied")
    # B lacks the head and the embedding it is tied to: nothing to compare it through.
    sp.save({"mid": torch.ones(2)}, tmp_path / "mid")
    report = sp.diff(tmp_path / "tied", tmp_path / "mid")
    assert report.only_in_a == ["emb.weight", "head.weight"] and not report.notes
    # An untied extra name is a difference even when other names are tied.
    sp.save({**_tied_state(), "extra": torch.zeros(1)}, tmp_path / "extra")
    report = sp.diff(tmp_path / "tied", tmp_path / "extra")
    assert report.only_in_b == ["extra"] and not report.notes and not report.equal


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_save_pretrained_against_shardpoint_save_pretrained_exits_0(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    from shardpoint.integrations.transformers import save_pretrained

    torch.manual_seed(0)
    common = {"vocab_size": 50, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, **common)
        )
        tied = ["lm_head.weight"]
    else:
        model = transformers.T5ForConditionalGeneration(
            transformers.T5Config(d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                                  decoder_start_token_id=0, **common)
        )
        tied = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
    model.save_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "sp")
    kept = "transformer.wte.weight" if family == "gpt2" else "shared.weight"
    for a, b in [("sp", "hf"), ("hf", "sp")]:
        code, out, err = run_cli(capsys, "diff", tmp_path / a, tmp_path / b)
        assert code == 0, out + err
        notes = [line for line in out.splitlines() if line.startswith("note: ")]
        assert [n.split(":")[1].strip() for n in notes] == tied
        assert all(n.endswith(f"; compared as {kept}") for n in notes)
        assert "only in" not in out and "DIFFERENT" not in out
        assert out.splitlines()[-1].startswith("equal: ")


def test_integers_beyond_float64_s_precision_are_compared_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nanosecond timestamps and 2**62-sized counters differ by less than float64 can
    tell (2**62 + 256 rounds to 2**62): compared as integers, they are different."""
    ns = 1_732_000_000_000_000_000
    sp.save({"t": torch.tensor([ns, 2**62], dtype=torch.int64)}, tmp_path / "a")
    sp.save({"t": torch.tensor([ns + 100, 2**62 + 256], dtype=torch.int64)}, tmp_path / "b")
    report = sp.diff(tmp_path / "a", tmp_path / "b")
    [changed] = report.differences
    assert (changed.status, changed.max_abs, changed.mismatched) == ("changed", 256.0, 2)
    assert sp.diff(tmp_path / "a", tmp_path / "b", atol=256).equal
    assert not sp.diff(tmp_path / "a", tmp_path / "b", atol=255).equal
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert out.splitlines()[-1] == "DIFFERENT: 1 of 1 tensors differ (1 changed) (atol=0, rtol=0)"


def test_one_component_of_a_training_checkpoint_compares_with_a_flat_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer checkpoint ({"model", "optim", "step"}) against the model's own files: no
    key in common (model/w vs w), so the summary says how; --component model compares the
    weights, which are equal."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sp.save({"model": model, "optim": opt, "step": 7}, tmp_path / "train")
    sp.save(model.state_dict(), tmp_path / "weights")
    code, out, _ = run_cli(capsys, "diff", tmp_path / "train", tmp_path / "weights")
    assert code == 1
    assert out.splitlines()[-1] == (
        "(no key in common: to compare one component of a nested side with a flat one, pass --component, "
        "e.g. --component model)")
    code, out, _ = run_cli(capsys, "diff", tmp_path / "train", tmp_path / "weights", "--component", "model")
    assert code == 0, out
    assert out.splitlines()[-1].startswith("equal: 2 tensors")
    report = sp.diff(tmp_path / "weights", tmp_path / "train", component="model")
    assert report.equal and [t.key for t in report.tensors] == ["weight", "bias"]
    with pytest.raises(sp.InvalidArgumentError, match=r"has no component 'optimizer'; it has 'model', 'optim'"):
        sp.diff(tmp_path / "train", tmp_path / "weights", component="optimizer")


def test_top_level_tensors_beside_plain_values_are_keyed_as_load_keys_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``{"w": t, "b": t, "step": 3}`` stores each tensor as a component of its own; diff and
    inspect name them ``w`` and ``b`` as sp.load does (they were ``w/`` and ``b/``, and the
    same tensors in a flat file compared as "only in A" / "only in B")."""
    w, b = torch.arange(6.0).reshape(2, 3), torch.zeros(3)
    sp.save({"w": w, "b": b, "step": 3, "opt": {"m": torch.ones(2)}}, tmp_path / "a")
    assert sorted(sp.load(tmp_path / "a")) == ["b", "opt", "step", "w"]
    torch.save({"w": w, "b": b}, tmp_path / "b.pt")
    code, out, _ = run_cli(capsys, "diff", tmp_path / "a", tmp_path / "b.pt", "--json")
    report = json.loads(out)
    assert code == 1
    assert [(t["key"], t["status"]) for t in report["tensors"]] == [("w", "equal"), ("b", "equal")]
    assert (report["only_in_a"], report["only_in_b"]) == (["opt/m"], [])
    assert report["values"] == [{"key": "step", "a": 3}]
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "a")
    assert code == 0
    rows = [line.split()[0] for line in out.splitlines()[out.splitlines().index("  NAME   DTYPE  SHAPE   SIZE  FILE") + 1:]]
    assert rows == ["w", "b", "opt/m"]
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "a", "--filter", "^w$")
    assert "tensors: 1 of 1 matching '^w$' (3 in all)" in out


def test_infinities_are_close_only_to_the_same_infinity(tmp_path) -> None:
    """With rtol > 0, -inf against +inf and 1e6 against inf passed (inf <= atol + rtol * inf),
    and MAX REL showed 0 for them; torch.isclose calls them different."""
    inf = math.inf
    torch.save({"w": torch.tensor([-inf, 1e6, 2.0, inf])}, tmp_path / "a.pt")
    torch.save({"w": torch.tensor([inf, inf, 2.0, inf])}, tmp_path / "b.pt")
    report = sp.diff(tmp_path / "a.pt", tmp_path / "b.pt", rtol=1e-6)
    (t,) = report.tensors
    assert not report.equal and t.status == "changed" and t.mismatched == 2
    assert t.max_abs == inf and math.isnan(t.max_rel)
    want = torch.isclose(torch.tensor([-inf, 1e6, 2.0, inf]), torch.tensor([inf, inf, 2.0, inf]), rtol=1e-6)
    assert int((~want).sum()) == t.mismatched


def test_diff_reads_the_file_named_not_its_safetensors_sibling(tmp_path) -> None:
    """`diff model.pt model.safetensors` read model.safetensors for both (load's sibling
    rule) and said equal, whatever model.pt held: diff is asked whether they are the same."""
    from safetensors.torch import save_file

    torch.save({"w": torch.ones(3)}, tmp_path / "model.pt")
    save_file({"w": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    report = sp.diff(tmp_path / "model.pt", tmp_path / "model.safetensors")
    assert not report.equal and report.tensors[0].max_abs == 1.0
    assert sp.load(tmp_path / "model.pt")["w"].tolist() == [0.0, 0.0, 0.0]  # load keeps its rule (a warning)
    torch.save({"w": torch.zeros(3)}, tmp_path / "model.pt")
    assert sp.diff(tmp_path / "model.pt", tmp_path / "model.safetensors").equal
