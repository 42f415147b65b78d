"""Tied weights: which exported tensors are left out as duplicates of another, the way
``save_pretrained`` leaves them out (pure, torch-free: the bytes are compared by the source).

``save_pretrained`` drops, of the tensors that share storage, the names the model declares
as tied (``_tied_weights_keys``, ``{"lm_head.weight": "model.embed_tokens.weight"}``: the
key is dropped, the value kept), because safetensors cannot hold aliases. A DCP checkpoint
does not record sharing: each name is its own stored item. So here a tensor is left out
only when a tie is declared *and* its bytes prove it:

- declared: ``tied={name: kept}`` (output names, after ``prefix`` and ``rename``; the
  direction of ``_tied_weights_keys``), or ``tied="auto"`` (the default): ``lm_head.weight``
  (or ``*.lm_head.weight``), the output projection transformers' language models tie to
  their input embedding, with the one other exported tensor of its dtype and shape whose
  bytes equal its own (at most :data:`MAX_AUTO_OPTIONS` are compared);
- proven: both are exported, have the same stored dtype and shape, and are equal byte for
  byte as read from SRC (verified as on load).

A declared tie that is not proven is a ``ConfigError`` (nothing is written); an ``"auto"``
candidate that is not proven (an untied model) keeps both. ``tied="keep"`` writes every
tensor. Equal bytes without a declaration (two layer norms still at their initial ones)
never drop anything: they are not tied, and a loader would not re-tie them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dcp_volumes import errors
from dcp_volumes.export._plan import PlannedTensor

__all__ = ["AUTO", "KEEP", "MAX_AUTO_OPTIONS", "Candidate", "candidates", "checked_tied",
           "resolve"]

logger = logging.getLogger(__name__)

AUTO = "auto"
KEEP = "keep"
#: the most tensors ``"auto"`` compares with one ``lm_head.weight`` (each comparison stops
#: at the first slab that differs)
MAX_AUTO_OPTIONS = 8
_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Candidate:
    """A tensor that may be left out: the tensors it may equal (in order), and whether the
    tie was declared by the caller (then it must be proven) or guessed by ``"auto"``."""

    tensor: PlannedTensor
    options: tuple[PlannedTensor, ...]
    declared: bool


def checked_tied(tied: Any) -> str | dict[str, str]:
    """``tied`` as ``"auto"``, ``"keep"`` or a ``{name: kept}`` dict.

    Raises:
        ConfigError: anything else.
    """
    if tied in (AUTO, KEEP):
        return str(tied)
    if isinstance(tied, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                         for k, v in tied.items()):
        return dict(tied)
    raise errors.ConfigError(
        "tied= must be 'auto' (leave out lm_head.weight when it equals the embedding), "
        "'keep' (write every tensor) or a dict {name: kept name} of exported names, "
        f"got {type(tied).__name__}")


def _declared(tensors: dict[str, PlannedTensor], tied: dict[str, str]) -> list[Candidate]:
    out = []
    for name, kept in sorted(tied.items()):
        for n in (name, kept):
            if n not in tensors:
                raise errors.ConfigError(
                    f"tied= names {n!r}, which is not an exported tensor (names are those "
                    "after prefix and rename): fix the name, or drop the tie")
        a, b = tensors[name], tensors[kept]
        if name == kept or kept in tied:
            raise errors.ConfigError(
                f"tied= ties {name!r} to {kept!r}, which is {'itself' if name == kept else 'left out too'}"
                ": tie each left-out name to a tensor that is kept")
        if (a.source_dtype, a.shape) != (b.source_dtype, b.shape):
            raise errors.ConfigError(
                f"tied= ties {name!r} ({a.source_dtype} {list(a.shape)}) to {kept!r} "
                f"({b.source_dtype} {list(b.shape)}): tied tensors have one dtype and shape; "
                "drop the tie, or pass tied='keep'")
        out.append(Candidate(a, (b,), declared=True))
    return out


def _auto(tensors: dict[str, PlannedTensor]) -> list[Candidate]:
    out = []
    for t in tensors.values():
        if t.name != _HEAD and not t.name.endswith("." + _HEAD):
            continue
        options = tuple(o for o in tensors.values()
                        if o.name != t.name and not o.name.endswith(_HEAD)
                        and (o.source_dtype, o.shape) == (t.source_dtype, t.shape))
        if len(options) > MAX_AUTO_OPTIONS:
            logger.info("not comparing %s with %d tensors of its shape (the most is %d): "
                        "kept; pass tied={name: kept} to name its tie", t.name, len(options),
                        MAX_AUTO_OPTIONS)
            continue
        if options:
            out.append(Candidate(t, options, declared=False))
    return out


def candidates(tensors: Sequence[PlannedTensor], tied: str | dict[str, str]
               ) -> list[Candidate]:
    """The tensors that may be left out, per ``tied`` (:func:`checked_tied`'s form).

    Raises:
        ConfigError: a declared tie names a tensor that is not exported, ties a name to
            itself or to a left-out name, or ties tensors of different dtypes or shapes.
    """
    by_name = {t.name: t for t in tensors}
    if tied == KEEP:
        return []
    if tied == AUTO:
        return _auto(by_name)
    assert isinstance(tied, dict)
    return _declared(by_name, tied)


def resolve(found: Sequence[Candidate], equal: Callable[[PlannedTensor, PlannedTensor], bool]
            ) -> dict[str, str]:
    """``{name: kept name}`` of the candidates whose bytes ``equal`` proves tied.

    Raises:
        ConfigError: a declared tie whose tensors differ.
    """
    out = {}
    for c in found:
        same = [o for o in c.options if equal(c.tensor, o)]
        if c.declared and not same:
            raise errors.ConfigError(
                f"tied= ties {c.tensor.name!r} to {c.options[0].name!r}, but their stored "
                "bytes differ: they are not tied in this checkpoint; drop the tie, or pass "
                "tied='keep'")
        if len(same) == 1:
            out[c.tensor.name] = same[0].name
        elif same:
            logger.info("%s equals %d tensors (%s): kept, as its tie is ambiguous",
                        c.tensor.name, len(same), ", ".join(o.name for o in same))
    return out
