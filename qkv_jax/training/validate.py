"""Config validation: every check names the field and the value it got."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = [
    "ConfigError",
    "get_field",
    "require_positive_int",
    "require_nonnegative_int",
    "require_positive_float",
    "require_fraction",
    "require_choice",
    "require_bool",
    "require_divides",
]


class ConfigError(ValueError):
    """A config field holds a bad value; the message names the field and the value."""


def get_field(config: Any, field: str) -> Any:
    """`config.a.b` for field 'a.b'; a missing field is a ConfigError."""
    value = config
    for part in field.split("."):
        try:
            value = value[part]
        except (KeyError, AttributeError, TypeError):
            raise ConfigError(f"{field}: missing from the config") from None
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_positive_int(config: Any, *fields: str) -> None:
    for field in fields:
        value = get_field(config, field)
        if not _is_int(value) or value <= 0:
            raise ConfigError(f"{field}={value!r}: must be a positive integer")


def require_nonnegative_int(config: Any, *fields: str) -> None:
    for field in fields:
        value = get_field(config, field)
        if not _is_int(value) or value < 0:
            raise ConfigError(f"{field}={value!r}: must be a non-negative integer")


def require_positive_float(config: Any, *fields: str) -> None:
    for field in fields:
        value = get_field(config, field)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)
        ):
            raise ConfigError(f"{field}={value!r}: must be a positive finite number")


def require_fraction(config: Any, *fields: str) -> None:
    """A rate in [0, 1)."""
    for field in fields:
        value = get_field(config, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"{field}={value!r}: must be in [0, 1)")


def require_choice(config: Any, field: str, choices: Iterable[str]) -> None:
    value = get_field(config, field)
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{field}={value!r}: unknown; choose one of {', '.join(choices)}")


def require_bool(config: Any, *fields: str) -> None:
    for field in fields:
        value = get_field(config, field)
        if not isinstance(value, bool):
            raise ConfigError(f"{field}={value!r}: must be True or False")


def require_divides(config: Any, divisor_field: str, dividend_field: str) -> None:
    divisor, dividend = get_field(config, divisor_field), get_field(config, dividend_field)
    if dividend % divisor:
        raise ConfigError(f"{divisor_field}={divisor} does not divide {dividend_field}={dividend}")
