"""The pure plan of a safetensors export (``dcp_volumes.export._plan``): selection, dtypes,
Hugging Face's file split and names, the index, the rank split and row slabs. No torch, no
store: the headers are checked by parsing them back with the untrusted-header parser."""

from __future__ import annotations

import json

import pytest

from dcp_volumes import errors
from dcp_volumes.export import _format
from dcp_volumes.export._options import parse_size
from dcp_volumes.export._plan import INDEX, RESERVED_NAMES, SINGLE, SourceItem, plan_export
from dcp_volumes.export._work import assign_files, slabs

ITEMS = [
    SourceItem("model.layers.1.w", "float32", (100, 10)),  # 4000 bytes
    SourceItem("model.layers.0.w", "float32", (100, 10)),
    SourceItem("model.embed", "bfloat16", (50, 40)),  # 4000 bytes
    SourceItem("model.ids", "int64", (5,)),  # 40 bytes, never cast
    SourceItem("model.extra", None),  # a non-tensor item: reported, skipped
    SourceItem("optim.state.model.embed.exp_avg", "float32", (50, 40)),
    SourceItem("optim.param_groups.model.embed.lr", None),
]


def _parsed(f) -> _format.Header:
    return _format.parse_header(f.header_bytes[8:], f.size, f.name)


def test_one_file_when_it_fits_sorted_prefix_stripped_and_cast() -> None:
    plan = plan_export(ITEMS, prefix="model.", dtype="bf16")
    assert [f.name for f in plan.files] == [SINGLE] and plan.index_bytes() is None
    f = plan.files[0]
    assert [t.name for t in f.tensors] == ["embed", "ids", "layers.0.w", "layers.1.w"]
    assert {t.name: t.dtype for t in f.tensors} == {
        "embed": "bfloat16", "ids": "int64", "layers.0.w": "bfloat16", "layers.1.w": "bfloat16"}
    assert plan.skipped == ("model.extra",) and plan.not_selected == 2
    header = _parsed(f)  # what a reader of the file will see, checked as untrusted input
    assert [(e.name, e.dtype, e.shape) for e in header.entries] == [
        ("embed", "BF16", (50, 40)), ("ids", "I64", (5,)), ("layers.0.w", "BF16", (100, 10)),
        ("layers.1.w", "BF16", (100, 10))]
    assert header.metadata == {"format": "pt"}
    assert f.size == header.data_start + 4000 + 40 + 2 * 2000 == plan.file_bytes


def test_split_as_hugging_face_does_with_the_index() -> None:
    # 4000 + 40 + 4000 + 4000 bytes, at most 4500 per file; a 9000-byte tensor alone
    items = [*ITEMS[:4], SourceItem("model.zbig", "float32", (2250,))]
    plan = plan_export(items, prefix="model.", max_shard_size=4500)
    names = [f.name for f in plan.files]
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [[t.name for t in f.tensors] for f in plan.files] == [
        ["embed", "ids"], ["layers.0.w"], ["layers.1.w"], ["zbig"]]
    doc = json.loads(plan.index_bytes() or b"")
    assert doc["metadata"] == {"total_size": 4000 + 40 + 4000 + 4000 + 9000}
    assert doc["weight_map"] == {"embed": names[0], "ids": names[0], "layers.0.w": names[1],
                                 "layers.1.w": names[2], "zbig": names[3]}
    assert list(doc["weight_map"]) == sorted(doc["weight_map"])
    assert INDEX == "model.safetensors.index.json"


def test_rename_drops_and_renames() -> None:
    plan = plan_export(ITEMS, prefix="model.",
                       rename=lambda n: None if n == "ids" else f"model.{n}")
    assert [t.name for t in plan.files[0].tensors] == [
        "model.embed", "model.layers.0.w", "model.layers.1.w"]
    assert plan.not_selected == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"prefix": "modle."}, r"under prefix 'modle.'.*'model.', 'optim.'"),
    ({"prefix": "model.", "rename": lambda n: "same"}, r"both be exported as 'same'"),
    ({"prefix": "model.", "rename": lambda n: 3}, r"returned int"),
    ({"prefix": "model.", "dtype": "int8"}, r"bf16, fp16 or fp32"),
    ({"prefix": "model.", "max_shard_size": "5 parsecs"}, r"size like '5GB'"),
    ({"prefix": "model.", "max_shard_size": 0}, r"greater than 0"),
], ids=["unknown-prefix", "collision", "rename-not-str", "bad-dtype", "bad-size", "zero-size"])
def test_config_errors_say_what_to_change(kwargs, match) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        plan_export(ITEMS, **kwargs)


def test_unsupported_dtype_names_the_tensor() -> None:
    with pytest.raises(errors.ConfigError, match=r"'model.z'.*complex128"):
        plan_export([SourceItem("model.z", "complex128", (2,))], prefix="model.")


def test_sizes_files_to_ranks_and_slabs() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20
    assert parse_size(123) == 123 and parse_size("10KB") == 10_000
    items = [SourceItem(f"w{i}", "float32", (n,)) for i, n in enumerate([10, 1000, 600, 500])]
    plan = plan_export(items, max_shard_size=1)  # one tensor per file
    sizes = [f.size for f in plan.files]
    ranks = assign_files(plan.files, 2)
    assert sorted(i for r in ranks for i in r) == [0, 1, 2, 3]
    loads = [sum(sizes[i] for i in r) for r in ranks]
    assert max(loads) - min(loads) <= max(sizes)  # balanced by bytes
    assert assign_files(plan.files, 8)[5] == []  # more ranks than files: some idle
    t = plan_export([SourceItem("w", "float32", (10, 25))]).files[0].tensors[0]  # 100 B/row
    cut = slabs(t, 350, sliceable=True)
    assert [(s.start, s.stop) for s in cut] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert cut[1].offsets == (3, 0) and cut[1].shape == (3, 25)
    assert [(s.start, s.stop) for s in slabs(t, 350, sliceable=False)] == [(0, 10)]
    scalar = plan_export([SourceItem("s", "float32", ())]).files[0].tensors[0]
    assert [(s.shape, s.offsets) for s in slabs(scalar, 1, sliceable=True)] == [((), ())]


@pytest.mark.parametrize("items, kwargs", [
    ([SourceItem("__metadata__", "float32", (2,))], {}),
    ([SourceItem("model.__metadata__", "float32", (2,))], {"prefix": "model."}),
    ([SourceItem("w", "float32", (2,))], {"rename": lambda n: "__metadata__"}),
], ids=["key", "prefix-leaves-it", "rename-gives-it"])
def test_names_safetensors_reserves_are_refused_naming_them(items, kwargs) -> None:
    # issue 25, finding 1: a tensor named __metadata__ replaced the file's format metadata
    # and made the file unreadable, yet the export was reported OK and committed
    for name in RESERVED_NAMES:
        assert name == "__metadata__"
    with pytest.raises(errors.ConfigError, match=r"'__metadata__'.*reserves"):
        plan_export(items, **kwargs)
