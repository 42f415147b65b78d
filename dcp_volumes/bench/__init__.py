"""``dcp-volumes bench``: dcp_volumes next to what you would otherwise use, on one store.

Every contender saves (and then loads) the same state dict on the same server, under the
same network profiles, interleaved (A B C A B C ...) for ``--reps`` repetitions; the report
gives medians with min–max. Each measurement runs in a fresh worker process
(:mod:`dcp_volumes.bench.worker`) so peak RSS and warm connections are its own.

Contenders:

* ``vol-{disk,memory}``: :class:`~dcp_volumes.VolumeWriter` / ``VolumeReader`` with that
  spool mode and the default (adaptive) concurrency; ``vol-{disk,memory}-cN``: fixed at
  ``max_concurrency=N`` (``adaptive_concurrency=False``).
* ``fsspec-tN``: torch's ``FsspecWriter(sync_files=False, thread_count=N)`` / ``FsspecReader``.
* ``s3tc-t8``: s3torchconnector's ``S3StorageWriter(thread_count=8)`` / ``S3StorageReader``.
* ``local-fs``: torch's ``FileSystemWriter`` / ``FileSystemReader`` on a local directory (the
  local-disk reference; loads come from the page cache).
* ``raw-obstore``, ``raw-s3fs``, ``raw-boto3``: the same bytes uploaded and downloaded as
  plain objects, ``--raw-concurrency`` requests in flight (or N with a ``-cN`` suffix, e.g.
  ``raw-obstore-c4``); the fastest of all raw contenders is the *raw ceiling*.
* copy floors for ``dcp.async_save`` (copy into preallocated buffers; a fresh clone), measured
  in the async job next to VolumeWriter's own staging.

Network profiles: ``direct`` (straight to the server) and ``s3-like`` (through a
:class:`~dcp_volumes.testing.faultproxy.FaultProxy` in its own process adding
``--first-byte-delay`` per response and capping each connection at ``--bandwidth`` bytes/s
each way; defaults 30 ms and 10 MB/s).

Use it as ``python -m dcp_volumes.bench`` or, registered by the CLI, ``dcp-volumes bench``
(:func:`add_arguments` + :func:`run`).

Modules: ``harness`` (arguments, plan, run) with ``target`` (server, endpoint, proxies),
``runner`` (one worker process) and ``facts`` (command, versions, machine); ``worker`` (the
measurement process) with ``jobs``, ``raw``, ``contenders``, ``state`` and ``measure``;
``proxy`` (the s3-like proxy process); ``aggregate``, ``report`` and ``plots`` (results);
``costs`` (a checkpoint cost for ``dcp-volumes plan --from-bench``). The library never
imports this package; only the CLI does.
"""

from __future__ import annotations

from dcp_volumes.bench.harness import add_arguments, run

__all__ = ["add_arguments", "run"]
