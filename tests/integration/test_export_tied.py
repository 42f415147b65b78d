"""Export of a model with tied weights (issue 26): a tiny transformers Llama whose
``lm_head.weight`` is tied to ``model.embed_tokens.weight`` is saved with DCP to SeaweedFS
(both names stored, as DCP does) and exported: the files hold as many tensors as
``save_pretrained`` writes, and ``from_pretrained`` of the export gives the original model's
logits. ``tied="keep"`` writes the duplicate; declared ties are proven by the bytes, and a
tie between tensors that differ, or to a missing or different-shaped tensor (also through a
crafted ``.metadata``), is refused before anything is written.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import run_cli
from safetensors import safe_open

from dcp_volumes import errors
from dcp_volumes.config import MiB
from dcp_volumes.export import export_safetensors
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.suite import Store

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("export")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _model(tie: bool) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _names(directory: Path) -> list[str]:
    names: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.extend(f.keys())
    return sorted(names)


def _save(store: Store, name: str, model: Any) -> str:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter

    url = store.url(name)
    dcp.save({"model": model.state_dict()}, no_dist=True,
             storage_writer=VolumeWriter(url, storage_options=store.storage_options))
    return url


@pytest.fixture(scope="module")
def store(seaweedfs: Any) -> Store:
    return seaweedfs.store()


@pytest.fixture(scope="module")
def tied(store: Store, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str, Path]:
    """The tied model, its DCP checkpoint on SeaweedFS, and what save_pretrained writes."""
    model = _model(tie=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reference = tmp_path_factory.mktemp("save-pretrained")
    model.save_pretrained(reference)
    return model, _save(store, "tied-llama", model), reference


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(12).reshape(2, 6)).logits  # type: ignore[no-any-return]


def _reload(directory: Path, model: Any) -> Any:
    model.config.save_pretrained(directory)  # the config a user ships with the weights
    return transformers.LlamaForCausalLM.from_pretrained(directory).eval()


def test_a_tied_model_exports_what_save_pretrained_writes_and_reloads_equal(
        store: Store, tied: tuple[Any, str, Path], tmp_path: Path) -> None:
    model, src, reference = tied
    hf = tmp_path / "hf"
    report = export_safetensors(src, hf, prefix="model.",
                                storage_options=store.storage_options)
    assert report.tied == ((HEAD, EMBED),)
    assert _names(hf) == _names(reference) and HEAD not in _names(hf)
    assert report.tensors == len(_names(reference)) == len(model.state_dict()) - 1
    reloaded = _reload(hf, model)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(reloaded), _logits(model))
    # the same, declared (the model's own _tied_weights_keys), and on the command line
    declared = export_safetensors(src, tmp_path / "declared", prefix="model.",
                                  tied=model._tied_weights_keys,
                                  storage_options=store.storage_options)
    assert declared.tied == report.tied and _names(tmp_path / "declared") == _names(hf)


def test_keep_tied_writes_the_duplicate(store: Store, seaweedfs: Any,
                                        tied: tuple[Any, str, Path], tmp_path: Path) -> None:
    model, src, reference = tied
    report = export_safetensors(src, tmp_path / "keep", prefix="model.", tied="keep",
                                storage_options=store.storage_options)
    assert report.tied == () and _names(tmp_path / "keep") == sorted([*_names(reference), HEAD])
    assert torch.equal(_logits(_reload(tmp_path / "keep", model)), _logits(model))
    env = seaweedfs.server.env()
    out = run_cli("export", src, str(tmp_path / "cli-keep"), "--prefix", "model.",
                  "--keep-tied", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tied"] == [] and HEAD in _names(tmp_path / "cli-keep")
    out = run_cli("export", src, str(tmp_path / "cli"), "--prefix", "model.", env=env)
    assert out.returncode == 0, out.stderr
    assert f"left out 1 tied duplicate: {HEAD} (= {EMBED})" in out.stdout
    assert _names(tmp_path / "cli") == _names(reference)


def _export_on_ranks(rank: int, world: int, src: str, dest: str, opts: dict[str, Any],
                     tied: Any) -> Any:
    return export_safetensors(src, dest, prefix="model.", max_shard_size="20KB", tied=tied,
                              storage_options=opts).to_dict()


def test_two_ranks_leave_out_what_one_rank_does(store: Store, tied: tuple[Any, str, Path],
                                                tmp_path: Path) -> None:
    # rank 0 proves the tie and sends its answer: every rank plans the same files
    model, src, reference = tied
    one = export_safetensors(src, tmp_path / "one", prefix="model.", max_shard_size="20KB",
                             storage_options=store.storage_options)
    reports = run_ranks(2, _export_on_ranks, src, str(tmp_path / "two"),
                        store.storage_options, "auto", timeout=180)
    assert [r["tied"] for r in reports] == [[[HEAD, EMBED]]] * 2
    assert all(r["bytes_written"] > 0 for r in reports)  # the files were split across ranks
    assert reports[0]["files"] == list(one.files) and len(one.files) > 2
    assert _names(tmp_path / "two") == _names(tmp_path / "one") == _names(reference)
    assert torch.equal(_logits(_reload(tmp_path / "two", model)), _logits(model))
    # a declared tie that rank 0 finds false fails every rank, typed, before any write
    differ = {"model.layers.1.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight"}
    with pytest.raises(RuntimeError) as failed:
        run_ranks(2, _export_on_ranks, src, str(tmp_path / "bad"), store.storage_options,
                  differ, timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: ConfigError: tied= ties" in str(failed.value), failed.value
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())


def test_an_untied_model_keeps_its_lm_head(store: Store, tmp_path: Path) -> None:
    model = _model(tie=False)
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    src = _save(store, "untied-llama", model)
    report = export_safetensors(src, tmp_path / "hf", prefix="model.",
                                storage_options=store.storage_options)
    assert report.tied == () and _names(tmp_path / "hf") == _names(reference)
    assert HEAD in _names(tmp_path / "hf")
    assert torch.equal(_logits(_reload(tmp_path / "hf", model)), _logits(model))


@pytest.mark.parametrize("tie, match", [
    ({HEAD: "model.layers.0.self_attn.q_proj.weight"}, "tied tensors have one dtype and shape"),
    ({HEAD: "model.missing.weight"}, "which is not an exported tensor"),
    ({"model.layers.1.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight"},
     "stored bytes differ"),
], ids=["other-shape", "missing", "bytes-differ"])
def test_impossible_declared_ties_fail_before_anything_is_written(
        store: Store, tied: tuple[Any, str, Path], tmp_path: Path, tie: dict[str, str],
        match: str) -> None:
    _, src, _ = tied
    with pytest.raises(errors.ConfigError, match=match):
        export_safetensors(src, tmp_path / "hf", prefix="model.", tied=tie,
                           storage_options=store.storage_options)
    assert not (tmp_path / "hf").exists() or not list((tmp_path / "hf").iterdir())


def _crafted(src: Path, edit: Any) -> str:
    """A copy of ``src`` whose (trusted, test-made) ``.metadata`` ``edit`` changes."""
    import shutil

    dst = src.parent / f"{src.name}-{edit.__name__}"
    shutil.copytree(src, dst)
    metadata = pickle.loads((dst / ".metadata").read_bytes())
    edit(metadata)
    (dst / ".metadata").write_bytes(pickle.dumps(metadata))
    return str(dst)


def test_crafted_metadata_cannot_make_a_tie(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # 3 MiB tensors in 1 MiB slabs: the comparison runs over several rounds
    a = torch.randn(768, 1024)
    b = a.clone()
    b[-1, -1] += 1  # differs in the last element only
    src = tmp_path / "ckpt"
    dcp.save({"model": {EMBED: a, HEAD: b}}, storage_writer=dcp.FileSystemWriter(str(src)))
    # equal but for the last element: auto keeps both, a declared tie is refused
    report = export_safetensors(str(src), tmp_path / "auto", prefix="model.",
                                storage_options={}, slab_size=MiB)
    assert report.tied == () and report.tensors == 2
    with pytest.raises(errors.ConfigError, match="stored bytes differ"):
        export_safetensors(str(src), tmp_path / "declared", prefix="model.",
                           tied={HEAD: EMBED}, storage_options={}, slab_size=MiB)

    def drop_embed(md: Any) -> None:  # the kept tensor is gone from .metadata
        del md.state_dict_metadata[f"model.{EMBED}"]

    def reshape_head(md: Any) -> None:  # lm_head claims another shape (a consistent lie)
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        head = md.state_dict_metadata[f"model.{HEAD}"]
        head.size = torch.Size([1024, 768])
        head.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]),
                                            sizes=torch.Size([1024, 768]))]

    for edit, match in ((drop_embed, "not an exported tensor"),
                        (reshape_head, "tied tensors have one dtype and shape")):
        crafted = _crafted(src, edit)
        with pytest.raises(errors.ConfigError, match=match):
            export_safetensors(crafted, tmp_path / "c", prefix="model.", tied={HEAD: EMBED},
                               storage_options={}, slab_size=MiB)
