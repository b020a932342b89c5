"""The public API: every exported name exists and is documented, the package is typed,
and `import qkv_jax` stays light (no plotting, checkpointing or training code)."""

import importlib
import inspect
import pathlib
import subprocess
import sys

import pytest

import qkv_jax

PUBLIC_MODULES = [
    "qkv_jax",
    "qkv_jax.attention",
    "qkv_jax.chunked",
    "qkv_jax.modules",
    "qkv_jax.models",
    "qkv_jax.lm",
    "qkv_jax.lora",
    "qkv_jax.finetune",
    "qkv_jax.diagnostics",
    "qkv_jax.checks",
    "qkv_jax.interop",
    "qkv_jax.text",
    "qkv_jax.positions",
    "qkv_jax.tasks.flag_retrieval",
    "qkv_jax.tasks.sequences",
    "qkv_jax.tasks.char_lm",
    "qkv_jax.tasks.pretrained_text",
    "qkv_jax.pretrained",
    "qkv_jax.training",
    "qkv_jax.nnx",
    "qkv_jax.interpretability",
    "qkv_jax.interpretability.circuits",
    "qkv_jax.interpretability.attribution",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_exported_name_exists_and_has_a_docstring(name):
    module = importlib.import_module(name)
    assert inspect.getdoc(module), f"{name} has no module docstring"
    assert module.__all__, f"{name}.__all__ is empty"
    undocumented = []
    for exported in module.__all__:
        value = getattr(module, exported)  # AttributeError names a stale __all__ entry
        if (inspect.isfunction(value) or inspect.isclass(value)) and not inspect.getdoc(value):
            undocumented.append(exported)
    assert not undocumented, f"{name}: no docstring on {undocumented}"


def test_top_level_names_are_the_submodules_objects():
    assert qkv_jax.MultiHeadAttention is importlib.import_module("qkv_jax.modules").MultiHeadAttention
    assert qkv_jax.TransformerLM is qkv_jax.lm.TransformerLM
    assert qkv_jax.head_diagnostics is qkv_jax.diagnostics.head_diagnostics
    # The jitted function keeps the wrapped function's docstring, shapes included.
    assert "[batch..., T, N, H]" in qkv_jax.dot_product_attention.__doc__


def test_package_ships_py_typed():
    assert (pathlib.Path(qkv_jax.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize(
    "module, heavy",
    [
        ("qkv_jax", ("matplotlib", "orbax", "optax", "qkv_jax.training", "torch")),
        # what the generate command line reads a checkpoint with: orbax and optax cost it 0.2 s
        ("qkv_jax.report.pretrained", ("matplotlib", "orbax", "optax", "torch")),
    ],
)
def test_import_does_not_pull_in_plotting_checkpointing_or_training(module, heavy):
    code = f"import sys, {module}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout
