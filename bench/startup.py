"""How long the CLI takes to answer when it has nothing to run: help, version, config errors, `treadle config`.

Each case is a real `python -m treadle ...` subprocess (interpreter start-up included, as a user pays it),
run N times round-robin (case 1, case 2, ..., case 1, ...) so that drift of the machine hits every case alike.
Two baselines are measured in the same rounds: `python -c pass` (the floor) and `python -c "import torch"`
(what any command that touches torch pays on top). The table reports the median and the min-max.

    python bench/startup.py [--rounds 7] [--src DIR ...]

--src: the treadle source trees to time (default: this checkout's src/); give two (e.g. an older commit's, from
`git archive`) for a before/after measured in the same rounds.
Target (issue 13.5): every case well under 2 s on a 2-core machine, none of them imports torch.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of every `treadle` case; the baselines are added in main."""
    broken = tmp / "broken.toml"
    broken.write_text("[train\nmax_steps = 5\n")
    treadle = [sys.executable, "-m", "treadle"]
    return [
        ("treadle --help", treadle + ["--help"]),
        ("treadle --version", treadle + ["--version"]),
        ("treadle train --help", treadle + ["train", "--help"]),
        ("treadle train --trian.x=1 (unknown key)", treadle + ["train", "--trian.x=1"]),
        ("treadle train --train.max_steps=abc (bad value)", treadle + ["train", "--train.max_steps=abc"]),
        ("treadle train broken.toml (bad TOML)", treadle + ["train", str(broken)]),
        ("treadle train missing.toml (no file)", treadle + ["train", str(tmp / "missing.toml")]),
        ("treadle config", treadle + ["config"]),
        ("treadle config --explain", treadle + ["config", "--explain"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--src", type=Path, nargs="+", default=[Path(__file__).resolve().parents[1] / "src"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        baselines = [("python -c pass", [sys.executable, "-c", "pass"]),
                     ("python -c 'import torch'", [sys.executable, "-c", "import torch"])]
        todo = [(("", name), cmd, dict(os.environ)) for name, cmd in baselines]
        todo += [((str(src), name), cmd, {**os.environ, "PYTHONPATH": str(src.resolve())})
                 for name, cmd in cases(Path(tmp)) for src in args.src]  # the trees side by side, case by case
        times = {key: [] for key, _, _ in todo}
        codes = {key: set() for key, _, _ in todo}
        for _ in range(args.rounds):
            for key, cmd, env in todo:
                t = time.perf_counter()
                done = subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                times[key].append(time.perf_counter() - t)
                codes[key].add(done.returncode)
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "none"
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch_version}, {args.rounds} rounds")
    print("| src | command | median s | min-max s | exit code |")
    print("|---|---|---|---|---|")
    for (src, name), ts in times.items():
        print(f"| {src} | {name} | {statistics.median(ts):.2f} | {min(ts):.2f}-{max(ts):.2f} | "
              f"{', '.join(map(str, sorted(codes[(src, name)])))} |")


if __name__ == "__main__":
    main()
