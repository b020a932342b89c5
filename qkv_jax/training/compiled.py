"""The compiled programs of one run, compiled ahead of time in background threads.

This is the run's only speed machinery, kept out of the training loop:

  * `jax.jit(...).lower(...).compile()` for the init, the evaluation and each
    chunk length, started as soon as their shapes are known. XLA releases the
    GIL while it compiles, so the evaluation and the first training chunk
    compile while the checkpoint is restored and the untrained model is
    evaluated; for the flag task, most of a cold command is compilation
    (benchmarks/flag_retrieval.py).
  * On CPU, XLA's backend optimization level 1 instead of the default 2: for
    the small models here it compiles about a third faster and the compiled
    loops run as fast or faster (benchmarks/flag_retrieval.py measures both).
    `train.cpu_optimization_level=0` goes further for runs that are mostly
    compilation (a tiny model, a few steps): level 0 with XLA's fusion
    emitters off (where the XLA has them: jaxlib 0.12's has not) compiles a
    tiny char LM's programs about 2x faster, but its steps run about 4x slower
    and the default char LM's 2.5x slower (benchmarks/compile_levels.py
    measures both).

A run of several seeds compiles the same functions under `jax.vmap` over a
leading seed axis (init and evaluation keys, the parameters and optimizer
state); nothing else differs.

With `checkify=True` the chunk is wrapped in `jax.experimental.checkify`, and
a nan or division by zero inside it becomes a FloatingPointError naming the
operation and the window of steps.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import checkify
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qkv_jax.training.loop import init_train_state, make_train_chunk
from qkv_jax.training.memory import check_fits
from qkv_jax.training.setup import Setup
from qkv_jax.training.sharding import state_shardings

__all__ = [
    "CPU_COMPILER_OPTIONS",
    "cpu_compiler_options",
    "compile_for_platform",
    "run_level",
    "run_compiled",
    "CompiledPrograms",
]

# train.cpu_optimization_level -> XLA:CPU's compiler options (see the module docstring); an
# option this XLA does not have is left out (`cpu_compiler_options`).
CPU_COMPILER_OPTIONS: dict[int, dict[str, Any]] = {
    0: {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
    1: {"xla_backend_optimization_level": 1},
    2: {},
}


@functools.cache
def _has_compile_option(name: str, value: Any) -> bool:
    """Whether this XLA takes compile option `name` (XLA drops options between releases: the one
    of jaxlib 0.12 refuses `xla_cpu_use_fusion_emitters`, which jaxlib 0.10 has)."""
    try:
        jax.jit(lambda: 0).lower().compile(compiler_options={name: value})
    except jax.errors.JaxRuntimeError:
        return False
    return True


def cpu_compiler_options(cpu_optimization_level: int) -> dict[str, Any]:
    """CPU_COMPILER_OPTIONS[cpu_optimization_level], without the options this XLA lacks."""
    options = CPU_COMPILER_OPTIONS[cpu_optimization_level]
    return {name: value for name, value in options.items() if _has_compile_option(name, value)}


def compile_for_platform(jitted: Any, *args: Any, cpu_optimization_level: int = 1) -> Any:
    """AOT-compiles `jitted` for `args` (arrays or ShapeDtypeStructs); on CPU with the
    compiler options of `cpu_optimization_level` (see the module docstring)."""
    lowered = jitted.lower(*args)
    if jax.default_backend() == "cpu":
        return lowered.compile(compiler_options=cpu_compiler_options(cpu_optimization_level))
    return lowered.compile()


def run_level(config: dict) -> int:
    """The run's `train.cpu_optimization_level`; 1 for a run saved before the field existed
    (what every run was compiled at then)."""
    return config["train"].get("cpu_optimization_level", 1)


def run_compiled(fn: Callable, *args: Any, config: dict) -> Any:
    """`fn(*args)`, jitted and compiled by `compile_for_platform` as the run of `config` compiles
    its programs (a one-off call outside the trainer that should compute what the trainer's
    compiled programs compute, e.g. a report's evaluation)."""
    return compile_for_platform(jax.jit(fn), *args, cpu_optimization_level=run_level(config))(*args)


class CompiledPrograms:
    """init, evaluate and train_chunk of one run on `mesh`, compiled on `pool`'s threads.

    `train_chunk(state, first_step, n) -> (state, losses [n] or [seeds, n])`,
    `evaluate(params) -> (metrics, examples)`, `init(key) -> TrainState`: each
    waits for its compile. With `vmapped`, every function runs over a leading
    seed axis (`keys` then hold one key per seed). `compile_seconds()` sums the
    finished compiles.
    """

    def __init__(
        self,
        setup: Setup,
        tx: Any,
        mesh: Any,
        keys: dict,
        config: dict,
        pool: concurrent.futures.ThreadPoolExecutor,
        vmapped: bool = False,
    ):
        self._setup, self._keys, self._config, self._pool = setup, keys, config, pool
        self._vmapped = vmapped
        self._use_checkify = config["train"]["checkify"]
        self._cpu_level = run_level(config)
        self._checked: set = set()
        init = lambda key: init_train_state(setup, tx, key)
        self._init = jax.vmap(init) if vmapped else init
        self.abstract_state = jax.eval_shape(self._init, keys["init"])
        self.state_sharding = state_shardings(self.abstract_state, mesh, seed_axis=vmapped)
        self._replicated = NamedSharding(mesh, P())
        # The stacked batches [steps, batch, ...] are split over "data"; a vmapped run's
        # batches are drawn per seed inside the vmap, and left to XLA.
        self._batches = None if vmapped else NamedSharding(mesh, P(None, "data"))
        self._futures: dict[Any, concurrent.futures.Future] = {}
        self.train_seconds = 0.0  # in compiled chunks, waiting for their results (not their compiles)

    def _vmap(self, fn: Callable) -> Callable:
        """`fn(state or params, key, data)` over the seed axis of its first two arguments."""
        return jax.vmap(fn, in_axes=(0, 0, None)) if self._vmapped else fn

    def _compiled(self, name: Any, make_jitted: Callable[[], Any], *args: Any) -> concurrent.futures.Future:
        if name not in self._futures:

            def timed():
                started = time.perf_counter()
                compiled = compile_for_platform(make_jitted(), *args, cpu_optimization_level=self._cpu_level)
                return compiled, time.perf_counter() - started

            self._futures[name] = self._pool.submit(timed)
        return self._futures[name]

    def _evaluate_program(self) -> concurrent.futures.Future:
        jitted = lambda: jax.jit(
            self._vmap(self._setup.evaluate),
            in_shardings=(self.state_sharding.params, self._replicated, self._replicated),
            out_shardings=self._replicated,
        )
        return self._compiled(
            "evaluate", jitted, self.abstract_state.params, self._keys["eval"], self._setup.data
        )

    def _chunk_program(self, n: int) -> concurrent.futures.Future:
        def jitted():
            chunk = self._vmap(make_train_chunk(self._setup, n, self._batches))
            # The incoming state is donated: its buffers become the outgoing state's (no copy).
            in_shardings = (self.state_sharding, self._replicated, self._replicated)
            if self._use_checkify:  # the error value's sharding is left to XLA
                checked = checkify.checkify(chunk, errors=checkify.float_checks)
                return jax.jit(checked, in_shardings=in_shardings, donate_argnums=0)
            out_shardings = (self.state_sharding, self._replicated)
            return jax.jit(chunk, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=0)

        return self._compiled(("chunk", n), jitted, self.abstract_state, self._keys["data"], self._setup.data)

    def start(self, first_chunk: int | None) -> None:
        """Starts compiling the evaluation and (unless None) a chunk of `first_chunk` steps."""
        self._evaluate_program()
        if first_chunk is not None:
            self._chunk_program(first_chunk)

    def init(self) -> Any:
        """The fresh train state (one per seed when vmapped), placed on the mesh."""
        return jax.jit(self._init, out_shardings=self.state_sharding)(self._keys["init"])

    def _ready(self, name: Any, program: concurrent.futures.Future, what: str) -> Any:
        """The compiled program, checked once to fit in memory (memory.check_fits)."""
        compiled = program.result()[0]
        if name not in self._checked:
            check_fits(compiled, what, self._config)
            self._checked.add(name)
        return compiled

    def evaluate(self, params: Any) -> tuple[dict, Any]:
        run = self._ready("evaluate", self._evaluate_program(), "the evaluation")
        return run(params, self._keys["eval"], self._setup.data)

    def train_chunk(self, state: Any, first_step: int, n: int) -> tuple[Any, jax.Array]:
        run = self._ready(("chunk", n), self._chunk_program(n), "the training step")
        started = time.perf_counter()
        outputs = jax.block_until_ready(run(state, self._keys["data"], self._setup.data))
        self.train_seconds += time.perf_counter() - started
        if not self._use_checkify:
            return outputs
        error, (state, losses) = outputs
        try:
            error.throw()
        except checkify.JaxRuntimeError as found:
            window = f"in the window of steps {first_step}-{first_step + n - 1}"
            raise FloatingPointError(f"checkify: {str(found).splitlines()[0]} ({window})") from None
        return jax.device_put(state, self.state_sharding), losses

    def compile_seconds(self) -> float:
        return sum(f.result()[1] for f in self._futures.values() if f.done() and not f.exception())
