"""What an experiment is to the trainer: a `Setup` of pure functions, built by a task.

A task is a Python module with one function, `build(config: dict) -> Setup`,
named in the config by its dotted import path (`config.task.module`), as
big_vision names its models: the built-in tasks are the modules of
`qkv_jax.tasks`, and a task in a researcher's own package trains the same way,
with nothing in qkv_jax edited:

    config.task.module = "my_package.my_task"   # my_package/my_task.py: def build(config) -> Setup

The trainer checks the sections every config shares (seed, train, eval,
mesh) itself; `build` checks the task's own (raising `ConfigError` naming the
field and the value) before any array is made, and returns the pure functions
the trainer compiles. docs/adding_a_task.md has a complete example.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from qkv_jax.training.validate import ConfigError, get_field, validate_shared_sections

__all__ = ["AttentionView", "Setup", "TaskError", "build_setup", "to_dict"]

Params = Any
Batch = Any


class AttentionView(NamedTuple):
    """A task's attention on one input (what `Setup.inspect` returns)."""

    maps: dict[str, Any]  # {layer name: attention weights [N, T, S]}
    query_labels: list[str]  # T: the queries are the last T of the S key positions
    key_labels: list[str]  # S
    marks: list[int]  # key positions to mark (the flagged ones); may be empty


@dataclasses.dataclass(frozen=True)
class Setup:
    """One experiment, as pure functions (all jittable except `save_examples` and `inspect`).

    Attributes:
      model: the Flax module the parameters belong to (its `apply` is the
        TrainState's `apply_fn`; studies and tools read its attributes).
      init: `init(key) -> params`.
      sample_batch: `sample_batch(key, data) -> batch` (the training batch size).
      loss: `loss(params, batch, rng) -> (scalar loss, aux dict)`; `rng` is for
        dropout.
      evaluate: `evaluate(params, key, data) -> (metrics, examples)` on fresh data:
        a dict of scalar (or small array) metrics, and a pytree of per-example
        outputs for `save_examples`.
      save_examples: optional host-side `save_examples(workdir, stage, examples) -> dict`,
        called with stage "before" (the untrained model's examples) and
        "after": draws pictures, writes samples, and returns extra summary entries.
      data: a pytree of arrays the functions above read (a text corpus, say),
        passed to them as an argument so that it is never baked into the
        compiled program as a constant.
      inspect: optional `inspect(params, text) -> AttentionView`: the
        attention weights of every layer on one input (`text` as the task
        reads it, or None for a default one), for `experiments.inspect` and
        the explorer page of `experiments.report`.
      explorer_inputs: optional `explorer_inputs(data, prompt) -> [(name, text)]`:
        the inputs the explorer page shows (`prompt`: one given on the command
        line, or None).
      outputs: the files (besides pictures) `save_examples` writes into the
        workdir, so that `train.overwrite` moves them aside with the run's other files.
    """

    model: nn.Module
    init: Callable[[jax.Array], Params]
    sample_batch: Callable[[jax.Array, Any], Batch]
    loss: Callable[[Params, Batch, jax.Array], tuple[jax.Array, dict]]
    evaluate: Callable[[Params, jax.Array, Any], tuple[dict, Any]]
    save_examples: Callable[..., dict] | None = None
    data: Any = dataclasses.field(default_factory=dict)
    inspect: Callable[[Params, str | None], AttentionView] | None = None
    explorer_inputs: Callable[[Any, str | None], list[tuple[str, str]]] | None = None
    outputs: tuple[str, ...] = ()

    @classmethod
    def from_methods(cls, functions: Any, **fields: Any) -> Setup:
        """A Setup whose functions are `functions`' methods of the same names (`save_examples`,
        `inspect` and `explorer_inputs` when it has them), plus `fields` (model, data, outputs)."""
        names = ("init", "sample_batch", "loss", "evaluate", "save_examples", "inspect", "explorer_inputs")
        return cls(**{name: getattr(functions, name) for name in names if hasattr(functions, name)}, **fields)


class TaskError(ConfigError):
    """A task module failed to import or build with something other than a ConfigError (its
    `__cause__` is what it raised): a command line reports it as a bad config, a sweep as a
    failed cell rather than a skipped one."""


def to_dict(config: Any) -> dict:
    """A ConfigDict (or mapping) as a plain dict."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def build_setup(config: Any) -> Setup:
    """Checks the shared sections, imports `config.task.module` and returns its `build(config)`.

    Every way a task can fail to build is a ConfigError naming `task.module`: a
    module that cannot be imported, one without a `build`, a `build` that
    returns something other than a Setup. A module that raises while it is
    imported, or a `build` that raises anything but a ConfigError (its own
    passes through as it is), is a TaskError, whose `__cause__` is the
    original exception.
    """
    config = to_dict(config)
    validate_shared_sections(config)
    path = get_field(config, "task.module")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"task.module={path!r}: must be a dotted module path, e.g. 'my_package.my_task'")
    try:
        module = importlib.import_module(path)
    except ImportError as error:
        raise ConfigError(f"task.module={path!r}: cannot be imported ({error})") from None
    except Exception as error:  # noqa: BLE001 - a module that fails while it is imported
        raise TaskError(f"task.module={path!r}: importing it raised {_one_line(error)}") from error
    build = getattr(module, "build", None)
    if not callable(build):
        raise ConfigError(f"task.module={path!r}: has no function build(config) -> Setup")
    try:
        setup = build(config)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - the task's own failure, named as the task's
        raise TaskError(f"task.module={path!r}: build(config) raised {_one_line(error)}") from error
    if not isinstance(setup, Setup):
        raise ConfigError(f"task.module={path!r}: build(config) returned {type(setup).__name__}, not a Setup")
    return setup


def _one_line(error: BaseException) -> str:
    """'ValueError: the first line of its message'."""
    lines = str(error).strip().splitlines()
    return type(error).__name__ + (f": {lines[0]}" if lines else "")
