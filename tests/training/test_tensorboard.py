"""TensorBoard event files: written by every run, read back by TensorBoard's own loader."""

import json

import pytest

from qkv_jax.training import tensorboard
from qkv_jax.training.workdir import MetricsWriter

# A dependency of qkv_jax; missing only where packages are placed by hand (the GPU machine's image).
pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader  # noqa: E402


def read_events(path):
    """Every `Event` of one file as stored, through TensorBoard's reader (which checks the CRCs)."""
    return list(LegacyEventFileLoader(str(path)).Load())


def test_event_file_reads_back_with_tensorboard(tmp_path):
    writer = tensorboard.EventWriter(tmp_path, purge_step=300)
    writer.add_scalar("train/loss", 0.125, 7)
    writer.add_scalar("eval/accuracy", 1.0, 2**40)  # a multi-byte varint step
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    first, purge, loss, accuracy = read_events(path)
    assert first.file_version == "brain.Event:2" and first.wall_time > 0
    assert purge.step == 300 and purge.session_log.status == purge.session_log.START
    assert (loss.step, loss.summary.value[0].tag, loss.summary.value[0].simple_value) == (
        7,
        "train/loss",
        0.125,
    )
    assert (accuracy.step, accuracy.summary.value[0].simple_value) == (2**40, 1.0)


def test_metrics_writer_mirrors_the_jsonl_into_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", start_step=0, log_every=10)
    writer.write({"step": 0, "loss": 2.5})
    writer.write({"step": 10, "loss": 0.5})
    writer.write_scalars("eval", {"accuracy": 0.75, "name": "not a number", "flag": True}, 10)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"loss": 2.5, "step": 0}, {"loss": 0.5, "step": 10}]
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars = [(e.step, v.tag, v.simple_value) for e in read_events(path) for v in e.summary.value]
    assert scalars == [(0, "train/loss", 2.5), (10, "train/loss", 0.5), (10, "eval/accuracy", 0.75)]
    shown = EventAccumulator(str(tmp_path / "tensorboard")).Reload()  # what the TensorBoard viewer reads
    assert [(s.step, s.value) for s in shown.Scalars("train/loss")] == [(0, 2.5), (10, 0.5)]
