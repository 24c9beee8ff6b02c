"""bench/gpu.py, behind `make gpu-check`: what a machine without CUDA does, and its plan checked on any machine.

The toy run (`python bench/gpu.py --device cpu --tiny`: every item at toy sizes on the CPU, every row OK) took
1.7 minutes on a shared 2-core machine with the built-in corpus cached and 4.3 with an empty cache (most of it
seven interpreters importing torch and transformers, and building the corpus): too long for the suite. Here the GPU plan and the toy plan are validated the way treadle validates a command (a mistyped key
fails here, not first on a GPU), and a plan with a typo is shown to fail that validation.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu.py"
ITEMS = ["tiny", "llama-1b", "torchrun", "glide", "eagle3", "dflash", "glide-1b", "eagle3-1b", "dflash-1b",
         "spec-glide", "spec-glide-1b", "spec-eagle3", "spec-eagle3-1b", "spec-dflash", "spec-dflash-1b",
         "samples", "features-1b", "eagle3-1b-stored", "dsv3-1b", "mtp-1b-shipped", "spec-mtp-1b-before",
         "mtp-1b-ft", "spec-mtp-1b-after", "fp8"]


def _run(*args: str) -> subprocess.CompletedProcess:
    # CUDA hidden: a GPU machine running the suite takes the no-CUDA path too, instead of starting the check.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_gpu_check_without_cuda_says_so_in_one_line_and_its_plans_validate(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    proc = _run("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("gpu-check: no CUDA here (") and "nothing run" in line and "--device cpu --tiny" in line
    assert proc.stderr == "" and not out.exists()  # nothing written

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu)  # its dataclasses look their module up there
    spec.loader.exec_module(gpu)
    for device, sizes in (("cuda", gpu.GPU), ("cpu", gpu.TOY)):  # what `--dry-run [--device cpu --tiny]` prints
        capsys.readouterr()
        assert gpu.dry_run(gpu.plan(tmp_path, device, sizes)) == 0
        printed = capsys.readouterr().out
        assert [ln for ln in printed.splitlines() if not ln.startswith(" ")] == [f"{name}: ok" for name in ITEMS]
        assert ("--model.compile=true" in printed) == (device == "cuda") and "--model.dtype=bf16" in printed
        assert "--nproc_per_node=1" in printed and "--distributed.engine=fsdp2" in printed

    # The validation catches what would otherwise fail only on the GPU machine: a key treadle does not know, and
    # an HF config field that transformers would keep silently without using it.
    for name, broken in (("tiny", "--train.max_step=5"), ("llama-1b", "--model.overrides={num_hidden_layer = 2}")):
        items = gpu.plan(tmp_path, "cuda", gpu.GPU, [name])
        items[0].treadle.append(broken)
        assert gpu.dry_run(items) == 1
        assert f"{name}: INVALID" in capsys.readouterr().out
