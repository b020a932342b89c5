"""The stderr of one process of a multi-process run, passed through, except that JAX's fatal log
for another process's death becomes one line.

  python experiments/peer_failure.py   (stdin: the launcher's stderr; stdout: the terminal's)

When one process of a `jax.distributed` run dies, the coordination service stops hearing its
heartbeats and, after its timeout, ends every other process through a fatal C++ log: the
service's error records, a "Terminating process because the JAX distributed service detected
fatal errors" record and a stack trace, twenty-odd lines in all. JAX's Python API has no hook
for it: the client's `missed_heartbeat_callback` cannot be set from Python in jaxlib 0.10 (the
call fails converting the status, `std::bad_cast`, and aborts), and
`jax_enable_recoverability`, which would turn the death into a Python exception, also lets the
survivors wait at collectives that may never fail (on GPUs). So the launchers
(`experiments.common.initialize_devices`) route their stderr through this filter:

- log records of the distributed service (coordination_service.cc, coordination_service_agent.cc,
  client.h, client.cc) and the lines that continue them are held back for a second;
- when the fatal record comes, everything held and everything after it (the stack trace) is
  replaced by one line naming the processes that stopped sending heartbeats; none when the
  launcher has already written its own `error:` line (it met the death first, in a collective);
- otherwise the held lines are written as they were, once a second passes without more of them,
  or another line comes. Every other line passes at once.

It ignores SIGINT, SIGTERM, SIGHUP and SIGQUIT (the launcher handles those) and ends when the
launcher's stderr closes. It imports nothing beyond the standard library.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys

RECORD = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (?P<source>[\w.]+):\d+\] ")
RECORD_START = re.compile(rb"^[IWEF]\d")
DISTRIBUTED = {
    b"coordination_service.cc",
    b"coordination_service_agent.cc",
    b"client.h",
    b"client.cc",
}
FATAL = b"JAX distributed service detected fatal errors"
UNHEALTHY = re.compile(rb"unhealthy \(stopped sending heartbeats\):\s*(?P<ids>\d+(?:[\s,]+\d+)*)")
TIMED_OUT = re.compile(rb"Task (?P<ids>\d+) heartbeat timeout")
HOLD_S = 1.0  # how long held records wait for a fatal record before they are written
AFTER_FATAL_S = 0.5  # how long the lines after the fatal record (its status) are awaited


def one_line(text: bytes) -> bytes:
    """The line that replaces the fatal log `text`: which processes stopped, when it says."""
    ids: set[int] = set()
    for pattern in (UNHEALTHY, TIMED_OUT):
        for match in pattern.finditer(text):
            ids.update(int(i) for i in re.split(rb"[\s,]+", match.group("ids").strip()) if i)
    who = (
        f"process {', '.join(map(str, sorted(ids)))} of this run stopped sending heartbeats (it died or hung)"
        if ids
        else "another process of this run failed (see its own output)"
    )
    return f"error: {who}; JAX's distributed service stops this process too\n".encode()


class Filter:
    """The filter's state: lines held back, whether the fatal record came, and whether an
    `error:` line went out."""

    def __init__(self, write) -> None:
        self.write = write
        self.held: list[bytes] = []
        self.fatal = False
        self.reported = False
        self.said_error = False

    def line(self, line: bytes) -> None:
        if self.fatal:
            self.held.append(line)
            return
        record = RECORD.match(line)
        if record and record.group("source") in DISTRIBUTED:
            self.held.append(line)
            self.fatal = FATAL in line
            return
        if self.held and not record:  # a continuation of the held record
            self.held.append(line)
            return
        self.release()
        self.said_error = self.said_error or line.startswith(b"error: ")
        self.write(line)

    def release(self) -> None:
        """Writes the held lines as they were (no fatal record came)."""
        if self.held and not self.fatal:
            self.write(b"".join(self.held))
            self.held = []

    def report(self) -> None:
        """The one line for a fatal record (once, and only when no `error:` line went out)."""
        if self.fatal and not self.reported:
            self.reported = True
            if not self.said_error:
                self.write(one_line(b"".join(self.held)))
            self.held = []

    def quiet(self) -> None:
        """No input for the hold time."""
        if self.fatal:
            self.report()
        else:
            self.release()

    def end(self, partial: bytes) -> None:
        if partial:
            self.line(partial)
        self.report()
        self.release()


def relay() -> None:
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    out = sys.stdout.buffer

    def write(data: bytes) -> None:
        try:
            out.write(data)
            out.flush()
        except OSError:  # the terminal went away: keep draining, so the launcher never blocks
            pass

    state = Filter(write)
    partial = b""
    while True:
        wait = AFTER_FATAL_S if state.fatal and not state.reported else HOLD_S if state.held else None
        if not select.select([0], [], [], wait)[0]:
            state.quiet()
            continue
        data = os.read(0, 1 << 16)
        if not data:
            state.end(partial)
            return
        *lines, partial = (partial + data).split(b"\n")
        for line in lines:
            state.line(line + b"\n")
        if partial and not state.held and not RECORD_START.match(partial):
            write(partial)  # a progress bar's \r updates pass at once
            partial = b""


if __name__ == "__main__":
    relay()
