"""A sweep's grid: cells of config overrides, their names, and the command-line syntax."""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Sequence
from typing import Any

from qkv_jax.training.validate import ConfigError, get_field

__all__ = ["grid", "cell_name", "apply_overrides", "parse_sweep_arg", "parse_shard"]


def grid(sweep: dict[str, Sequence[Any]] | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cells of a sweep: the cartesian product of {field: values}, or an explicit list."""
    if isinstance(sweep, dict):
        fields = list(sweep)
        return [dict(zip(fields, values, strict=True)) for values in itertools.product(*sweep.values())]
    return [dict(cell) for cell in sweep]


def cell_name(cell: dict[str, Any]) -> str:
    """'model.d_k=4,model.num_heads=2' made safe as a file name."""
    text = ",".join(f"{field}={value}" for field, value in cell.items())
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", text) or "base"


def apply_overrides(config: dict, cell: dict[str, Any]) -> dict:
    """A copy of `config` with `cell`'s fields set; unknown fields are a ConfigError."""
    config = copy.deepcopy(config)
    for field, value in cell.items():
        *parents, leaf = field.split(".")
        section = config
        for part in parents:
            if not isinstance(section.get(part), dict):
                raise ConfigError(f"{field}: no such config field")
            section = section[part]
        if leaf not in section:
            raise ConfigError(f"{field}: no such config field")
        section[leaf] = value
    return config


def parse_sweep_arg(text: str, config: dict) -> tuple[str, list[Any]]:
    """'model.d_k=2,4,8' -> ('model.d_k', [2, 4, 8]), typed like the config field."""
    if "=" not in text:
        raise ConfigError(f"--sweep {text!r}: expected field=value1,value2,...")
    field, values = text.split("=", 1)
    current = get_field(config, field)
    kind = type(current)

    def convert(raw: str) -> Any:
        raw = raw.strip()
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false"):
                    raise ValueError
                return raw.lower() == "true"
            if kind is int:
                return int(raw)
            if kind is float:
                return float(raw)
        except ValueError:
            raise ConfigError(f"--sweep {field}={raw!r}: not a {kind.__name__}") from None
        if current is None:  # a placeholder field: guess int, then float, then string
            for parse in (int, float):
                try:
                    return parse(raw)
                except ValueError:
                    pass
        return raw

    parsed = [convert(v) for v in values.split(",") if v.strip()]
    if not parsed:
        raise ConfigError(f"--sweep {text!r}: no values")
    return field, parsed


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'I/N' -> (I, N), with 0 <= I < N; None stays None."""
    if text is None:
        return None
    index, _, count = text.partition("/")
    try:
        shard = int(index), int(count)
    except ValueError:
        raise ConfigError(f"--shard={text!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= shard[0] < shard[1]:
        raise ConfigError(f"--shard={text!r}: needs 0 <= I < N")
    return shard
