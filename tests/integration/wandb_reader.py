"""Read the history of an offline W&B run file (`run-ID.wandb`) back, for the tracker tests.

The file is a 7-byte header (":W&B", magic, version) followed by LevelDB-log framed records
in 32 KiB blocks: crc32 (4) | length (2, little-endian) | type (1: full, 2: first, 3: middle,
4: last) | payload. Each assembled payload is a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, parts, pos = [], [], HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # trailer padding at the end of a block
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        parts.append(payload)
        if kind in (1, 4):
            out.append(b"".join(parts))
            parts = []
    return out


def history(path: Path) -> list[dict]:
    """Every logged history row: {"_step": n, key: value, ...}."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            rows.append(row)
    return rows
