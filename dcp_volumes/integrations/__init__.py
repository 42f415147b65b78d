"""Adapters that route a training framework's checkpoints through dcp_volumes.

One module per framework (``dcp_volumes.integrations.torchtitan``, ``.lightning``,
``.huggingface``, ``.torch_checkpointing``). Each imports its framework only when it is
imported itself, so ``import dcp_volumes`` never needs any of them, and each is a thin layer
over :class:`~dcp_volumes.VolumeWriter` / :class:`~dcp_volumes.VolumeReader`, the
:class:`~dcp_volumes.Checkpointer` and :mod:`dcp_volumes.catalog`: saving, listing the newest
complete step and retention are never implemented twice. See ``docs/integrations/``.
"""
