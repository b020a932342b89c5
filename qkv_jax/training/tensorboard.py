"""Scalar TensorBoard event files, through the `tensorboard` package's own writer.

`tensorboard.summary.writer.event_file_writer.EventFileWriter` writes the
event files without TensorFlow (the TFRecord framing, CRCs and protocol
buffers are TensorBoard's). It is imported on first use, so a run pays its
import (about 0.12 s here) only when it writes scalars. (tensorboardX is
not used: importing it also imports torch when torch is installed, about 3 s
of start-up here, most of the flag experiment's run time.)
"""

from __future__ import annotations

import pathlib
import time

__all__ = ["EventWriter"]


class EventWriter:
    """Scalar events in `<logdir>/events.out.tfevents.<time>.<host>.<pid>...`.

    `purge_step`: a resumed run's first step; TensorBoard then hides events of
    earlier files at or after it (what a killed run wrote past its checkpoint).
    """

    def __init__(self, logdir: str | pathlib.Path, purge_step: int | None = None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        pathlib.Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir))
        if purge_step is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._add(event_pb2.Event(step=purge_step, session_log=start))

    @property
    def path(self) -> pathlib.Path:
        return pathlib.Path(self._writer.get_filename())

    def _add(self, event) -> None:
        event.wall_time = time.time()
        self._writer.add_event(event)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar (stored as float32, as TensorBoard's simple_value is)."""
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=value)]
        )
        self._add(self._event_pb2.Event(step=int(step), summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
