"""Which tensors an export leaves out as tied duplicates (``dcp_volumes.export._ties``, pure):
declared ties are checked against the exported names, dtypes and shapes and must be proven
by equal bytes; ``"auto"`` only ever considers ``lm_head.weight`` and keeps it unless exactly
one tensor of its dtype and shape equals it; nothing is left out on equal bytes alone. And the
CLI's ``--keep-tied``/``--tie``/``--extension`` are checked before any work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _cli import run_cli

from dcp_volumes import errors
from dcp_volumes.cli._exit import EXIT_USAGE
from dcp_volumes.export._plan import PlannedTensor, SourceItem, plan_export
from dcp_volumes.export._ties import candidates, checked_tied, resolve

ITEMS = [
    SourceItem("model.embed_tokens.weight", "float32", (64, 16)),
    SourceItem("lm_head.weight", "float32", (64, 16)),
    SourceItem("model.norm.weight", "float32", (16,)),
    SourceItem("model.layers.0.norm.weight", "float32", (16,)),
    SourceItem("model.layers.0.q.weight", "float32", (16, 16)),
    SourceItem("model.layers.1.q.weight", "float32", (16, 16)),
    SourceItem("model.half.weight", "float16", (64, 16)),
]
TENSORS = {t.name: t for f in plan_export(ITEMS).files for t in f.tensors}


def equal_if(*pairs: tuple[str, str]) -> Callable[[PlannedTensor, PlannedTensor], bool]:
    same = {frozenset(p) for p in pairs}
    return lambda a, b: frozenset((a.name, b.name)) in same


def test_auto_leaves_out_lm_head_equal_to_the_one_tensor_of_its_dtype_and_shape() -> None:
    found = candidates(list(TENSORS.values()), "auto")
    assert [(c.tensor.name, [o.name for o in c.options], c.declared) for c in found] == [
        ("lm_head.weight", ["model.embed_tokens.weight"], False)]  # not the float16 one
    tied = resolve(found, equal_if(("lm_head.weight", "model.embed_tokens.weight")))
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    plan = plan_export(ITEMS, tied=tied)
    assert plan.tensors == len(ITEMS) - 1 and plan.tied == (
        ("lm_head.weight", "model.embed_tokens.weight"),)
    assert "lm_head.weight" not in (plan.index_bytes() or b"").decode()
    # an untied model (different bytes): both kept, no error
    assert resolve(found, equal_if()) == {}


def test_equal_bytes_alone_never_leave_anything_out() -> None:
    # two layer norms at their initial ones are equal, and not tied
    everything_equal = equal_if(*[(a, b) for a in TENSORS for b in TENSORS])
    no_head = [t for t in TENSORS.values() if t.name != "lm_head.weight"]
    assert resolve(candidates(no_head, "auto"), everything_equal) == {}
    assert candidates(list(TENSORS.values()), "keep") == []


def test_an_ambiguous_auto_tie_keeps_the_tensor() -> None:
    items = [*ITEMS, SourceItem("model.other_embed.weight", "float32", (64, 16))]
    tensors = [t for f in plan_export(items).files for t in f.tensors]
    found = candidates(tensors, "auto")
    both = equal_if(("lm_head.weight", "model.embed_tokens.weight"),
                    ("lm_head.weight", "model.other_embed.weight"))
    assert resolve(found, both) == {}


def test_a_declared_tie_must_be_proven_by_equal_bytes() -> None:
    tie = {"model.layers.1.q.weight": "model.layers.0.q.weight"}
    found = candidates(list(TENSORS.values()), tie)
    assert resolve(found, equal_if(("model.layers.1.q.weight", "model.layers.0.q.weight"))
                   ) == tie
    with pytest.raises(errors.ConfigError, match="stored bytes differ"):
        resolve(found, equal_if())


@pytest.mark.parametrize("tie, match", [
    ({"lm_head.weight": "model.missing.weight"}, "'model.missing.weight', which is not an"),
    ({"missing": "model.embed_tokens.weight"}, "'missing', which is not an exported"),
    ({"lm_head.weight": "model.norm.weight"}, r"float32 \[16\]\): tied tensors have one"),
    ({"lm_head.weight": "model.half.weight"}, "float16"),
    ({"lm_head.weight": "lm_head.weight"}, "which is itself"),
    ({"lm_head.weight": "model.embed_tokens.weight",
      "model.embed_tokens.weight": "model.half.weight"}, "left out too"),
], ids=["kept-missing", "left-out-missing", "other-shape", "other-dtype", "self", "chain"])
def test_declared_ties_that_cannot_be_ties_are_config_errors(tie: dict[str, str],
                                                               match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        candidates(list(TENSORS.values()), tie)


@pytest.mark.parametrize("tied", [None, "drop", ["lm_head.weight"], {"a": 1}],
                         ids=["none", "unknown-word", "list", "non-str"])
def test_tied_option_is_checked(tied: object) -> None:
    with pytest.raises(errors.ConfigError, match="tied= must be"):
        checked_tied(tied)


def test_plan_refuses_a_tie_to_a_tensor_not_exported() -> None:
    with pytest.raises(errors.ConfigError, match="not exported"):
        plan_export(ITEMS, tied={"lm_head.weight": "nope"})


@pytest.mark.parametrize("args, match", [
    (["--keep-tied", "--tie", "lm_head.weight=embed.weight"], "pass one of them"),
    (["--tie", "lm_head.weight"], "expected NAME=KEPT"),
    (["--extension", "no_such_module_here:Rot13"], "cannot be registered"),
], ids=["keep-and-tie", "tie-not-a-pair", "extension-not-importable"])
def test_cli_tie_and_extension_flags_are_checked_first(tmp_path: Path, args: list[str],
                                                        match: str) -> None:
    result = run_cli("export", str(tmp_path / "no-checkpoint"), str(tmp_path / "hf"), *args)
    assert result.returncode == EXIT_USAGE and match in result.stderr, result.stderr
    assert not (tmp_path / "hf").exists()
