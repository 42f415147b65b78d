"""The load path: what a rank needs, the sources that serve it, the one serve path.

- :mod:`.needs`: byte spans per stored item (``Need``), coalesced into ranges, and the one
  check of their bytes against the manifest (``check_need``).
- :mod:`.sources`: the *sources* that serve byte ranges — the store, this node's local tier
  — each answering a range with its bytes or a typed ``CannotServe`` (missing, changed,
  damaged, unreadable); a safetensors directory is the store read pinned to the versions
  its headers were read from.
- :mod:`.serve`: the one serve path: ask a source, check every span in one place, apply it
  to its target in one place; what a source cannot serve goes to the next.
- :mod:`.apply`: checked bytes into the planner's tensors (``PlannerTarget``).
- :mod:`.direct`: a rank's own reads, nearest first: its local tier, then the store.
- :mod:`.cooperative`: the bytes several ranks need, read once and sent over the process
  group (the peer as a source).

``VolumeReader`` (the DCP lifecycle) plans once and drives these; export and ``verify`` use
the store source and the serve path too.
"""
