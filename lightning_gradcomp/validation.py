"""The argument checks every public entry point shares: one rule, one message, in one place.

Each returns the value it accepted (normalised where said) or raises a ``ValueError`` naming the
argument, the value it got and what is allowed, so that bad input fails where it enters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (not a truthy number or string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: T, allowed: Iterable[T]) -> T:
    """``value`` if it is one of ``allowed`` (a string outside them, or no string, is refused by name)."""
    choices = list(allowed)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_density(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number in (0, 1]: a fraction of entries to keep."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_positive_number(name: str, value: Any, unit: str = "") -> float:
    """``value`` as a float if it is a finite number > 0 (``unit`` names what it counts, for the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number{f' of {unit}' if unit else ''}, got {value!r}")
    return float(value)
