"""lightning_gradcomp.core.validation: one rule and one message per kind of argument."""

from __future__ import annotations

import math

import pytest

from lightning_gradcomp.core.validation import check_bool, check_choice, check_density, check_int, check_number


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


def test_check_int_with_a_maximum_and_a_note_names_both() -> None:
    assert check_int("levels", 127, 1, 127) == 127
    for bad in (0, 128, 2.0):
        with pytest.raises(ValueError, match=rf"^levels must be an integer from 1 to 127 \(QSGD's s\), got {bad!r}$"):
            check_int("levels", bad, 1, 127, note="QSGD's s")


def test_check_bool_with_a_note_says_what_each_value_means() -> None:
    with pytest.raises(ValueError, match=r"^scaled must be True or False \(True: unbiased\), got 1$"):
        check_bool("scaled", 1, note="True: unbiased")


@pytest.mark.parametrize(
    ("bounds", "inside", "outside", "allowed"),
    [
        ({"minimum": 0}, [0, 0.5, 1e300], [-1e-9, math.inf, math.nan], "a finite number >= 0"),
        ({"minimum": 0, "open_min": True}, [1e-12, 3], [0, -1, math.inf], "a finite number > 0"),
        ({"minimum": 0, "maximum": 1, "open_max": True}, [0, 0.999], [1, -0.1, math.nan], r"a number in \[0, 1\)"),
        ({"minimum": 0, "maximum": 1, "open_min": True}, [1, 1e-9], [0, 1.5, math.inf], r"a number in \(0, 1\]"),
    ],
)
def test_check_number_takes_finite_numbers_between_its_ends(
    bounds: dict, inside: list[float], outside: list[float], allowed: str
) -> None:
    for value in inside:
        assert check_number("x", value, **bounds) == float(value)
        assert isinstance(check_number("x", value, **bounds), float)
    for bad in [*outside, 10**400, True, "0.5", None]:
        with pytest.raises(ValueError, match=rf"^x must be {allowed}, got "):
            check_number("x", bad, **bounds)


def test_check_number_names_its_unit() -> None:
    assert check_number("unit_cap_mb", 25, 0, open_min=True, note="MiB") == 25.0
    with pytest.raises(ValueError, match=r"^unit_cap_mb must be a finite number > 0 \(MiB\), got 0$"):
        check_number("unit_cap_mb", 0, 0, open_min=True, note="MiB")
