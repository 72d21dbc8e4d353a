"""lightning_gradcomp.validation: one rule and one message per kind of argument."""

from __future__ import annotations

import math

import pytest

from lightning_gradcomp.validation import check_bool, check_choice, check_density, check_int, check_positive_number


def test_check_int_accepts_integers_from_the_minimum_and_refuses_bools_floats_and_smaller() -> None:
    assert check_int("steps", 0, 0) == 0
    assert check_int("steps", 7, 1) == 7
    for bad in (True, 1.0, "1", -1, None):
        with pytest.raises(ValueError, match=rf"^steps must be an integer >= 0, got {bad!r}$"):
            check_int("steps", bad, 0)


def test_check_bool_refuses_truthy_values_that_are_not_bools() -> None:
    assert check_bool("flag", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match=rf"^flag must be True or False, got {bad!r}$"):
            check_bool("flag", bad)


def test_check_choice_names_the_allowed_values() -> None:
    assert check_choice("memory", "ef", ["none", "ef"]) == "ef"
    for bad in ("EF", None, 1):
        with pytest.raises(ValueError, match=r"^memory must be one of \['none', 'ef'\], got "):
            check_choice("memory", bad, ("none", "ef"))


def test_check_density_takes_finite_numbers_in_0_1_as_floats() -> None:
    assert check_density("density", 1) == 1.0 and isinstance(check_density("density", 1), float)
    assert check_density("density", 1e-9) == 1e-9
    for bad in (0, 0.0, -0.1, 1.0000001, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match=r"^density must be a number in \(0, 1\], got "):
            check_density("density", bad)


def test_check_positive_number_names_its_unit() -> None:
    assert check_positive_number("unit_cap_mb", 25, "MiB") == 25.0
    for bad in (0, -1.0, math.nan, math.inf, False):
        with pytest.raises(ValueError, match=r"^unit_cap_mb must be a positive number of MiB, got "):
            check_positive_number("unit_cap_mb", bad, "MiB")
