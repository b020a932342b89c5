"""Scalar TensorBoard event files, written without TensorFlow or tensorboardX.

An event file is a sequence of TFRecords (length, masked CRC-32C of the
length, the serialized `Event` protocol buffer, masked CRC-32C of it). Only
the few `Event` fields that scalars need are encoded here: wall_time (1),
step (2), file_version (3), summary (5: repeated Value {tag (1),
simple_value (2)}) and session_log (7: status START = 1, which tells
TensorBoard to drop the events a killed run wrote past `purge_step`).

Why not tensorboardX: importing it also imports torch when torch is
installed (and boto3), about 3 s of start-up here, which is most of the flag
experiment's run time. tests/test_tensorboard.py decodes these files with
tensorboardX's protocol buffer classes.
"""

from __future__ import annotations

import os
import pathlib
import socket
import struct
import time

__all__ = ["EventWriter", "crc32c"]


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, as TFRecord framing uses."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    key = _varint(number << 3 | wire_type)
    if wire_type == 2:  # length-delimited
        return key + _varint(len(payload)) + payload
    return key + payload


def _event(step: int, **fields: bytes) -> bytes:
    """An `Event` with wall_time now, `step`, and the given encoded fields."""
    event = _field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, _varint(step))
    for number, payload in sorted((_EVENT_FIELDS[name], value) for name, value in fields.items()):
        event += _field(number, 2, payload)
    return event


_EVENT_FIELDS = {"file_version": 3, "summary": 5, "session_log": 7}


class EventWriter:
    """Appends scalar events to `<logdir>/events.out.tfevents.<time>.<host>.<pid>`.

    `purge_step`: a resumed run's first step; TensorBoard then hides events of
    earlier files at or after it (what a killed run wrote past its checkpoint).
    """

    def __init__(self, logdir: str | pathlib.Path, purge_step: int | None = None):
        logdir = pathlib.Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = logdir / name
        self._file = open(self.path, "ab")
        self._write(_event(0, file_version=b"brain.Event:2"))
        if purge_step is not None:
            self._write(_event(purge_step, session_log=_field(1, 0, _varint(1))))  # status START
        self._file.flush()

    def _write(self, event: bytes) -> None:
        header = struct.pack("<Q", len(event))
        self._file.write(header + struct.pack("<I", _masked_crc(header)))
        self._file.write(event + struct.pack("<I", _masked_crc(event)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar (stored as float32, as TensorBoard's simple_value is)."""
        value_message = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", float(value)))
        self._write(_event(int(step), summary=_field(1, 2, value_message)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
