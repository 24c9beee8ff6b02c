"""Read back what the optional sinks wrote, with the packages' own readers (no network)."""

import struct
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in the directory, as TensorBoard's event loader reads them."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    value = v.simple_value
                elif v.HasField("tensor") and v.metadata.plugin_data.plugin_name == "scalars":
                    value = float(tensor_util.make_ndarray(v.tensor))
                else:
                    continue
                out.setdefault(v.tag, []).append((event.step, value))
    return out


def wandb_history(run_dir: Path) -> list[dict]:
    """Every history row of every offline W&B run directory under ``run_dir/wandb``, in the order written.

    A ``.wandb`` file is W&B's record log: a 7-byte header, then 32 KiB blocks of (crc32, length, type) framed
    chunks (leveldb's log format) whose joined payloads are ``wandb_internal_pb2.Record`` messages.
    """
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for f in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data = f.read_bytes()
        assert data[:4] == b":W&B"
        pos, block, buf = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:
                break
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last chunk of one
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows
