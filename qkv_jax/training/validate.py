"""Config validation: every check names the field and the value it got.

`validate_shared_sections` checks what every config shares (seed, train.*,
eval.num_examples); `build_setup` runs it before the task's own `build`,
which checks the task's sections with the `require_*` helpers here.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "CPU_OPTIMIZATION_LEVELS",
    "OPTIMIZERS",
    "SCHEDULES",
    "validate_shared_sections",
    "ConfigError",
    "get_field",
    "require_positive_int",
    "require_nonnegative_int",
    "require_positive_float",
    "require_nonnegative_float",
    "require_fraction",
    "require_choice",
    "require_bool",
    "require_divides",
    "require_at_most",
    "INT32_MAX",
]

# Step counters and seeds are int32 inside the compiled programs.
INT32_MAX = 2**31 - 1


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_nonnegative_float(config: Any, *fields: str) -> None:
    for field in fields:
        value = get_field(config, field)
        if not _is_number(value) or not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{field}={value!r}: must be a finite number >= 0")


def require_positive_float(config: Any, *fields: str) -> None:
    for field in fields:
        value = get_field(config, field)
        if not _is_number(value) or not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{field}={value!r}: must be a positive finite number")


def require_fraction(config: Any, *fields: str) -> None:
    """A rate in [0, 1)."""
    for field in fields:
        value = get_field(config, field)
        if not _is_number(value) or not 0 <= value < 1:
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


def require_at_most(config: Any, limit: int, why: str, *fields: str) -> None:
    """Each of `fields` (already checked to be numbers) is at most `limit`; `why` says why."""
    for field in fields:
        value = get_field(config, field)
        if value > limit:
            raise ConfigError(f"{field}={value!r}: must be at most {limit} ({why})")


def _is_directory(path: str) -> bool:
    """Whether `path` names a directory; False for a name the filesystem refuses (too long, say)."""
    try:
        return pathlib.Path(path).is_dir()
    except (OSError, ValueError):
        return False


OPTIMIZERS = ("adam", "adamw", "sgd")
# train.cpu_optimization_level's values (qkv_jax.training.compiled.CPU_COMPILER_OPTIONS).
CPU_OPTIMIZATION_LEVELS = (0, 1, 2)
SCHEDULES = ("constant", "cosine")


def validate_shared_sections(config: Any) -> None:
    """Checks the fields every experiment shares: seed, train.* and eval.num_examples."""
    require_nonnegative_int(config, "seed")
    require_positive_int(
        config, "train.steps", "train.batch_size", "train.log_every", "train.checkpoint_every"
    )
    require_positive_float(config, "train.learning_rate")
    require_choice(config, "train.optimizer", OPTIMIZERS)
    require_choice(config, "train.schedule", SCHEDULES)
    require_bool(config, "train.overwrite", "train.checkify", "train.convert_kv_heads")
    require_nonnegative_int(config, "train.warmup_steps", "train.keep_checkpoints")
    level = get_field(config, "train.cpu_optimization_level")
    if not _is_int(level) or level not in CPU_OPTIMIZATION_LEVELS:
        raise ConfigError(f"train.cpu_optimization_level={level!r}: must be 0, 1 or 2")
    require_at_most(config, INT32_MAX, "the seed is an int32 inside the compiled program", "seed")
    require_at_most(
        config,
        INT32_MAX,
        "steps are counted in int32",
        "train.steps",
        "train.log_every",
        "train.checkpoint_every",
        "train.warmup_steps",
    )
    require_positive_int(config, "eval.num_examples")
    why = "JAX indexes with 32-bit integers by default"
    require_at_most(config, INT32_MAX, why, "train.batch_size", "eval.num_examples")
    require_nonnegative_float(config, "train.weight_decay")
    if get_field(config, "train.grad_clip_norm") is not None:
        require_positive_float(config, "train.grad_clip_norm")
    source = get_field(config, "train.init_from")
    if source is not None and (not isinstance(source, str) or not _is_directory(source)):
        raise ConfigError(f"train.init_from={source!r}: not a directory (a run's workdir or checkpoint)")
    if config["train"]["convert_kv_heads"] and source is None:
        raise ConfigError("train.convert_kv_heads=True: needs train.init_from (the run to convert)")
