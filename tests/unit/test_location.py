"""One validated store location: URL + backend + storage_options typed per backend."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from dcp_volumes import Checkpointer, VolumeReader, VolumeWriter, catalog
from dcp_volumes.backends import StorageOptions, StoreLocation, open_backend
from dcp_volumes.errors import ConfigError

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def test_options_are_checked_once_and_never_shown() -> None:
    loc = StoreLocation.parse("s3://bucket/run/step-1",
                              {"key": "AKIA", "secret": SECRET, "endpoint_url": "http://x:1",
                               "some_fsspec_kwarg": object()})
    assert loc.kind == "s3" and loc.url == "s3://bucket/run/step-1"
    assert isinstance(loc.options, StorageOptions)
    for text in (repr(loc), str(loc), repr(loc.options), str(loc.options)):
        assert SECRET not in text and "AKIA" not in text
        assert "secret" in text  # the keys are named
    # unknown keys pass to fsspec unchanged, known ones keep their values
    assert loc.options["secret"] == SECRET and "some_fsspec_kwarg" in loc.options
    assert {**loc.options}["key"] == "AKIA"


def test_checked_options_are_read_only_and_pickle() -> None:
    loc = StoreLocation.parse("memory://run/step-1", {"a": 1})
    with pytest.raises(TypeError):
        loc.options["a"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        loc.options.update(b=1)
    again = pickle.loads(pickle.dumps(loc))
    assert again == loc and again.options.kind == "memory"
    assert dict(again.options) == {"a": 1}


@pytest.mark.parametrize("url, options, named", [
    ("s3://bucket/run", {"anon": "yes"}, "anon"),
    ("s3://bucket/run", {"config_kwargs": 3}, "config_kwargs"),
    ("s3://bucket/run", {"secret": 12345}, "secret"),
    ("gs://bucket/run", {"project": 7}, "project"),
    ("az://container/run", {"account_key": b"bytes"}, "account_key"),
    ("/tmp/run", {"auto_mkdir": "no"}, "auto_mkdir"),
], ids=["s3-anon", "s3-config_kwargs", "s3-secret", "gcs-project", "azure-key", "local-mkdir"])
def test_a_known_key_of_the_wrong_type_is_named_not_shown(url: str, options: dict[str, Any],
                                                          named: str) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        StoreLocation.parse(url, options)
    assert "12345" not in str(info.value) and "bytes'" not in str(info.value)


@pytest.mark.parametrize("bad", ["key=1", ["a"], 3], ids=["str", "list", "int"])
def test_not_a_dict_is_refused_the_same_way_everywhere(bad: Any) -> None:
    for make in (lambda: VolumeWriter("/tmp/x", storage_options=bad),
                 lambda: VolumeReader("/tmp/x", storage_options=bad),
                 lambda: Checkpointer("/tmp/x", storage_options=bad),
                 lambda: catalog.list_checkpoints("/tmp/x", storage_options=bad),
                 lambda: open_backend("/tmp/x", bad)):
        with pytest.raises(ConfigError, match="storage_options must be a dict"):
            make()


def test_none_means_fsspec_default_and_keys_must_be_strings() -> None:
    assert dict(StoreLocation.parse("s3://b/run", {"key": None}).options) == {"key": None}
    with pytest.raises(ConfigError, match="keys must be strings"):
        StoreLocation.parse("s3://b/run", {1: "x"})


def test_checked_options_travel_without_a_second_check() -> None:
    ckpt = Checkpointer("memory://loc-run", storage_options={"auto_mkdir": True})
    assert isinstance(ckpt.storage_options, StorageOptions)
    writer = VolumeWriter("memory://loc-run/step-1", storage_options=ckpt.storage_options)
    assert writer.location.options is ckpt.storage_options
    writer.reset("memory://loc-run/step-2")  # same backend: the same checked options
    assert writer.url == "memory://loc-run/step-2"
    assert writer.location.options is ckpt.storage_options


def test_pacing_is_a_constructor_argument() -> None:
    loc = StoreLocation.parse("memory://loc-pacing/step-1")
    assert loc.open().throttle is not None
    assert loc.open(pacing=False).throttle is None
    assert open_backend("memory://loc-pacing/step-1", None, pacing=False).throttle is None


def test_an_options_argument_of_the_wrong_type_is_refused_in_one_wording() -> None:
    with pytest.raises(ConfigError, match=r"retry= must be a RetryOptions or None, got int"):
        VolumeWriter("/tmp/x", retry=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"retry= must be a RetryOptions or None, got dict"):
        VolumeReader("/tmp/x", retry={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError,
                       match=r"local_tier= must be a LocalTierOptions or None, got str"):
        VolumeWriter("/tmp/x", local_tier="/tmp/tier")  # type: ignore[arg-type]
