"""treadle under Ray Train: a TorchTrainer whose workers each run ``treadle.fit`` (docs/cluster.md, "Ray Train").

    python examples/ray_train.py my.toml --workers 8 --gpus --storage /mnt/shared/ray --name my-run
    python examples/ray_train.py my.toml --train.max_steps=500 --workers 2      # extra arguments are overrides

Ray starts the workers and their process group; ``fit`` finds the group made and trains in it (it leaves it to
Ray at the end). Ray's ``storage_path`` holds Ray's own record of the run; treadle's checkpoints go where
treadle writes them, ``<storage>/<name>/treadle/checkpoints`` here: they carry what an exact resume needs (every
rank's RNG, the data position, the sharded optimizer) and commit atomically, and ``checkpoint.resume = "auto"``
finds the newest. So when a worker dies, ``FailureConfig(max_failures=...)`` makes Ray start the workers again,
each calls ``fit`` again, and the run continues from its last checkpoint as if never stopped. ``--storage`` must
be a file system every worker sees (one machine: any directory).

``--drill-kill-step N`` is a fault drill: worker 1 SIGKILLs itself right after step N's checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_loop_per_worker(config: dict) -> None:
    import treadle

    treadle.fit(config["config"], overrides=config["overrides"], live=False)  # metrics: <output_dir>/metrics.jsonl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="a treadle config file (default: the built-in default)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers = treadle ranks")
    parser.add_argument("--gpus", action="store_true", help="one GPU per worker")
    parser.add_argument("--storage", default=os.path.abspath("runs/ray"), help="Ray's storage_path (shared)")
    parser.add_argument("--name", default="treadle", help="the run's name under --storage")
    parser.add_argument("--max-failures", type=int, default=3, help="worker-group restarts Ray allows")
    parser.add_argument("--drill-kill-step", type=int, help="fault drill: worker 1 dies after this step's checkpoint")
    args, overrides = parser.parse_known_args(argv)

    overrides = [o.removeprefix("--") for o in overrides]
    if not any(o.startswith("train.output_dir=") for o in overrides):
        overrides.insert(0, f"train.output_dir={os.path.join(args.storage, args.name, 'treadle')}")
    if args.drill_kill_step:
        overrides += [f"checkpoint.every={args.drill_kill_step}", f"resilience.inject_kill_step={args.drill_kill_step}",
                      "resilience.inject_kill_rank=1"]

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": args.config and os.path.abspath(args.config), "overrides": overrides},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpus),
        run_config=RunConfig(storage_path=args.storage, name=args.name,
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    print(f"ray_train: {'failed: ' + str(result.error) if result.error else 'finished'}; treadle's run directory: "
          f"{next(o for o in overrides if o.startswith('train.output_dir=')).split('=', 1)[1]}")
    return 0 if result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
