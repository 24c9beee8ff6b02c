"""A callback registered from the config: stop when the validation loss stops improving.

    [[callbacks]]
    path = "examples/plateau_stop.py:StopOnPlateau"
    args = { patience = 3, min_delta = 0.01 }

It reads the eval record treadle's own EvalCallback logged this step (user callbacks run after evaluation),
logs its own metrics through ``trainer.log``, asks the run to stop with ``trainer.request_stop`` (the run then
stops as on a signal: a checkpoint, exit code 75), and keeps its counters in every checkpoint (``state_dict``),
so a resumed run remembers how long the loss has been flat.
"""

import treadle


class StopOnPlateau(treadle.Callback):
    def __init__(self, patience: int = 3, min_delta: float = 0.0):
        if patience < 1:
            raise ValueError(f"patience = {patience}; accepted: 1 or more evaluations")
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.flat = 0  # evaluations in a row without an improvement of min_delta

    def on_step_end(self, trainer, result):
        step = trainer.state.step
        evaluation = trainer.last_records.get("eval")  # the last record of each kind treadle logged
        if evaluation is None or evaluation["step"] != step or evaluation.get("eval_loss") is None:
            return  # no evaluation at this step
        loss = evaluation["eval_loss"]
        if self.best is None or loss < self.best - self.min_delta:
            self.best, self.flat = loss, 0
        else:
            self.flat += 1
        trainer.log({"step": step, "plateau_best_eval_loss": self.best, "plateau_flat_evals": self.flat})
        if self.flat >= self.patience:
            trainer.request_stop(f"eval_loss has not improved for {self.flat} evaluations")

    def state_dict(self):
        return {"best": self.best, "flat": self.flat}

    def load_state_dict(self, state):
        self.best, self.flat = state["best"], state["flat"]
