"""The ``tensorboard`` sink: every numeric metric as a scalar under its own key, the config as text and hparams.

Like metrics.jsonl, the event files hold each step once: a run starts a new event file, copies into it the older
files' scalars up to the step it resumes from (none on a fresh start), then removes the older files. Any reader
sees one value per step, not only TensorBoard with its purge logic (``purge_step`` hides duplicates, keeps them).

The copy is of the events as written (``LegacyEventFileLoader``: parsed, nothing migrated). ``EventFileLoader``
migrates a scalar into a tensor summary on read; TensorBoard's UI shows such a copy, but ``EventAccumulator.Scalars``
(what scripts and notebooks read) does not, and would return only the steps after the last resume.
"""

from __future__ import annotations

import math
from pathlib import Path

EVENT_GLOB = "events.out.tfevents.*"
_HEADER_TAGS = ("config/", "_hparams_/")  # written afresh by every process


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers (bools, strings, lists and nulls are not scalars)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _scalars_as_written(event) -> None:
    """A scalar that an earlier treadle copied in migrated form (a 0-d tensor of the scalars plugin) back to the
    ``simple_value`` that ``add_scalar`` writes, so a run logged before the fix reads whole again after its next
    resume."""
    from tensorboard.util import tensor_util

    for v in event.summary.value:
        if (v.HasField("tensor") and v.metadata.plugin_data.plugin_name == "scalars"
                and not v.tensor.tensor_shape.dim):
            value = float(tensor_util.make_ndarray(v.tensor))
            v.ClearField("tensor")
            v.ClearField("metadata")
            v.simple_value = value


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path, config_toml: str, hparams: dict, keep_through: int):
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self.log_dir = Path(log_dir)
        older = sorted(self.log_dir.glob(EVENT_GLOB))
        self.writer = SummaryWriter(str(self.log_dir))
        # Four spaces: TensorBoard renders text as markdown, and an indented block keeps the TOML as it is.
        self.writer.add_text("config", "\n".join("    " + line for line in config_toml.splitlines()), 0)
        # In this run's own event file (add_hparams would make a sub-run per call).
        for summary in hparams_summary(hparams, {"loss": 0.0, "eval_loss": 0.0}):
            self.writer.file_writer.add_summary(summary)
        for f in older:
            for event in LegacyEventFileLoader(str(f)).Load():  # raw, not migrated: see above
                if (event.HasField("summary") and event.step <= keep_through
                        and not any(v.tag.startswith(_HEADER_TAGS) for v in event.summary.value)):
                    _scalars_as_written(event)
                    self.writer.file_writer.add_event(event, walltime=event.wall_time)
        self.writer.flush()
        for f in older:  # their records up to the resumed step are in the new file now
            f.unlink()

    def write(self, record: dict, kind: str = "step") -> None:
        step = record.get("step", 0)
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
