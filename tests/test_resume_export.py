"""A kill after a run's final checkpoint, before its export landed (tests/test_crash_drill.py found it): the same
command run again writes what the run owes from that checkpoint, says so in one line, and trains nothing again;
a whole export of the final step is left alone ("nothing to do")."""

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import args, draft_args
from treadle.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

SHORT = ("--train.max_steps=2", "--checkpoint.every=2", "--train.eval_at_start=false", "--train.eval_every=0")
FOUR_LAYERS = "{hidden_size=32,intermediate_size=64,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2}"
BESIDE = (f"--model.overrides={FOUR_LAYERS}", "--draft.kind=eagle3", "--draft.target=self", "--draft.vocab_size=200",
          "--draft.eval_prompts=2", "--draft.eval_prompt_len=8", "--draft.eval_new_tokens=12")


def files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def untouched(run: Path) -> dict[str, bytes]:
    """What a rerun of a finished run must not change: its records and its checkpoints."""
    return {"metrics.jsonl": (run / "metrics.jsonl").read_bytes(),
            **{f"checkpoints/{k}": v for k, v in files(run / "checkpoints").items()}}


def again(argv, capsys) -> list[str]:
    """The same command once more: exit 0, and what it printed, line by line."""
    capsys.readouterr()
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return [line for line in (out + err).splitlines() if line.strip()]


def finished(run: Path, steps: int) -> str:
    return f"treadle: {run} finished at step {steps} (train.max_steps = {steps})"


def written_again(run: Path, steps: int, *exports: Path) -> list[str]:
    ckpt = run / "checkpoints" / f"step_{steps}"
    return [f"{finished(run, steps)}; its export was missing or incomplete, written again from {ckpt}: "
            + ", ".join(str(e) for e in exports)]


def kill_mid_replace(export: Path) -> None:
    """What a kill inside the export's replace leaves: the old directory renamed aside, the new one half written
    under its temporary name, and no ``export`` (fsutil.replace_dir, checkpoint/export.py atomic_directory)."""
    os.rename(export, export.parent / f".old-{export.name}-0badc0de")
    tmp = export.parent / f".tmp-{export.name}-12345678"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"\0" * 100)


def test_a_finished_run_whose_export_a_kill_lost_writes_it_from_the_final_checkpoint(shards, tmp_path, capsys):
    run = tmp_path / "run"
    argv = args(shards, run, *SHORT)
    assert main(argv) == 0
    hf = run / "hf"
    exported, kept = files(hf), untouched(run)

    kill_mid_replace(hf)  # the kill came after step_2 was committed, during the export
    (run / ".tmp-hf-mine").mkdir()  # not a name treadle writes: kept
    assert again(argv, capsys) == written_again(run, 2, hf)
    assert files(hf) == exported and untouched(run) == kept  # the same export, bit for bit; nothing trained again
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".tmp-", ".old-"))) == [".tmp-hf-mine"]
    assert again(argv, capsys) == [f"{finished(run, 2)}: nothing to do"]
    assert files(hf) == exported

    (hf / "model.safetensors").unlink()  # a whole export or none: a file gone is an export to write again
    assert again(argv, capsys) == written_again(run, 2, hf)
    assert files(hf) == exported and untouched(run) == kept

    # Extended to 4 steps, killed before the step-4 export replaced step 2's: the export on disk is an earlier step's.
    longer = args(shards, run, *SHORT, "--train.max_steps=4", "--checkpoint.allow_schedule_change=true")
    assert main(longer) == 0
    at_four, kept = files(hf), untouched(run)
    assert at_four["model.safetensors"] != exported["model.safetensors"]
    shutil.rmtree(hf)
    hf.mkdir()
    for name, data in exported.items():
        (hf / name).parent.mkdir(parents=True, exist_ok=True)
        (hf / name).write_bytes(data)
    assert again(longer, capsys) == written_again(run, 4, hf)
    assert files(hf) == at_four and untouched(run) == kept


def other_runs(shards, target_dir, run) -> dict[str, tuple[list[str], list[str]]]:
    """Each run whose export is not hf/ alone: (argv, its exports' names), the last the one the kill lost."""
    return {
        "draft-run": (draft_args(shards, target_dir, run, *SHORT), ["draft"]),  # DraftExportCallback
        "draft-beside": (args(shards, run, *SHORT, *BESIDE), ["hf", "draft"]),  # hf/, then draft/: killed between
        "lora": (args(shards, run, f"--model.path={target_dir}", "--lora.rank=4", "--lora.alpha=8", *SHORT),
                 ["adapter"]),  # AdapterExportCallback
    }


@pytest.mark.parametrize("kind", ["draft-run", "draft-beside", "lora"])
def test_a_finished_run_whose_draft_or_adapter_export_a_kill_lost_writes_it(shards, target_dir, tmp_path, capsys,
                                                                             kind):
    run = tmp_path / "run"
    argv, names = other_runs(shards, target_dir, run)[kind]
    assert main(argv) == 0
    exports = [run / name for name in names]
    exported, kept = {e: files(e) for e in exports}, untouched(run)

    kill_mid_replace(exports[-1])
    assert again(argv, capsys) == written_again(run, 2, exports[-1])  # beside: hf/ was whole, draft/ alone was lost
    assert {e: files(e) for e in exports} == exported and untouched(run) == kept
    assert not [p for p in run.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    assert again(argv, capsys) == [f"{finished(run, 2)}: nothing to do"]
