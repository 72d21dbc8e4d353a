"""The argument checks every public entry point shares: one rule, one message, in one place.

Each returns the value it accepted (normalised where said) or raises a ``ValueError`` naming the
argument, the value it got and what is allowed, so that bad input fails where it enters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def _noted(note: str) -> str:
    return f" ({note})" if note else ""


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None, note: str = "") -> int:
    """``value`` if it is an integer (not a bool) from ``minimum`` to ``maximum`` (no upper bound when None);
    ``note`` says what the number means, for the message."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        allowed = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"{name} must be an integer {allowed}{_noted(note)}, got {value!r}")
    return value


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_number(
    name: str,
    value: Any,
    minimum: float,
    maximum: float | None = None,
    *,
    open_min: bool = False,
    open_max: bool = False,
    note: str = "",
) -> float:
    """``value`` as a float if it is a finite number (not a bool) between ``minimum`` and ``maximum`` (no upper
    bound when None; an end is excluded where ``open_min`` / ``open_max`` say); NaN and infinities never are."""
    fits = not isinstance(value, bool) and isinstance(value, (int, float)) and _finite(value)
    if fits:
        above = value > minimum if open_min else value >= minimum
        below = maximum is None or (value < maximum if open_max else value <= maximum)
        fits = above and below
    if not fits:
        if maximum is None:
            allowed = f"a finite number {'>' if open_min else '>='} {minimum}"
        else:
            allowed = f"a number in {'(' if open_min else '['}{minimum}, {maximum}{')' if open_max else ']'}"
        raise ValueError(f"{name} must be {allowed}{_noted(note)}, got {value!r}")
    return float(value)


def check_density(name: str, value: Any) -> float:
    """``value`` as a float if it is a number in (0, 1]: a fraction of entries to keep."""
    return check_number(name, value, 0, 1, open_min=True)


def check_bool(name: str, value: Any, note: str = "") -> bool:
    """``value`` if it is ``True`` or ``False`` (not a truthy number or string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False{_noted(note)}, got {value!r}")
    return value


def check_choice(name: str, value: T, allowed: Iterable[T]) -> T:
    """``value`` if it is one of ``allowed`` (a string outside them, or no string, is refused by name)."""
    choices = list(allowed)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value
