"""What the optional metric sinks cost a step, and a profile of one demo step.

One run of the demo's model and batch (configs/demo.toml: tiny Llama, 8 x 256 tokens, fp32, 2 threads) with every
sink on (TensorBoard, W&B offline) and a record every step (log_every = 1: the worst case; the demo logs every
10th), a profiler window over one step. The sinks' time is measured inside the run (``Sinks.seconds``: the time in
each sink's ``write``) and set against the mean step time of the steps outside the profiled one.

    python bench/sinks.py [--steps 12] [--profile-step 6]

Target (issue 17): each sink < 1% of a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def timed(sink) -> list[float]:
    """The seconds of each of ``sink``'s writes, appended as the run goes."""
    seconds, write = [], sink.write

    def timed_write(record, kind="step"):
        t0 = time.perf_counter()
        write(record, kind)
        seconds.append(time.perf_counter() - t0)

    sink.write = timed_write
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--profile-step", type=int, default=6)
    a = parser.parse_args()

    from treadle.config import load_config
    from treadle.train.callbacks import Callback
    from treadle.train.run import build_trainer, close_trainer

    class StepTimes(Callback):
        def __init__(self):
            self.seconds = {}

        def on_step_end(self, trainer, result):
            self.seconds[trainer.state.step] = trainer.last_step_seconds

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs" / "demo.toml", [
            f"--train.output_dir={tmp}/run", f"--train.max_steps={a.steps}", "--train.log_every=1",
            "--train.eval_every=0", "--train.eval_at_start=false", "--train.eval_batches=1",
            "--checkpoint.export_hf=false", "--checkpoint.every_minutes=0",
            '--metrics.sinks=["jsonl","console","tensorboard","wandb"]', "--metrics.wandb_mode=offline",
            f"--profile.start_step={a.profile_step}", "--profile.steps=1"])
        times = StepTimes()
        trainer = build_trainer(cfg, live=False, callbacks=[times])
        per_record = {sink.name: timed(sink) for sink in trainer.metrics.optional}
        t0 = time.perf_counter()
        try:
            trainer.fit()
        finally:
            close_trainer(trainer)
        wall = time.perf_counter() - t0
        # The first step (warm-up), the profiled one and its warm-up step are left out of the step time.
        clean = [s for k, s in times.seconds.items() if k not in (1, a.profile_step - 1, a.profile_step)]
        step = statistics.mean(clean)
        print(f"{a.steps} steps in {wall:.1f} s; mean step {step * 1e3:.0f} ms (steps outside the profile window)")
        print("| sink | first record (ms) | later records, median (ms) | mean (ms) | share of a step: log_every=1 "
              "| log_every=10 (demo) |")
        print("|---|---|---|---|---|---|")
        for name, seconds in per_record.items():
            later = statistics.median(seconds[1:])
            mean = statistics.mean(seconds)
            print(f"| {name} | {seconds[0] * 1e3:.1f} | {later * 1e3:.2f} | {mean * 1e3:.2f} | {100 * mean / step:.3f}% "
                  f"| {10 * mean / step:.4f}% |")


if __name__ == "__main__":
    main()
