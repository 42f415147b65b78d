"""What stands at a name under the root, asked of the store rather than of its class: the
kind of an entry, the removal of one that is not a regular object, where the root is, and
the fail-fast check of the bucket and the root. Mixed into
:class:`~dcp_volumes.backends.base.Backend`; a store whose namespace differs (a local
filesystem: links, FIFOs, real directories) overrides these, so no caller asks which store
it talks to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from dcp_volumes import errors
from dcp_volumes.backends.records import CallStats, ObjectInfo
from dcp_volumes.backends.translate import redact_url

__all__ = ["Entries"]

T = TypeVar("T")


class Entries:
    """Entries under the root, mixed into :class:`~dcp_volumes.backends.base.Backend`."""

    #: the root is a path on this machine's filesystem: entries may be links, FIFOs or
    #: directories; a file being written is visible under its name (write a temporary name,
    #: then rename); the path's parents and links are the caller's to check
    local_paths: ClassVar[bool] = False

    if TYPE_CHECKING:  # what it uses of the Backend it is mixed into
        fs: Any
        url: str
        root: str
        object_store: ClassVar[bool]

        async def call(self, fn: Callable[[], Awaitable[T]], *, op: str, url: str,
                       stats: CallStats | None = None,
                       retry_if: Callable[[BaseException], bool] = ...) -> T: ...
        async def fs_call(self, name: str, *args: Any, **kwargs: Any) -> Any: ...
        async def info(self, relative: str, *, stats: CallStats | None = None
                       ) -> dict[str, Any] | None: ...
        async def scan(self) -> list[ObjectInfo]: ...
        async def remove(self, relatives: list[str]) -> None: ...
        @property
        def bucket(self) -> str: ...

    async def entry_kind(self, relative: str, *, stats: CallStats | None = None
                         ) -> str | None:
        """What stands at ``relative``: None (nothing), ``"file"`` (a regular object), or in
        words what else (on an object store: "a prefix with keys under it"). The same
        request a size takes (``info``)."""
        info = await self.info(relative, stats=stats)
        if info is None:
            return None
        return "file" if info.get("type", "file") == "file" else "a prefix with keys under it"

    async def remove_entry(self, relative: str) -> None:
        """Remove what stands at ``relative`` unless it is a regular object (gone: fine): on
        an object store the keys under ``relative/``, then the empty directory a store with
        real ones keeps (SeaweedFS's filer refuses to create ``relative`` beside it), by its
        ``relative/`` key."""
        prefix = f"{relative}/"
        await self.remove([o.name for o in await self.scan() if o.name.startswith(prefix)])
        if await self.entry_kind(relative) not in (None, "file"):
            await self.remove([prefix])

    def place(self) -> tuple[str, str, str]:
        """(store kind, endpoint, root path): two backends with the same kind and endpoint
        are the same store, and one root inside the other is a prefix of it."""
        fs = self.fs
        endpoint = getattr(fs, "endpoint_url", None) or (
            getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
        return type(self).__name__, str(endpoint or ""), str(self.root).rstrip("/")

    async def check_bucket(self) -> None:
        """Fail fast (before any byte moves) on a missing bucket, refused credentials, or a
        checkpoint path that is an existing file/object."""
        if self.object_store:
            await self._check_bucket_exists()
        try:
            info = await self.call(lambda: self.fs_call("info", self.root), op="list",
                                   url=self.url)
        except errors.ObjectNotFoundError:
            return
        if info.get("type") == "file":
            raise errors.ConfigError(
                f"{redact_url(self.url)} is a file/object, not a directory: choose a "
                "directory-like path"
            )

    async def _check_bucket_exists(self) -> None:
        bucket = self.bucket
        try:
            await self.call(lambda: self.fs_call("ls", self.root, detail=False), op="list",
                            url=self.url)
        except errors.ObjectNotFoundError:
            # An empty prefix is fine; the bucket itself must exist.
            self.fs.invalidate_cache(bucket)
            if not await self.call(lambda: self.fs_call("exists", bucket), op="list",
                                   url=self.url):
                raise errors.BucketNotFoundError(
                    f"bucket/container {bucket!r} of {redact_url(self.url)} does not exist: "
                    "create it or fix the URL"
                ) from None
