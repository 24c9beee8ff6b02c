"""Read back what the optional sinks wrote, with the packages' own readers (no network)."""

import struct
import time
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


def tensorboard_accumulated_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as ``EventAccumulator(...).Scalars(tag)`` returns them: what most scripts and notebooks
    read, and stricter than the event loader above (a scalar stored as a tensor summary is not a scalar to it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every value, no reservoir sampling
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path) -> list:
    """The records of one ``.wandb`` file: W&B's record log, a 7-byte header, then 32 KiB blocks of (crc32,
    length, type) framed chunks (leveldb's log format) whose joined payloads are ``wandb_internal_pb2.Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, block, buf = [], 7, 32768, b""
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
            records.append(record)
            buf = b""
    return records


def wandb_history(run_dir: Path, run_id: str = "*", timeout: float = 30.0) -> list[dict]:
    """Every history row of the offline W&B runs (``run_id``: of that W&B run) under ``run_dir/wandb``, in order.

    ``Run.finish`` returns before W&B's service has written everything: each file is read once it holds its
    exit record (written last)."""
    import json

    rows = []
    for f in sorted(Path(run_dir).glob(f"wandb/offline-run-*-{run_id}/run-*.wandb")):
        deadline = time.monotonic() + timeout
        records = _wandb_records(f)
        while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
            time.sleep(0.2)
            records = _wandb_records(f)
        rows += [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                 for r in records if r.WhichOneof("record_type") == "history"]
    return rows
