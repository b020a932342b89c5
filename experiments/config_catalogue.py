"""The config files and their fields, as the launchers show them: `--list_configs` and `--check`.

A config file (`configs/*.py`) has a docstring whose first line says what it trains, an optional
`VARIANTS` dict (variant -> one line) for its `:variant`s, and a `# comment` above each field it
sets; the fields of the shared sections take theirs from `configs/common.py`, and a `model`
section's unset TransformerConfig fields from TransformerConfig's docstring.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
# `config.model.d_k = ...` or `section.steps = ...`: the field's path after the first name.
_ASSIGNED = re.compile(r"^\s*[A-Za-z_]\w*\.(?P<path>[A-Za-z_][\w.]*)\s*=[^=]")
_OVERRIDE = re.compile(r"^--?(no)?config\.(?P<name>[\w.]+)")


def config_files(directory: pathlib.Path = ROOT / "configs") -> list[pathlib.Path]:
    """The config files in `directory`: its .py files with a get_config()."""
    return sorted(p for p in directory.glob("*.py") if "\ndef get_config(" in p.read_text())


def _load(path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"listed_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def list_configs(directory: pathlib.Path = ROOT / "configs") -> str:
    """Every config file with its docstring's first line, then each variant with its line."""
    lines = []
    for path in config_files(directory):
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines.append(f"{shown}  {doc.strip().splitlines()[0] if doc.strip() else ''}".rstrip())
        variants = getattr(_load(path), "VARIANTS", {})
        width = max((len(name) for name in variants), default=0) + 1
        for i, name in enumerate(variants):
            described = variants[name] if isinstance(variants, dict) else ""
            default = " (the default)" if i == 0 else ""
            lines.append(f"  {':' + name:<{width}}  {described}{default}".rstrip())
    lines.append("Give one as --config FILE[:variant]; --check shows its fields, values and meanings.")
    return "\n".join(lines)


def _comments(source: str) -> dict[str, str]:
    """field path as assigned (`model.d_k`, `steps`) -> the comment lines above it, as one line."""
    found: dict[str, str] = {}
    block: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        if (match := _ASSIGNED.match(line)) is not None and block:
            found.setdefault(match["path"], " ".join(block))
        block = []
    return found


def _transformer_attributes() -> dict[str, str]:
    """TransformerConfig's field -> its entry in the docstring's Attributes (`a, b: text`)."""
    from qkv_jax.lm import TransformerConfig

    doc = (TransformerConfig.__doc__ or "").split("Attributes:", 1)[-1]
    found: dict[str, str] = {}
    for entry in re.split(r"\n      (?=\w[\w, ]*: )", doc):
        names, _, text = entry.strip().partition(": ")
        for name in names.split(", "):
            found.setdefault(name.strip(), " ".join(text.split()))
    return found


def field_comments(config_path: str | pathlib.Path) -> dict[str, str]:
    """field path as assigned -> its comment, from the config file, then the `common.py` beside
    it."""
    path = pathlib.Path(config_path)
    found = _comments(path.read_text())
    if (shared := path.with_name("common.py")).exists():
        found = {**_comments(shared.read_text()), **found}
    return found


def _leaves(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _comment_of(path: str, comments: dict[str, str], attributes: dict[str, str]) -> str:
    """The comment of the longest tail of `path` (`train.steps`, then `steps`) that has one; for
    an uncommented `model.<field>`, TransformerConfig's words."""
    parts = path.split(".")
    tails = (".".join(parts[i:]) for i in range(len(parts)))
    found = next((comments[tail] for tail in tails if tail in comments), "")
    if not found and parts[0] == "model" and parts[-1] in attributes:
        return f"TransformerConfig: {attributes[parts[-1]]}"
    return found


def describe_config(config: Any, argument: str, argv: Sequence[str]) -> str:
    """Every leaf of the resolved `config` (a ConfigDict) with its value and comment, the ones
    `argv` overrides (`--config.<field>=...`, a section's too) marked with *."""
    comments, attributes = field_comments(argument.split(":", 1)[0]), _transformer_attributes()
    overridden = [m["name"] for arg in argv if (m := _OVERRIDE.match(arg)) is not None]
    leaves = list(_leaves(config.to_dict()))
    width = max(len(path) for path, _ in leaves)
    shown = {path: "unset" if value is None else repr(value) for path, value in leaves}
    value_width = min(24, max(len(text) for text in shown.values()))
    lines = [f"{argument}: {len(leaves)} fields (* = set on the command line)"]
    for path, _ in leaves:
        mark = "*" if any(path == name or path.startswith(name + ".") for name in overridden) else " "
        comment = _comment_of(path, comments, attributes)
        line = f"{mark} {path:<{width}} {shown[path]:<{value_width}}" + (f"  # {comment}" if comment else "")
        lines.append(line.rstrip())
    return "\n".join(lines)
