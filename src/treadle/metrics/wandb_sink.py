"""The ``wandb`` sink: the resolved config as the W&B run's config, every numeric metric at its step.

The W&B run id lives in ``<output_dir>/wandb.json`` with the last step sent, so a resumed run continues the same
W&B run. W&B history cannot be rewound: steps a process sent before it died are not sent again by the process
that resumes from an earlier checkpoint (W&B online would drop them as out of order anyway), so no step appears
twice. The values of those steps are the dead process's (identical for a bit-exact resume, but for timings).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from treadle.metrics.tensorboard_sink import scalars

STATE_FILE = "wandb.json"


class WandbSink:
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict, project: str, name: str, group: str | None, tags: list[str],
                 mode: str, resumed: bool):
        import wandb

        self.state_path = Path(run_dir) / STATE_FILE
        # A run that starts afresh (no checkpoint: its metrics start over too) is a new W&B run.
        state = json.loads(self.state_path.read_text()) if resumed and self.state_path.is_file() else {}
        self.run_id = state.get("run_id") or secrets.token_hex(4)  # W&B ids: lowercase letters and digits
        self.sent_before = state.get("sent_through", -1)  # steps up to this one were sent by an earlier process
        self.sent_through = self.sent_before
        self._save()  # the id first: a process killed before its first record still continues this W&B run
        self.run = wandb.init(project=project, name=name, group=group, tags=tags or None, mode=mode, id=self.run_id,
                              resume="allow", dir=str(run_dir), config=config,
                              settings=wandb.Settings(silent=True, console="off"))

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "sent_through": self.sent_through}))
        tmp.replace(self.state_path)

    def write(self, record: dict, kind: str = "step") -> None:
        step = record.get("step", 0)
        # Steps an earlier process sent, and (after an in-run rollback) steps before the newest sent: W&B's history
        # only moves forward. The same step again is fine (an eval after its step's record).
        if step <= self.sent_before or step < self.sent_through:
            return
        self.run.log(scalars(record), step=step)
        if step > self.sent_through:
            self.sent_through = step
            self._save()

    def close(self) -> None:
        self.run.finish()
