"""TensorBoard event files: written by every run, readable by TensorBoard's own protocol buffers.

The writer encodes the records itself (qkv_jax.training.tensorboard); here they
are decoded with tensorboardX's generated `Event` class and checked against its
CRC-32C, so a framing or encoding slip fails.
"""

import json
import struct

import pytest

from qkv_jax.training import tensorboard
from qkv_jax.training.workdir import MetricsWriter

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
tbx_crc = pytest.importorskip("tensorboardX.crc32c")


def read_events(path):
    """The `Event`s of one file, checking each record's two masked CRCs."""

    def masked(data):
        crc = tbx_crc.crc32c(data) & 0xFFFFFFFF
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    data, events, offset = path.read_bytes(), [], 0
    while offset < len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[offset + 8 : offset + 12])[0] == masked(header)
        body = data[offset + 12 : offset + 12 + length]
        assert struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])[0] == masked(body)
        events.append(event_pb2.Event.FromString(body))
        offset += 16 + length
    return events


def test_crc32c_matches_the_reference_values():
    assert tensorboard.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    for data in (b"", b"a", bytes(range(256)) * 3):
        assert tensorboard.crc32c(data) == tbx_crc.crc32c(data) & 0xFFFFFFFF


def test_event_file_decodes_with_tensorboards_protos(tmp_path):
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
