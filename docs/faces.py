"""The option fields of the two `MultiHeadAttention` faces, written from `AttentionOptions`.

`python -m docs.generate faces` rewrites, between `# generated:options` and
`# end generated:options`, the linen face's fields (qkv_jax/modules.py) and the nnx face's
option keywords (`OptionKeywords` in qkv_jax/nnx/attention.py, its constructor's
`**options`): every `AttentionOptions` field that the face does not declare by hand (flax's own
fields and keywords, in flax's order), with the type it is declared with (and the default, for
linen's fields). A new attention option is
declared once, in `AttentionOptions`; the faces get it from here, and
tests/modules/test_faces_attention.py fails while they lack it. The faces keep explicit
fields and typed keywords (not ones made at import time) so that type checkers and editors see
them.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINEN = ROOT / "qkv_jax" / "modules.py"
NNX = ROOT / "qkv_jax" / "nnx" / "attention.py"
BLOCK = re.compile(
    r"(?P<indent>[ ]*)# generated:options\b[^\n]*\n(?P<body>.*?)[ ]*# end generated:options", re.DOTALL
)
NAME = re.compile(r"^\s*(\w+):", re.MULTILINE)


def _generated_names(path: pathlib.Path) -> set[str]:
    """The names the generated block of `path` declares now."""
    match = BLOCK.search(path.read_text())
    if match is None:
        raise SystemExit(f"{path}: no '# generated:options' markers")
    return set(NAME.findall(match["body"]))


def _default(value: object) -> str:
    """A default as source text (the options' defaults are literals)."""
    return repr(value).replace("'", '"')


def own_options() -> list[dataclasses.Field]:
    """The `AttentionOptions` fields that flax's linen module has no field for, in declaration
    order: those the linen face does not declare by hand."""
    from qkv_jax.modules import AttentionOptions, MultiHeadAttention

    by_hand = set(MultiHeadAttention.__dataclass_fields__) - _generated_names(LINEN)
    return [field for field in dataclasses.fields(AttentionOptions) if field.name not in by_hand]


def blocks() -> dict[pathlib.Path, str]:
    """What each face's generated block should hold."""
    from qkv_jax.modules import AttentionOptions
    from qkv_jax.nnx.attention import MultiHeadAttention as NNXAttention

    linen = "".join(f"{field.name}: {field.type} = {_default(field.default)}\n" for field in own_options())
    nnx_by_hand = set(inspect.signature(NNXAttention.__init__).parameters) - {"self", "options"}
    nnx = "".join(
        f"{field.name}: {field.type}\n"
        for field in dataclasses.fields(AttentionOptions)
        if field.name not in nnx_by_hand
    )
    return {LINEN: linen, NNX: nnx}


def rendered(path: pathlib.Path, body: str) -> str:
    """The text of `path` with its generated block holding `body` (one declaration a line)."""
    text = path.read_text()

    def fill(match: re.Match) -> str:
        indent = match["indent"]
        header = match[0].splitlines()[0]
        lines = "".join(f"{indent}{line}\n" for line in body.splitlines())
        return f"{header}\n{lines}{indent}# end generated:options"

    return BLOCK.sub(fill, text, count=1)


def stale() -> list[pathlib.Path]:
    """The faces whose generated block is not what `generate` writes."""
    return [path for path, body in blocks().items() if rendered(path, body) != path.read_text()]


def generate() -> None:
    for path, body in blocks().items():
        path.write_text(rendered(path, body))
