"""Cooperative loads: a stored byte range that several ranks need is fetched by one of them,
checked against its CRC32C there, and sent to the others over the process group.

It runs inside DCP's own load, through the reader's hooks (no planner of ours):

1. ``prepare_local_plan``: each rank puts a :class:`LocalInfo` (its global rank, host, whether
   its group carries CPU tensors) in its plan's ``storage_data``.
2. ``prepare_global_plan``: the coordinator, holding every rank's plan, calls :func:`assign`.
   The bytes the ranks need are cut into *pieces* (a piece has one set of consumer ranks; a
   large tensor's block-checked data is cut at block boundaries, at most one unit long), the
   pieces into *bundles* (one fetch, one message per consumer), the bundles into *rounds* of
   about ``round_bytes``, and each bundle gets one owner among its consumers, balanced by bytes
   per round (per host first, then per rank). A bundle whose file some rank holds in its
   local tier (``LocalInfo.local_files``) goes to one of those ranks (balanced the same way),
   which reads it from local disk instead of the store and serves it to the others; such a
   rank need not need the bytes itself. DCP scatters one :class:`Assignment` per rank back
   in the plans' ``storage_data``.
3. ``read_data``: :class:`CooperativeRead` runs the rounds. In each, owners fetch and check
   their bundles; every rank then reports a status (one small all-reduce), so a failed fetch
   or checksum raises a typed error on every rank before any byte is exchanged; then owners
   send each bundle to its consumers (point-to-point, CPU tensors), and every rank copies the
   bytes of its items into the planner's targets (a tensor's raw bytes straight into its
   target where they map onto it one to one). The next round is fetched meanwhile; memory
   per rank stays about two rounds.

A rank's local tier may also hold a partner rank's files (``tier`` partner replicas,
kept there after the save): they are local copies like its own, so a rank whose node lost its
tier gets its bytes from the partner that holds them, not from the store.

Peers are other ranks of the same job: bytes received from them are not checked again (their
owner checked them); bytes from the store or from a local tier always are, on the rank that
read them. A local copy that fails its check is fetched from the store by its owner instead
(or, where there is no store copy — a local-only save — fails the load on every rank).

The package: :mod:`.assign` is the coordinator's pure planner (``assign``; :mod:`.coordinate`
runs it in ``prepare_global_plan``; :mod:`.storage_data` the values it reads and returns), :mod:`.rank_part` a rank's part of that plan checked
against its needs (pure), :mod:`.exchange` the runtime on every rank (``CooperativeRead``),
:mod:`.sendrecv` one round's sends and receives; the bytes move through
:func:`dcp_volumes.loading.serve.serve` as in a direct read — from the local tier and the store
for the bundles a rank owns, and from the peer (the bytes received in a round, not checked
again) into the planner's targets — and the status steps and bounded waits are
:mod:`dcp_volumes._dist`'s.
"""

from dcp_volumes.loading.cooperative.assign import assign
from dcp_volumes.loading.cooperative.exchange import CooperativeRead, ExchangeFigures
from dcp_volumes.loading.cooperative.storage_data import Assignment, local_info

__all__ = ["Assignment", "CooperativeRead", "ExchangeFigures", "assign", "local_info"]
