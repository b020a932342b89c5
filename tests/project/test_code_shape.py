"""The library stays readable: short functions (docs/architecture.md; the chunked kernel excepted)."""

import ast
import pathlib

LIBRARY = pathlib.Path(__file__).resolve().parents[2] / "qkv_jax"
MAX_LINES = 60
# The blocked attention kernel's forward and backward stay whole: each is one tiled loop nest.
EXEMPT = {("chunked.py", "_forward"), ("chunked.py", "_attention_bwd")}


def function_lengths():
    """(file, function, lines of its body without the docstring) for every function in qkv_jax/.
    The signature is not counted: the NNX MultiHeadAttention's constructor takes flax.nnx's
    keywords one per line (a 4-line body under a 60-line signature)."""
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.body[0].lineno + 1
                docstring = ast.get_docstring(node, clean=False)
                if docstring is not None:
                    first = node.body[0]
                    lines -= first.end_lineno - first.lineno + 1
                yield str(path.relative_to(LIBRARY)), node.name, lines


def test_no_function_is_longer_than_sixty_lines():
    lengths = list(function_lengths())
    assert len(lengths) > 100  # the walk found the library
    too_long = [
        (file, name, lines)
        for file, name, lines in lengths
        if lines > MAX_LINES and (pathlib.Path(file).name, name) not in EXEMPT
    ]
    assert not too_long, too_long
    (run_length,) = [
        lines for file, name, lines in lengths if (file, name) == ("training/run.py", "train_and_evaluate")
    ]
    assert run_length < 40
