"""The library stays readable: short functions (docs/architecture.md)."""

import ast
import pathlib

LIBRARY = pathlib.Path(__file__).resolve().parents[2] / "qkv_jax"
MAX_LINES = 60


def function_lengths():
    """(file, function, lines from its `def` to its end, the docstring left out) for every
    function in qkv_jax/: a signature counts, since it is read as the body is."""
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                docstring = ast.get_docstring(node, clean=False)
                if docstring is not None:
                    first = node.body[0]
                    lines -= first.end_lineno - first.lineno + 1
                yield str(path.relative_to(LIBRARY)), node.name, lines


def test_no_function_is_longer_than_sixty_lines():
    lengths = list(function_lengths())
    assert len(lengths) > 100  # the walk found the library
    too_long = [(file, name, lines) for file, name, lines in lengths if lines > MAX_LINES]
    assert not too_long, too_long
    (run_length,) = [
        lines for file, name, lines in lengths if (file, name) == ("training/run.py", "train_and_evaluate")
    ]
    assert run_length < 40
