"""Named presets, alike in every front end: a table ``name -> (description, arguments)`` per front end, the merge rules
of ``from_preset(name, **overrides)``, and the check that names a misspelt override.

Every front end (the DDP strategies, DiLoCo's, HSDP's, for the Trainer and for Fabric) registers its table's names
with Lightning and builds ``from_preset`` from it with :class:`FromPreset`, so a preset is changed the same way
everywhere: ``GradCompDiLoCoStrategy.from_preset("ddp_diloco_topk", sync_every=4)``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, TypeVar

from lightning_gradcomp.core.validation import check_choice

__all__ = ["NESTED", "FromPreset", "PresetTable", "preset_arguments", "refuse_unknown"]

#: ``name -> (description, arguments)``: a front end's named strategies.
PresetTable = Mapping[str, tuple[str, Mapping[str, Any]]]

#: The dict-valued arguments, each with the argument whose method it configures: an override of the dict updates the
#: preset's key by key, unless that method is replaced too.
NESTED = {"compressor_kwargs": "compressor", "memory_kwargs": "memory", "adaptive_kwargs": "adaptive"}


def preset_arguments(table: PresetTable, name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of ``table``'s preset ``name`` with ``overrides`` applied.

    Every argument given replaces the preset's, except a ``*_kwargs`` dict, which updates the preset's key by key while
    its method (``compressor``, ``memory``, ``adaptive``) stays the preset's: ``ddp_powersgd`` with
    ``compressor_kwargs={"min_compression_rate": 4.0}`` keeps its rank 4. A method replaced drops the preset's
    arguments for it (restated with the preset's own value, it keeps them).
    """
    check_choice("preset", name, sorted(table))
    arguments = dict(table[name][1])
    # another method does not take the preset's method's arguments
    replaced = {
        nested
        for nested, method in NESTED.items()
        if overrides.get(method, arguments.get(method)) != arguments.get(method)
    }
    for nested in replaced:
        arguments.pop(nested, None)
    for key, value in overrides.items():
        kept = arguments.get(key)
        merge = isinstance(kept, dict) and isinstance(value, Mapping)
        arguments[key] = {**kept, **value} if merge else value  # type: ignore[dict-item]
    return arguments


def refuse_unknown(what: str, given: Collection[str], accepted: Collection[str]) -> None:
    """``ValueError`` naming each of ``given`` not among ``accepted`` (with the closest accepted name): ``what`` got
    them, e.g. ``"GradCompDiLoCoStrategy.from_preset('ddp_diloco_topk')"``."""
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        close = {key: difflib.get_close_matches(key, sorted(accepted), n=1) for key in unknown}
        hints = "; ".join(f"{key!r}: did you mean {match[0]!r}?" for key, match in close.items() if match)
        takes = f"; it takes {sorted(accepted)}" if len(accepted) <= 25 else ""
        raise ValueError(f"{what} got unknown arguments {unknown}{f' ({hints})' if hints else ''}{takes}")


_Strategy = TypeVar("_Strategy", bound="FromPreset")


class FromPreset:
    """``from_preset(name, **overrides)`` over the class's :attr:`presets` table (:func:`preset_arguments`'s rules)."""

    #: the front end's named strategies
    presets: ClassVar[PresetTable]

    @classmethod
    def preset_keywords(cls) -> set[str]:
        """The arguments ``from_preset`` may change: the named parameters of the class's ``__init__`` (a front end that
        passes more on through ``**kwargs`` adds them)."""
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {p.name for p in inspect.signature(cls).parameters.values() if p.kind in kinds}

    @classmethod
    def from_preset(cls: type[_Strategy], name: str, **overrides: Any) -> _Strategy:
        """The named strategy ``name`` of this front end with any argument changed; a ``*_kwargs`` dict updates the
        preset's key by key (:func:`preset_arguments`), and an argument the strategy does not take is a ``ValueError``
        naming it."""
        refuse_unknown(f"{cls.__name__}.from_preset({name!r})", overrides, cls.preset_keywords())
        return cls(**preset_arguments(cls.presets, name, overrides))
