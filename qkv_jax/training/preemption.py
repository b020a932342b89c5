"""Stopping cleanly when the scheduler asks: SIGTERM (and SIGINT) end a run at a chunk boundary.

Schedulers (SLURM, Kubernetes, preemptible cloud machines) send SIGTERM and
wait a grace period before they kill. `train_and_evaluate` then finishes the
chunk it is running, saves a checkpoint at that step, flushes the metrics and
raises `Preempted`; the launcher prints one line and exits with
`EXIT_PREEMPTED`. The same command resumes from that checkpoint, and the
resumed run ends with the parameters of an uninterrupted one.

One process: a Python signal handler notes SIGTERM or SIGINT (a second signal
of the same kind stops at once, with the default behaviour). Several processes
(`jax.distributed`): JAX's preemption service catches SIGTERM on whichever
host gets it and agrees with the other hosts on the step to stop at
(`multihost_utils.reached_preemption_sync_point`), so every process saves the
same checkpoint; SIGINT keeps its default there.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

__all__ = ["EXIT_PREEMPTED", "Preempted", "StopSignals"]

# sysexits.h's EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_PREEMPTED = 75


class Preempted(Exception):
    """A run stopped on a signal after saving a checkpoint at `step`."""

    def __init__(self, step: int, signal_name: str, directory: str):
        super().__init__(
            f"stopped by {signal_name} at step {step}: checkpoint saved in {directory}; "
            "run the same command to resume"
        )
        self.step = step
        self.signal_name = signal_name


class StopSignals:
    """Notes SIGTERM/SIGINT while installed; `reached(boundary)` says whether to stop.

    `reached` must be called once at every chunk boundary, with consecutive
    `boundary` numbers, on every process (with several processes it is a
    collective of JAX's preemption service); `save_or_stop` does, and saves.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._boundaries = 0

    def _note(self, number: int, frame: FrameType | None) -> None:
        del frame
        self.received = signal.Signals(number).name
        signal.signal(number, signal.SIG_DFL)  # a second one stops at once

    def install(self) -> StopSignals:
        """Installs the handlers (single process, main thread only; elsewhere a no-op)."""
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._note)
        return self

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def reached(self, boundary: int) -> bool:
        if jax.process_count() > 1:
            if multihost_utils.reached_preemption_sync_point(boundary):
                self.received = self.received or "SIGTERM"
                return True
            return False
        return self.received is not None

    def save_or_stop(
        self, end: int, steps: int, checkpoint_every: int, save: Callable[[int], None], directory: Any
    ) -> None:
        """After a chunk that ended at step `end`: saves (`save(end)`) on the checkpoint grid,
        at the last step, or when a signal asks to stop, and then raises `Preempted`."""
        halt = self.reached(self._boundaries)
        self._boundaries += 1
        if end % checkpoint_every == 0 or end == steps or halt:
            save(end)
        if halt and end < steps:
            raise Preempted(end, self.received or "a signal", str(directory))
