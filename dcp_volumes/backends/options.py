"""``storage_options``: the fsspec options of one store, typed per backend, checked once.

Each backend's known keys are a :class:`~typing.TypedDict` below (in the style of obstore's
typed configuration): a key it names must have the type it states, which is checked once, when
a location is built (:class:`~dcp_volumes.backends.location.StoreLocation`); keys it does not
name pass to fsspec unchanged. The checked options are a :class:`StorageOptions`: a read-only
dict whose ``repr`` names the keys and never a value (values are credentials as often as not).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, NoReturn, TypedDict

from dcp_volumes import errors

__all__ = [
    "AzureOptions",
    "GCSOptions",
    "LocalOptions",
    "S3Options",
    "StorageOptions",
    "check_storage_options",
]


class S3Options(TypedDict, total=False):
    """Known ``storage_options`` of ``s3://`` (s3fs); other keys pass to s3fs unchanged."""

    endpoint_url: str  #: an S3-compatible store (SeaweedFS, MinIO, ...); AWS when absent
    key: str  #: access key id (else the environment, a profile or an instance role)
    secret: str  #: secret access key
    token: str  #: session token of temporary credentials
    anon: bool  #: unsigned requests (public buckets)
    profile: str  #: a named profile of ``~/.aws/config``
    use_ssl: bool
    requester_pays: bool
    version_aware: bool
    client_kwargs: dict[str, Any]  #: botocore client arguments (not ``region_name``: see docs)
    config_kwargs: dict[str, Any]  #: ``botocore.config.Config`` arguments
    s3_additional_kwargs: dict[str, Any]  #: extra arguments of every S3 request


class GCSOptions(TypedDict, total=False):
    """Known ``storage_options`` of ``gs://`` (gcsfs); other keys pass to gcsfs unchanged."""

    endpoint_url: str  #: an emulator or private endpoint
    #: a service-account JSON path, ``"google_default"``, ``"anon"``, a credentials dict/object
    token: Any
    project: str
    requester_pays: bool | str
    access: str  #: ``"read_only"``, ``"read_write"`` or ``"full_control"``
    consistency: str
    session_kwargs: dict[str, Any]


class AzureOptions(TypedDict, total=False):
    """Known ``storage_options`` of ``az://`` / ``abfs://`` (adlfs); others pass unchanged."""

    account_name: str
    account_key: str
    connection_string: str
    sas_token: str
    credential: Any  #: an ``azure.identity`` credential or a key
    tenant_id: str
    client_id: str
    client_secret: str
    anon: bool  #: ``False``: DefaultAzureCredential
    account_host: str


class LocalOptions(TypedDict, total=False):
    """Known ``storage_options`` of local paths (``file://``); others pass unchanged."""

    auto_mkdir: bool


#: backend name (``Backend.name``) → its typed options; a backend not named has no known keys
TYPED: dict[str, type] = {"s3": S3Options, "gcs": GCSOptions, "azure": AzureOptions,
                          "local": LocalOptions}


class StorageOptions(dict[str, Any]):
    """Checked ``storage_options`` of one backend: a read-only dict, values never shown.

    Passing one where ``storage_options=`` is taken skips the check (it was done once)."""

    __slots__ = ("kind",)

    def __init__(self, options: Mapping[str, Any], kind: str) -> None:
        super().__init__(options)
        #: the backend name (``Backend.name``) these options were checked for
        self.kind = kind

    def __repr__(self) -> str:
        return f"StorageOptions({self.kind}: {', '.join(sorted(self)) or 'no options'})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (StorageOptions, (dict(self), self.kind))

    def _refuse(self, *_: Any, **__: Any) -> NoReturn:
        raise TypeError("StorageOptions are read-only: build a new dict and pass that")

    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]


def _matches(value: object, hint: Any) -> bool:
    if hint is Any or value is None:  # None: fsspec's default
        return True
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_matches(value, h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        return isinstance(value, Mapping)
    if origin is bool:
        return isinstance(value, bool)
    return isinstance(value, origin) and not (origin is int and isinstance(value, bool))


def _type_name(hint: Any) -> str:
    if isinstance(hint, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return getattr(typing.get_origin(hint) or hint, "__name__", str(hint))


def check_storage_options(value: object, kind: str) -> StorageOptions:
    """``storage_options=`` checked for the backend named ``kind`` (``Backend.name``).

    Raises:
        ConfigError: not a dict (or None), a key that is not a string, or a known key of the
            wrong type; the message names the key and the type, never the value.
    """
    if isinstance(value, StorageOptions) and value.kind == kind:
        return value
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise errors.ConfigError(
            f"storage_options must be a dict of fsspec options or None, got "
            f"{type(value).__name__}")
    typed = TYPED.get(kind)
    hints = typing.get_type_hints(typed) if typed is not None else {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise errors.ConfigError(
                f"storage_options keys must be strings (fsspec keyword arguments), got a "
                f"{type(key).__name__}")
        hint = hints.get(key)
        if hint is not None and not _matches(item, hint):
            raise errors.ConfigError(
                f"storage_options[{key!r}] of a {kind} location must be a {_type_name(hint)}, "
                f"got a {type(item).__name__} (see docs/backends.md)")
    return StorageOptions(value, kind)
