"""bench/gpu.py, behind `make gpu-check`: what a machine without CUDA does, and its plan checked on any machine.

The toy run (`python bench/gpu.py --device cpu --tiny`: every item at toy sizes on the CPU, every row OK) took
1.7 minutes on a shared 2-core machine with the built-in corpus cached and 4.3 with an empty cache (most of it
seven interpreters importing torch and transformers, and building the corpus): too long for the suite. Here the GPU plan and the toy plan are validated the way treadle validates a command (a mistyped key
fails here, not first on a GPU), and a plan with a typo is shown to fail that validation.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu.py"
ITEMS = ["tiny", "llama-1b", "torchrun", "glide", "eagle3", "dflash", "glide-1b", "eagle3-1b", "dflash-1b",
         "spec-glide", "spec-glide-1b", "spec-eagle3", "spec-eagle3-1b", "spec-dflash", "spec-dflash-1b",
         "samples", "features-1b", "eagle3-1b-stored", "dsv3-1b", "mtp-1b-shipped", "spec-mtp-1b-before",
         "mtp-1b-ft", "spec-mtp-1b-after", "fp8", "treadle-defaults", "treadle-best", "hf-bf16", "hf-compile",
         "bare-compile", "lora-r16", "qlora-r16", "attention"]


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


def _load_gpu(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu)
    spec.loader.exec_module(gpu)
    return gpu


def test_side_by_side_group_is_issue_40s_loops_with_one_timer_and_its_bench_scripts_arguments_are_checked(
        tmp_path, capsys, monkeypatch):
    gpu = _load_gpu(monkeypatch)
    items = {i.name: i for i in gpu.plan(tmp_path, "cuda", gpu.GPU, gpu.GROUPS["side-by-side"])}
    assert list(items) == ["treadle-defaults", "treadle-best", "hf-bf16", "hf-compile", "bare-compile", "attention"]
    # Every loop: the 1.1B, 8 x 2048, 40 steps, timed by the same Timer (treadle's: a [[callbacks]] entry).
    for name in gpu.LOOPS:
        words = " ".join(items[name].argv)
        assert "--steps 40" in words or ("--train.max_steps=40" in words and "bench/side_by_side.toml" in words), name
        assert "2048" in words and "hidden_size" in words and f"{tmp_path / name}" in words, name
    assert "--model.compile=true" in " ".join(items["treadle-best"].argv)
    assert not any(w.startswith(("--model.dtype", "--model.compile", "--model.attention"))
                   for w in items["treadle-defaults"].treadle)  # its defaults: nothing set but the run's size
    assert "--kinds dense,varlen,flex" in " ".join(items["attention"].argv)
    # A typo in a bench script's arguments is caught by the dry run, as a treadle key is.
    for name, broken in (("hf-bf16", "--step=3"), ("attention", "--dtypes=bf16")):
        item = gpu.plan(tmp_path, "cuda", gpu.GPU, [name])[0]
        item.treadle.append(broken)
        assert gpu.dry_run([item]) == 1
        assert f"{name}: INVALID" in capsys.readouterr().out


def test_the_loops_timer_counts_the_steps_it_names_and_writes_one_record(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import torch
    from gpu_loops import Timer

    from treadle.config import ModelConfig
    from treadle.models.hf import build_model

    model = build_model(ModelConfig(), 256)
    clock = iter([10.0, 13.0])  # the end of step 15 starts it, the end of step 40 stops it: steps 16-40, 3 s
    timer = Timer(str(tmp_path), last=40, tokens_per_step=600, device=torch.device("cpu"))
    monkeypatch.setattr(timer, "_now", lambda: next(clock))
    assert [timer.step_end(s, model, 64, settings="x") for s in range(1, 41)] == [False] * 39 + [True]
    got = json.loads((tmp_path / "step_timer.json").read_text())
    assert got["tokens_per_s"] == 25 * 600 / 3.0 and got["steps"] == [16, 40] and got["settings"] == "x"
    assert got["peak_kind"] == "RSS" and got["peak_gib"] > 0 and got["mfu"] is None  # no peak known on a CPU
    # A peak a loop's own metrics logged (treadle resets CUDA's at each log step) is kept when it is the higher.
    timer = Timer(str(tmp_path), last=2, tokens_per_step=600, device=torch.device("cpu"))
    timer.step_end(1, model, 64)
    timer.step_end(2, model, 64, logged_peak_gib=1e6)
    assert json.loads((tmp_path / "step_timer.json").read_text())["peak_gib"] == 1e6


def test_the_loops_mfu_is_against_the_bf16_peak(monkeypatch):
    """Every loop trains under bf16 autocast: its MFU is against the device's bf16 peak (the third GPU run's table
    read 505% against the fp32 one)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_loops

    from treadle.config import ModelConfig
    from treadle.metrics import flops
    from treadle.models.hf import build_model

    model = build_model(ModelConfig(), 256)
    asked = []
    monkeypatch.setattr(flops, "peak_tflops", lambda device, dtype, configured: asked.append(dtype) or 1.0)
    gpu_loops.utilization(model, 64, 1000.0, None)
    assert asked == ["bf16"]


def test_trace_summary_counts_busy_and_idle_time_over_overlapping_streams(tmp_path):
    # Kernels on two streams overlap (0-10 and 5-12 ms): busy is their union (12 ms), not their sum; the holes after
    # them (12-15, 20-30) are the idle time the host left; the ranking sums each kernel's calls.
    import gzip

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import trace_summary

    spans = [("gemm", 0, 10_000), ("softmax", 5_000, 7_000), ("gemm", 15_000, 5_000), ("copy", 30_000, 1_000)]
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": d} for n, ts, d in spans]
    events.append({"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#12", "ts": -500, "dur": 32_000})
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_summary.summary(trace_summary.load(path), top=2)
    assert (got["busy_ms"], got["idle_ms"], got["gaps"], got["span_ms"]) == (18.0, 13.0, 2, 31.0)
    assert got["host_span_ms"] == 32.0 and got["longest_gaps_ms"] == [10.0, 3.0]
    assert got["top"] == [("gemm", 15.0, 2), ("softmax", 7.0, 1)]
    table = trace_summary.markdown({"a": got, "b": {"error": "no kernel events"}}, top=2)
    assert "| GPU idle between kernels (ms) | 13.0 | - |" in table and "b: no kernel events" in table
