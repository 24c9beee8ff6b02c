"""End to end on small real data: train, checkpoint, resume bit for bit, export, errors."""

import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.cli import main
from tests.helpers import args, records

def test_resume_continues_bit_for_bit(shards, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(args(shards, a, "--train.max_steps=6", "--checkpoint.every=3", "--checkpoint.keep_last=5")) == 0
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["latest", "step_3", "step_6"]
    assert (a / "checkpoints" / "latest").resolve().name == "step_6"
    # B starts from A's mid-run checkpoint: it must replay A's last three steps exactly.
    assert main(args(shards, b, "--train.max_steps=6", f"--checkpoint.resume={a / 'checkpoints' / 'step_3'}")) == 0
    loss_a, loss_b = records(a), records(b)
    assert sorted(loss_b) == [4, 5, 6]
    assert [loss_a[s] for s in (4, 5, 6)] == [loss_b[s] for s in (4, 5, 6)]
    wa, wb = load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa = json.loads((a / "checkpoints" / "step_6" / "train_state.json").read_text())
    sb = json.loads((b / "checkpoints" / "step_6" / "train_state.json").read_text())
    assert sa["loader"] == sb["loader"] and sa["schedule"] == sb["schedule"]
    assert sa["train"]["tokens"] == sb["train"]["tokens"] == 6 * 8 * 32
    # The training changed the model and the validation loss went down.
    evals = records(a, "eval_loss")
    assert evals[6] < evals[0]
    # Extending a finished cosine run re-stretches the schedule: the lr at step 6 would jump from its floor back
    # up, so it needs the explicit flag. With it the run continues from the run dir's config as is, the config
    # that trained steps 1-6 is kept beside the new one, and the flag is not saved as granted for the next time.
    first_config = (a / "config.toml").read_text()
    assert main(["train", str(a / "config.toml"), "--train.max_steps=7"]) == 2
    assert main(["train", str(a / "config.toml"), "--train.max_steps=7", "--checkpoint.allow_schedule_change=true"]) == 0
    assert max(records(a)) == 7 and (a / "checkpoints" / "latest").resolve().name == "step_7"
    assert (a / "config.step_6.toml").read_text() == first_config
    assert main(["train", str(a / "config.toml"), "--train.max_steps=8"]) == 2
    # B forked from A's step_3: its own config.toml continues B (checkpoint.resume is saved as auto).
    assert main(["train", str(b / "config.toml")]) == 0 and max(records(b)) == 6


def test_resume_prints_changes_keeps_the_previous_config_and_applies_them(shards, tmp_path, capsys):
    from treadle.config import load_config
    from treadle.train.run import build_trainer

    run, base = tmp_path / "run", ("--schedule.decay=constant", "--checkpoint.every=1", "--checkpoint.keep_last=5")
    assert main(args(shards, run, "--train.max_steps=2", *base)) == 0
    first_config = (run / "config.toml").read_text()
    (run / ".treadle-run").unlink()  # a run from before the marker is still a run
    capsys.readouterr()
    # A constant schedule keeps its lr at step 2 when extended: no flag needed. weight_decay takes effect although
    # the optimizer's state dict in the checkpoint carries the old one.
    trainer = build_trainer(load_config(None, args(shards, run, "--train.max_steps=3", "--optim.weight_decay=0.5", *base)[1:]))
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
    out = capsys.readouterr().out
    kept = run / "config.step_2.toml"
    assert f"changed since step_2 (the previous config is kept as {kept}):\n  optim.weight_decay: 0.1 -> 0.5\n" \
           "  train.max_steps: 2 -> 3\n" in out
    assert kept.read_text() == first_config and (run / ".treadle-run").is_file()
    assert [g["weight_decay"] for g in trainer.engine.optimizer.param_groups] == [0.5, 0.0]
    assert max(records(run)) == 3 and load_config(run / "config.toml").optim.weight_decay == 0.5


def test_rollback_to_an_older_checkpoint_needs_the_flag_and_replays_exactly(shards, tmp_path):
    from treadle.config import load_config
    from treadle.train.run import build_trainer

    run = tmp_path / "run"
    argv = args(shards, run, "--train.max_steps=3", "--checkpoint.every=1", "--checkpoint.keep_last=5")
    assert main(argv) == 0
    loss, step1 = records(run), run / "checkpoints" / "step_1"
    assert main(argv + [f"--checkpoint.resume={step1}"]) == 2  # would replace step_2 and step_3 silently
    trainer = build_trainer(load_config(None, argv[1:] + [f"--checkpoint.resume={step1}", "--checkpoint.allow_rollback=true"]))
    try:
        # Rolled back before training: a crash from here on resumes step_1's branch, never the abandoned one.
        assert [p.name for p in trainer.checkpoints.complete()] == ["step_1"] and trainer.checkpoints.latest() == step1
        assert max(records(run)) == 1
        trainer.fit()
    finally:
        trainer.metrics.close()
    assert records(run) == loss  # the same steps again, bit for bit
    saved = load_config(run / "config.toml").checkpoint
    assert (saved.resume, saved.allow_rollback) == ("auto", False)


def test_export_matches_trained_model_and_cli_export(shards, tmp_path):
    run = tmp_path / "run"
    assert main(args(shards, run, "--train.max_steps=3")) == 0
    hf = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    tok = AutoTokenizer.from_pretrained(run / "hf")
    ids = torch.tensor([tok.encode("def main():\n    return 0\n")])
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "again")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, again(ids).logits)
        assert hf.config.use_cache  # training disables the cache; the export is for inference
    assert main(["export", str(run / "checkpoints" / "step_3"), "--to", "hf", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    w = load_file(tmp_path / "bf16" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in w.values())


def _modes(directory):
    return {p.name: oct(p.stat().st_mode & 0o777) for p in directory.iterdir()}


def test_export_records_its_dtype_and_replaces_only_its_own_output(shards, tmp_path):
    """Hole 9: config.json said float32 over bf16 weights, and model.safetensors was 0600; hole 1: the marker
    makes treadle's own export replaceable, and only that."""
    run = tmp_path / "run"
    assert main(args(shards, run, "--train.max_steps=2")) == 0
    umask = os.umask(0o022)
    os.umask(umask)
    assert set(_modes(run / "hf").values()) == {oct(0o666 & ~umask)}  # the run's own export too
    out = tmp_path / "out"
    for dtype, expected in (("bf16", torch.bfloat16), ("fp16", torch.float16), (None, torch.float32)):
        flags = ["--dtype", dtype] if dtype else []
        assert main(["export", str(run), str(out), *flags]) == 0  # the second and third replace the first
        assert json.loads((out / "config.json").read_text())["dtype"] == str(expected).removeprefix("torch.")
        model = AutoModelForCausalLM.from_pretrained(out)
        assert {p.dtype for p in model.parameters()} == {expected}
    marker = json.loads((out / ".treadle.json").read_text())
    assert marker["written_by"] == "treadle export" and marker["kind"] == "export"
    assert set(marker["files"]) == {p.name for p in out.iterdir()} - {".treadle.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".old-", ".tmp-"))]
    # An export from before the marker (export files only) is treadle's own too: a resumed old run re-exports.
    (run / "hf" / ".treadle.json").unlink()
    assert main(["train", str(run / "config.toml"), "--train.max_steps=3", "--checkpoint.allow_schedule_change=true"]) == 0
    assert json.loads((run / "hf" / ".treadle.json").read_text())["written_by"] == "treadle train"

    old = os.umask(0o027)
    try:
        assert main(["export", str(run), str(out)]) == 0
    finally:
        os.umask(old)
    assert set(_modes(out).values()) == {"0o640"}  # every file follows the umask, the weights too


def test_logits_of_exported_model_equal_the_trained_model(shards, tmp_path):
    from treadle.config import load_config
    from treadle.train.run import build_trainer

    from treadle.models.chunked_ce import ChunkedLMHead

    # Trained with the chunked loss: the export is a plain model whose head holds the trained weight.
    trainer = build_trainer(load_config(None, args(shards, tmp_path / "r", "--train.max_steps=2",
                                                   "--model.loss_chunk_tokens=16")[1:]))
    assert isinstance(trainer.engine.module.lm_head, ChunkedLMHead)
    trainer.fit()
    ids = torch.randint(0, 512, (2, 16))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "r" / "hf").eval()
    with torch.no_grad():
        assert torch.equal(trainer.engine.model.eval()(ids).logits, exported(ids).logits)


def test_bad_inputs_exit_2_and_touch_nothing(shards, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(args(shards, run, "--train.max_steps=2")) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()

    def fails(argv, expected):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("treadle: error:") and expected in err and "\n" not in err

    fails(args(shards, run, "--checkpoint.resume=none"), "already holds checkpoints")
    fails(args(shards, run, f"--data.train={tmp_path / 'missing'}"), str(tmp_path / "missing"))
    fails(args(shards, run, "--model.preset=huge"), "accepted: medium, small, tiny, tiny-moe")
    fails(args(shards, run, f"--checkpoint.resume={tmp_path}"), "holds no checkpoint")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    fails(args(shards, blocker / "run"), "is not writable")
    # Engines that need a process group, asked for without a launcher; a DeepSpeed JSON that is not there.
    fails(args(shards, run, "--distributed.engine=fsdp2"), "torchrun --nproc_per_node N")
    fails(args(shards, run, "--distributed.engine=deepspeed"), "deepspeed --num_gpus N")
    fails(args(shards, run, "--distributed.engine=gpipe"), "distributed.engine = 'gpipe' is invalid")
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before


def test_console_script_runs_and_prints_summary(shards, tmp_path):
    exe = shutil.which("treadle", path=str(__import__("pathlib").Path(sys.executable).parent))
    proc = subprocess.run([exe, *args(shards, tmp_path / "run", "--train.max_steps=2")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for needle in ("train loss", "val loss", "tokens/s", "checkpoints", "exported model", "step 2:"):
        assert needle in proc.stdout
    assert "torch.distributed is disabled" not in proc.stderr  # DCP's single-process warning, silenced at its calls
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"} <= first.keys()


def test_commands_that_do_not_use_deepspeed_never_import_it(shards, tmp_path):
    """``--help``, a local run and the export of its DCP checkpoint, each a real ``python -m treadle``: ``--help`` never
    imports DeepSpeed (``-X importtime`` lists every module a process imports); a run and an export import it only
    through accelerate (transformers' save_pretrained), and its accelerator warning never prints."""
    run = tmp_path / "run"
    commands = [["--help"], args(shards, run, "--train.max_steps=2", "--train.eval_batches=1"),
                ["export", str(run / "checkpoints" / "step_2"), str(tmp_path / "out")]]
    for argv in commands:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "treadle", *map(str, argv)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
        assert "treadle.cli" in imported  # the listing is real
        # DeepSpeed's own code never loads; accelerate (PEFT's dependency) imports it from transformers'
        # save_pretrained (its unwrap) wherever it is installed: the export, quietly.
        loaded = [m for m in imported if m.split(".")[0] == "deepspeed"]
        assert not loaded or (argv != ["--help"] and "accelerate" in imported), argv
        assert "Setting accelerator" not in proc.stderr + proc.stdout, argv
        assert "torch.distributed is disabled" not in proc.stderr, argv  # DCP save (train) and load (export)
