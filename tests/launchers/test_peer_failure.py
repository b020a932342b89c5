"""Another process of a multi-process run dies: this one stops with one line.

experiments/peer_failure.py filters a launcher's stderr (JAX's fatal log becomes one line,
everything else passes); `common.training_errors` turns a collective that meets the dead
process first into one line. The whole path, two processes and a death mid-load, is
tests/pretrained/test_pretrained_mesh.py's `test_a_process_dying_during_a_load_...`.
"""

import pathlib
import subprocess
import sys

from launch import launcher_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILTER = ROOT / "experiments" / "peer_failure.py"

# What process 0 (the coordinator's host) of a (2-process) run wrote to stderr when process 1 died
# (jaxlib 0.10.2), trimmed of most of the stack trace.
FATAL_LOG = """\
E1205 12:08:22.839251    9705 coordination_service.cc:1549] [168092] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending \
heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. \
preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1205 12:08:22.839958    9722 coordination_service_agent.cc:289] Polled an error from coordination \
service (this can be an error from this or another task).
F1205 12:08:22.840143    9722 client.h:80] Terminating process because the JAX distributed service \
detected fatal errors. This most likely indicates that another task died; see the other task logs \
for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous \
output. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. \
preemption, eviction) to debug further.

RPC: /xla.coordination.CoordinationService/PollForError
*** Check failure stack trace: ***
    @     0x7f22a3a40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7f22ab6521f5  (unknown)
"""
ONE_LINE = (
    "error: process 1 of this run stopped sending heartbeats (it died or hung); JAX's distributed "
    "service stops this process too\n"
)


def filtered(text: str) -> str:
    """`text` through the filter (bytes both ways: a progress bar's \r stays itself)."""
    result = subprocess.run(
        [sys.executable, "-I", str(FILTER)], input=text.encode(), capture_output=True, timeout=30
    )
    assert result.returncode == 0 and result.stderr == b"", result.stderr
    return result.stdout.decode()


def test_jax_fatal_log_for_a_dead_process_becomes_one_line():
    before = "step 10: loss 2.31\nI1205 12:08:20.000000    9705 cpu_client.cc:42] a record of another part\n"
    assert filtered(before + FATAL_LOG) == before + ONE_LINE


def test_other_lines_and_distributed_records_without_a_fatal_one_pass_unchanged():
    text = (
        "loaded\n"
        "W1205 12:08:22.100000    9705 coordination_service.cc:185] Using experimental recoverable "
        "task feature.\na line continuing it\n"
        'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad\n'
        "progress 50%\r"
    )
    assert filtered(text) == text


def test_no_second_line_after_the_launchers_own():
    own = "error: another process of this run stopped (UNKNOWN: Gloo AllGather failed); this one stops too\n"
    assert filtered(own + FATAL_LOG) == own


def test_a_collective_meeting_a_dead_process_is_one_line():
    """`training_errors` on the errors gloo raised here when the other process had died: a
    closed connection, and a rendezvous it never came to."""
    for message in (
        "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection "
        "closed by peer [127.0.0.1]:61132",
        "UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out with "
        "key: cpu:gloo/0,2048/1 and duration: 29.999999919s",
    ):
        code = (
            "import jax\nfrom experiments import common\n"
            f"with common.training_errors():\n    raise jax.errors.JaxRuntimeError({message!r})\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=launcher_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 1, result.stderr
        assert result.stderr == (
            f"error: another process of this run stopped ({message}); this process stops too\n"
        )
