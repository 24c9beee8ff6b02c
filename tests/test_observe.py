"""Seeing inside a run: TensorBoard and W&B sinks, FLOPs / MFU / memory, the profiler window, callbacks from the
config, `treadle report`. The sinks are the real packages, read back with their own readers (W&B offline)."""

import errno
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from treadle.cli import main
from tests.helpers import args, draft_args, records
from tests.sink_readers import tensorboard_accumulated_scalars, tensorboard_scalars, wandb_history

ROOT = Path(__file__).resolve().parents[1]
SINKS = '--metrics.sinks=["jsonl","console","tensorboard","wandb"]'


def test_sinks_profile_and_a_config_callback_through_a_resume(shards, tmp_path, capsys):
    run = tmp_path / "run"
    config = tmp_path / "callbacks.toml"  # the example file, registered as a user would
    config.write_text(f'[[callbacks]]\npath = "{ROOT / "examples" / "plateau_stop.py"}:StopOnPlateau"\n'
                      'args = { patience = 100 }\n')
    argv = args(shards, run, "--train.max_steps=6", "--checkpoint.every=3", "--checkpoint.keep_last=5",
                "--train.eval_every=3", SINKS, "--metrics.wandb_mode=offline", "--metrics.peak_tflops=2.0",
                "--profile.start_step=2", "--profile.steps=2")
    argv.insert(1, str(config))
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "warning" not in first and "profile of steps 2-3: aten::" in first, first
    traces = list((run / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]
    first_wandb_id = json.loads((run / "wandb.json").read_text())["run_id"]
    # Back to step 3 as after a crash there: steps 4-6 run again, and every sink must still hold each step once.
    assert main(["train", str(run / "config.toml"), f"--checkpoint.resume={run / 'checkpoints' / 'step_3'}",
                 "--checkpoint.allow_rollback=true"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:  # FLOPs and memory in every step record; mfu against the configured peak
        assert r["tflops_per_s"] > 0 and r["mfu"] == pytest.approx(r["tflops_per_s"] / 2.0) and r["peak_rss_gib"] > 0.1
    loss, evals = records(run), records(run, "eval_loss")
    # The config-registered callback ran at every eval, logged through trainer.log, and kept its state.
    assert records(run, "plateau_best_eval_loss") == {3: min(evals[0], evals[3]), 6: min(evals.values())}
    state = json.loads((run / "checkpoints" / "step_6" / "train_state.json").read_text())
    assert state["callbacks"]["StopOnPlateau"] == {"best": min(evals.values()), "flat": 0 if evals[6] < evals[0] else 1}

    tb = tensorboard_scalars(run / "tensorboard")
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [s for s, _ in tb["loss"]] == [1, 2, 3, 4, 5, 6] and [s for s, _ in tb["eval_loss"]] == [0, 3, 6]
    assert [v for _, v in tb["loss"]] == pytest.approx([loss[s] for s in range(1, 7)], rel=1e-6)
    assert [s for s, _ in tb["mfu"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tensorboard_accumulated_scalars(run / "tensorboard")["loss"]] == [1, 2, 3, 4, 5, 6]

    rows = wandb_history(run)
    assert len(list((run / "wandb").glob(f"offline-run-*-{first_wandb_id}"))) == 2  # one W&B run, continued
    assert [r["_step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # an eval shares its step's row
    assert {r["_step"]: r["loss"] for r in rows if "loss" in r} == pytest.approx(loss, rel=1e-12)
    assert {r["_step"]: r["eval_loss"] for r in rows if "eval_loss" in r} == pytest.approx(evals, rel=1e-12)


def test_tensorboard_history_survives_resumes_for_both_readers(tmp_path):
    """Run 3 steps, resume to 6, again to 8: TensorBoard's event loader and EventAccumulator.Scalars (what scripts
    read) both see every step once, with its value, and the older files are gone."""
    from treadle.metrics.tensorboard_sink import TensorBoardSink

    log_dir = tmp_path / "tensorboard"

    def session(keep_through, steps):
        sink = TensorBoardSink(log_dir, "x = 1", {"x": 1}, keep_through)
        for step in steps:
            sink.write({"step": step, "loss": 10.0 - step, "lr": 1e-3})
        sink.close()

    session(-1, [1, 2, 3])
    session(3, [4, 5, 6])
    session(5, [6, 7, 8])  # back to step 5, as after a crash there: step 6 runs again
    expected = [(s, 10.0 - s) for s in range(1, 9)]
    for read in (tensorboard_scalars, tensorboard_accumulated_scalars):
        tb = read(log_dir)
        assert tb["loss"] == expected, read.__name__
        assert [s for s, _ in tb["lr"]] == list(range(1, 9)), read.__name__
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1


def test_tensorboard_history_copied_in_migrated_form_before_the_fix_reads_whole_after_a_resume(tmp_path):
    """A run directory from an earlier treadle: its steps 1-3 were copied as tensor summaries (EventFileLoader's
    migrated form), invisible to EventAccumulator.Scalars. Its next resume writes them back as scalars."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    from treadle.metrics.tensorboard_sink import TensorBoardSink

    log_dir = tmp_path / "tensorboard"
    old = SummaryWriter(str(tmp_path / "old"))
    for step in (1, 2, 3):
        old.add_scalar("loss", 10.0 - step, step)
    old.close()
    migrated = SummaryWriter(str(log_dir))
    for event in EventFileLoader(str(next((tmp_path / "old").glob("events.out.tfevents.*")))).Load():
        if event.HasField("summary"):
            migrated.file_writer.add_event(event)
    migrated.close()
    assert "loss" not in tensorboard_accumulated_scalars(log_dir)  # the bug, as it was on disk
    sink = TensorBoardSink(log_dir, "x = 1", {"x": 1}, 3)
    sink.write({"step": 4, "loss": 6.0})
    sink.close()
    for read in (tensorboard_scalars, tensorboard_accumulated_scalars):
        assert read(log_dir)["loss"] == [(s, 10.0 - s) for s in range(1, 5)], read.__name__


def test_a_plain_log_shows_the_total_the_time_left_each_eval_starting_and_what_each_loss_is(shards, target_dir,
                                                                                            tmp_path, capsys,
                                                                                            monkeypatch):
    import re

    monkeypatch.setenv("COLUMNS", "250")  # the summary table on one line per row
    assert main(args(shards, tmp_path / "run", "--train.max_steps=3", "--train.eval_every=2")) == 0
    out = capsys.readouterr().out  # not a terminal: plain lines
    assert re.search(r"^step 1: loss=\S+ .* elapsed_s=\S+ .*\[1/3\]$", out, re.M), out
    assert re.search(r"^step 2: loss=\S+ .* \[2/3, eta \d+s\]$", out, re.M), out
    assert re.search(r"^step 3: loss=\S+ .* \[3/3, eta 0s\]$", out, re.M), out
    starting = "eval {}: validation loss on 2 batches of 4 x 32 tokens ...\neval {}: eval_loss="
    assert all(starting.format(s, s) in out for s in (0, 2, 3)), out
    assert re.search(r"train loss\W+\S+ \(first step\) -> \S+ \(last step\): cross-entropy per label token ", out), out
    assert re.search(r"val loss\W+\S+ at step 0 -> \S+ at step 3: cross-entropy per label token ", out), out
    assert "target val loss" not in out
    assert re.search(r"val perplexity\W+\d", out) and records(tmp_path / "run", "eval_ppl")

    # A draft run's train loss is its objective (KL by default), its val loss the draft's cross-entropy.
    assert main(draft_args(shards, target_dir, tmp_path / "draft", "--train.max_steps=2")) == 0
    out = capsys.readouterr().out
    assert "eval 0: acceptance (tau_sim, drafts in fp32) on 2 prompts, the target's continuations generated first ...\n" in out
    assert "eval 2: acceptance (tau_sim, drafts in fp32) on 2 prompts ...\n" in out, out
    assert re.search(r"train loss\W+\S+ \(first step\) -> \S+ \(last step\): KL\(target \|\| draft\) per label "
                     r"token ", out), out
    assert re.search(r"val loss\W+\S+ at step 0 -> \S+ at step 2: the draft's cross-entropy on the data per label "
                     r"token ", out), out
    # Issue 39: the target's own figure beside the draft's, saying what it is averaged over.
    assert re.search(r"target val loss\W+\S+ at step 2: the frozen target's cross-entropy on the data per label "
                     r"token ", out), out
    # Issue 48: a draft's summary leads with what its users read (tau_sim, acceptance per position with the rounds
    # behind it, top-1 agreement per slot) and shows no perplexity: exp of a draft's eval loss is none.
    rows = [line.split()[1] for line in out.splitlines() if line.startswith("│")]
    assert rows.index("tau_sim") < rows.index("acceptance") < rows.index("top-1") < rows.index("train"), rows
    gamma = 4  # GLIDE's default draft.gamma
    assert re.search(r"acceptance\W+(\d\.\d\d ){%d}at positions 1\.\.%d, step 2 \(P\(position k accepted \| "
                     r"1\.\.k-1 were\), over \d+, (\d+, ){%d}\d+ rounds\)" % (gamma, gamma, gamma - 2), out), out
    assert re.search(r"top-1 agreement\W+\d\.\d\d at slot 1, step 2 \(the draft's argmax is the target's", out)
    assert "perplexity" not in out and not records(tmp_path / "draft", "eval_ppl")
    agreement = records(tmp_path / "draft", "eval_acc_1")
    assert set(agreement) == {0, 2} and all(0.0 <= a <= 1.0 for a in agreement.values())
    assert not records(tmp_path / "draft", "eval_ttt_rows_1")  # the counts became the rate
    rounds = records(tmp_path / "draft", "acceptance_rounds")
    assert set(rounds) == {0, 2} and all(isinstance(n, int) and n > 0 for n in rounds.values())


def test_loss_labels_name_each_objective():
    from treadle.config import load_config
    from treadle.drafts.glide.objective import GlideObjective
    from treadle.train.moe import RouterObjective

    def label(*overrides):
        return GlideObjective(load_config(None, ["--draft.kind=glide", "--draft.target=x", *overrides]).draft,
                              512, 32).label

    assert label() == "KL(target || draft) per label token"
    assert label("--draft.loss=ce") == "cross-entropy on the data per label token"
    assert label("--draft.loss=mix", "--draft.kl_weight=0.25") == ("0.75 cross-entropy + 0.25 KL(target || draft) per "
                                                                  "label token")
    assert label("--draft.ttt_steps=3") == ("KL(target || draft), summed over 3 unroll steps weighted 0.8^k, per label "
                                            "token")
    assert RouterObjective(None, 0.01, 0.0).label == "cross-entropy + 0.01 x router aux loss per label token"
    assert RouterObjective(None, 0.0, 0.0).label == RouterObjective.eval_label == "cross-entropy per label token"
    # Issue 39: a DFlash run's val loss sat below its target's with no word of why: it sums the scored slots (at most
    # 30 of a row's 32 positions here) and divides by the label tokens, as every loss; not a mean per slot.
    from treadle.drafts.dflash.objective import DFlashObjective

    dflash = DFlashObjective(load_config(None, ["--draft.kind=dflash", "--draft.target=x"]).draft, 32, 512)
    assert dflash.eval_label == ("the draft's cross-entropy on the data, summed over the scored slots (15 per block, up "
                                 "to 2 blocks per row: at most 30 of a row's 32 label tokens), per label token; not a "
                                 "mean per slot")
    assert dflash.label.endswith(", summed, per label token")


def test_flops_formula_within_10_percent_of_flop_counter():
    """6·N + 12·L·H·Q·T per token against torch's FlopCounterMode on one training step of the tiny preset.

    Eager attention: FlopCounterMode has no formula for CPU sdpa's flash kernel (it would count the matmuls only)."""
    from torch.utils.flop_counter import FlopCounterMode

    from treadle.config import ModelConfig
    from treadle.metrics.flops import attention_dims, matmul_parameters, train_flops_per_token
    from treadle.models.hf import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"), 8192)
    model.config._attn_implementation = "eager"
    batch, seq = 2, 128
    ids = torch.randint(0, 8192, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    formula = train_flops_per_token(matmul_parameters(model), *attention_dims(model.config), seq) * batch * seq
    # The issue asks for 10%; here it is exact, and 2% would catch a lost attention term (3.5% at T = 128).
    assert abs(formula / counter.get_total_flops() - 1) < 0.02


def test_a_failing_sink_is_reported_once_and_dropped(tmp_path):
    from treadle.metrics.sinks import JsonlSink, Sinks

    class DiskFull:  # a sink whose disk filled up at its second record
        name = "tensorboard"

        def __init__(self):
            self.written = []

        def write(self, record, kind):
            if self.written:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written.append(record)

        def close(self):
            pass

    warnings, broken = [], DiskFull()
    sinks = Sinks(JsonlSink(tmp_path / "metrics.jsonl"), warn=warnings.append)
    sinks.add(broken)
    for step in (1, 2, 3):
        sinks.write({"step": step, "loss": 1.0})
    sinks.close()
    assert broken.written == [{"step": 1, "loss": 1.0}] and sinks.optional == []
    assert warnings == ["treadle: warning: the tensorboard sink failed (OSError: [Errno 28] No space left on device); "
                        "it is dropped, training goes on"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_missing_extra_and_bad_callbacks_are_one_line_before_anything_is_written(shards, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it raises ImportError
    assert main(args(shards, run, '--metrics.sinks=["jsonl","wandb"]')) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'treadle[wandb]'" in err and "'wandb'" in err
    entries = {
        'path = "examples/nope.py:X"': "callbacks[0].path = 'examples/nope.py:X' cannot be loaded (FileNotFoundError",
        'path = "json:JSONDecoder"': "callbacks[0].path = 'json:JSONDecoder' is not a treadle.Callback subclass",
        f'path = "{ROOT / "examples" / "plateau_stop.py"}:StopOnPlateau"\nargs = {{ patience = 0 }}':
            "callbacks[0]: StopOnPlateau(**{'patience': 0}) raised ValueError: patience = 0; accepted: 1 or more",
        'path = "no_colon"': "callbacks[0].path = 'no_colon' is invalid",
    }
    for entry, message in entries.items():
        config = tmp_path / "c.toml"
        config.write_text(f"[[callbacks]]\n{entry}\n")
        argv = args(shards, run)
        argv.insert(1, str(config))
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not run.exists()


def _metrics(path: Path, rows: list[dict]) -> Path:
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_has_the_panels_and_lines_and_replaces_only_its_own_png(tmp_path, capsys):
    from treadle.metrics.report import build_figure, read_run

    plain = _metrics(tmp_path / "plain", [{"step": 0, "eval_loss": 9.0}] + [
        {"step": s, "loss": 9.0 - s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s, "tokens_per_s": 100.0,
         "tflops_per_s": 0.5, "mfu": 0.25} for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 6.5}])
    draft = _metrics(tmp_path / "draft", [
        {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64, "tokens_per_s": 90.0, "loss/a": 2.1},
        {"step": 2, "event": "nonfinite_step_skipped", "loss": None},
        {"step": 2, "loss": 1.5, "lr": 1e-3, "grad_norm": 1.0, "tokens": 128, "tokens_per_s": 90.0, "loss/a": 1.6},
        {"step": 1, "event": "rollback", "checkpoint": "x"},
        {"step": 2, "tau_sim": 2.5, "accept_1": 0.8, "accept_2": 0.6}])
    fig = build_figure([read_run(plain, "plain"), read_run(draft, "draft")])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(axes) == ["tau_sim (simulated tokens per verification)",
                          "acceptance per position (n: rounds reaching it)", "loss vs step", "loss vs tokens",
                          "draft objective (train loss)", "learning rate", "grad norm (before clipping)", "tokens/s",
                          "loss per source", "TFLOP/s per device (mfu: right axis)"]
    assert [line.get_label() for line in axes["loss vs step"].get_lines()] == ["plain train", "plain eval"]
    assert [line.get_label() for line in axes["draft objective (train loss)"].get_lines()][:2] == [
        "draft train", "draft skipped step"]
    assert list(axes["loss vs step"].get_lines()[0].get_xdata()) == [1, 2, 3]
    assert list(axes["loss vs tokens"].get_lines()[1].get_xdata()) == [0, 192]  # evals placed by their tokens
    assert [line.get_label() for line in axes["loss per source"].get_lines()] == ["draft a"]
    accept = axes["acceptance per position (n: rounds reaching it)"]
    assert list(accept.get_lines()[0].get_ydata()) == [0.8, 0.6]
    assert not accept.texts  # a record without acceptance_rounds (written before issue 48): no counts to show

    out = tmp_path / "report.png"
    assert main(["report", str(plain), str(draft), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    assert main(["report", str(plain), "--out", str(out)]) == 0  # its own earlier report: replaced
    foreign = tmp_path / "photo.png"
    foreign.write_bytes(b"\x89PNG not ours")
    capsys.readouterr()
    assert main(["report", str(plain), "--out", str(foreign)]) == 2 and foreign.read_bytes() == b"\x89PNG not ours"
    assert main(["report", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_report_axes_follow_the_data_mfu_positions_and_a_drafts_kl_apart_from_its_ce(tmp_path):
    """Issue 39: a CPU run's panel promised an mfu axis it had no data for; the acceptance axis stopped at the last
    run's positions (4) when DFlash had 7; a draft's KL objective and the cross-entropies shared one loss axis."""
    from treadle.metrics.report import build_figure, read_run

    def draft_run(name, positions, kl):
        steps = [{"step": s, "loss": kl / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s, "tokens_per_s": 90.0,
                  "tflops_per_s": 0.01, "target_loss": 5.5, "draft_ce": 7.0 - s, "draft_kl": kl / s} for s in (1, 2)]
        evals = [{"step": 2, "eval_loss": 5.1, "eval_target_loss": 5.5}]
        accept = [{"step": 2, "tau_sim": 2.0, **{f"accept_{k}": 0.5 for k in range(1, positions + 1)}}]
        return read_run(_metrics(tmp_path / name, steps + evals + accept), name)

    dflash, glide = draft_run("dflash", 7, 0.9), draft_run("glide", 4, 0.4)
    fig = build_figure([dflash, glide])  # the run with fewer positions drawn last
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert "TFLOP/s per device" in axes and not any("mfu" in t for t in axes)  # CPU: no mfu, none promised
    assert len(fig.axes) == len(axes)  # and no right axis drawn for it
    accept = axes["acceptance per position (n: rounds reaching it)"]
    assert list(accept.get_xticks()) == [1, 2, 3, 4, 5, 6, 7] and accept.get_xlim()[1] > 7
    # The objective panel holds each run's objective alone; the cross-entropies and the KL have panels of their own,
    # and no model's loss panel is drawn for drafts alone.
    assert "loss vs step" not in axes and "loss vs tokens" not in axes
    assert [line.get_label() for line in axes["draft objective (train loss)"].get_lines()] == ["dflash train",
                                                                                               "glide train"]
    ce = axes["cross-entropy (draft: solid / dashed eval; target: dotted)"]
    assert [line.get_label() for line in ce.get_lines()][:4] == [
        "dflash draft train", "dflash draft eval", "dflash target train", "dflash target eval"]
    assert list(ce.get_lines()[2].get_ydata()) == [5.5, 5.5]
    kl = axes["KL(target || draft), train"]
    assert [list(line.get_ydata()) for line in kl.get_lines()] == [[0.9, 0.45], [0.4, 0.2]]


def _plain_and_dspark(tmp_path: Path) -> tuple[Path, Path]:
    """A model's run and a DSpark draft's, as metrics.jsonl records (the draft's with issue 48's keys)."""
    plain = _metrics(tmp_path / "plain", [{"step": s, "loss": 6.0 - s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s,
                                           "tokens_per_s": 100.0} for s in (1, 2)] + [{"step": 2, "eval_loss": 5.0}])
    steps = [{"step": s, "loss": 0.9 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s, "tokens_per_s": 90.0,
              "target_loss": 5.5, "draft_ce": 7.0 - s, "draft_kl": 0.5 / s, "confidence_bce": 0.3 / s,
              "acc_1": 0.4, "acc_2": 0.2, "acc_3": 0.1, "eal": 0.6} for s in (1, 2)]
    evals = [{"step": 2, "eval_loss": 5.1, "eval_target_loss": 5.5, "eval_acc_1": 0.5, "eval_acc_2": 0.25,
              "eval_acc_3": 0.125, "eval_eal": 0.7}]
    accept = [{"step": 2, "tau_sim": 1.9, "accept_1": 0.5, "accept_2": 0.5, "accept_3": 0.25,
               "acceptance_rounds": 12}]
    return plain, _metrics(tmp_path / "dspark", steps + evals + accept)


def test_report_headlines_a_drafts_acceptance_and_agreement_and_keeps_its_objective_apart(tmp_path):
    """Issue 48: a draft's objective was drawn on the axis of a model's cross-entropy, its acceptance without the
    rounds behind each point, and its top-1 agreement per slot nowhere."""
    from treadle.metrics.report import build_figure, read_run

    plain, dspark = _plain_and_dspark(tmp_path)
    fig = build_figure([read_run(plain, "plain"), read_run(dspark, "dspark")])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    titles = list(axes)
    # The headline first: tau_sim, acceptance per position, top-1 agreement per slot.
    assert titles[:3] == ["tau_sim (simulated tokens per verification)",
                          "acceptance per position (n: rounds reaching it)",
                          "top-1 agreement per slot (eval: solid; train: dashed)"]
    accept_ax = axes[titles[1]]
    assert [t.get_text() for t in accept_ax.texts] == ["n=12", "n=6", "n=3"]
    assert [tuple(t.xy) for t in accept_ax.texts] == [(1, 0.5), (2, 0.5), (3, 0.25)]
    agreement = axes[titles[2]]
    assert [line.get_label() for line in agreement.get_lines()] == ["dspark eval at step 2", "dspark train at step 2"]
    assert [list(line.get_ydata()) for line in agreement.get_lines()] == [[0.5, 0.25, 0.125], [0.4, 0.2, 0.1]]
    # A model's loss and a draft's objective never share an axis; each term of the objective has its own.
    assert [line.get_label() for line in axes["loss vs step"].get_lines()] == ["plain train", "plain eval"]
    assert [line.get_label() for line in axes["draft objective (train loss)"].get_lines()] == ["dspark train"]
    assert list(axes["confidence_bce (objective term, train)"].get_lines()[0].get_ydata()) == [0.3, 0.15]
    assert "perplexity" not in " ".join(titles)


def test_report_panels_and_titles_do_not_overlap(tmp_path):
    """Issue 48: the figure's title overlapped a panel's title (tight_layout, four rows of panels)."""
    from treadle.metrics.report import build_figure, read_run

    fig = build_figure([read_run(p, p.name) for p in _plain_and_dspark(tmp_path)])
    assert len(fig.axes) > 9  # four rows of panels: where tight_layout put the title over a panel
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    suptitle = fig.get_suptitle() and fig._suptitle.get_window_extent(renderer)
    boxes = [(ax.get_title(), ax.get_tightbbox(renderer), ax.title.get_window_extent(renderer)) for ax in fig.axes]
    assert suptitle and not [name for name, box, _ in boxes if box.overlaps(suptitle)]
    assert not [(a, b) for a, _, title in boxes for b, box, _ in boxes if a != b and title.overlaps(box)]


def test_report_html_links_the_png_from_its_own_directory(tmp_path, capsys):
    """Issue 48: --out a/r.png --html b/r.html wrote <img src='r.png'>, which resolves to b/r.png."""
    import urllib.parse

    from treadle.metrics.report import write_report

    plain, dspark = _plain_and_dspark(tmp_path)
    out, page = tmp_path / "a" / "r.png", tmp_path / "b c" / "r.html"  # directories not there yet: made
    write_report([plain, dspark], out, page)
    src = page.read_text().split("<img src='", 1)[1].split("'", 1)[0]
    assert (page.parent / urllib.parse.unquote(src)).resolve() == out.resolve() and out.is_file()
    (tmp_path / "file").write_text("x")  # a directory that cannot be made: one line, nothing written
    assert main(["report", str(plain), "--out", str(tmp_path / "file" / "r.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its directory cannot be made" in err and (tmp_path / "file").read_text() == "x"


def test_draft_flops_formula_within_10_percent_of_flop_counter():
    """A GLIDE draft step: the draft trained, the shared head scored through, the frozen target's forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM, LlamaConfig

    from treadle.drafts.glide.model import GlideDraft, GlideModel
    from treadle.train.run import model_flops_per_token

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, use_cache=False, attn_implementation="eager")
    model = GlideModel(AutoModelForCausalLM.from_config(config), GlideDraft(config))
    batch, seq = 2, 128
    ids = torch.randint(0, 8192, (batch, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # the draft's sdpa as bmm
        out = model(ids, torch.arange(seq).expand(batch, seq), lag=1)
        torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten()).backward()
    formula = model_flops_per_token(model, seq, draft=True) * batch * seq
    assert abs(formula / counter.get_total_flops() - 1) < 0.02  # 0.5% here


def test_wandb_continues_its_run_on_a_resume_and_starts_a_new_one_on_a_fresh_start(tmp_path):
    from treadle.metrics.wandb_sink import WandbSink

    def session(resumed, steps):
        sink = WandbSink(tmp_path, {}, "p", "n", None, [], "offline", resumed=resumed)
        for step in steps:
            sink.write({"step": step, "loss": float(step)})
        sink.close()
        time.sleep(1.05)  # W&B names an offline run's directory by the second: two sessions in one second share it
        return sink.run_id

    first = session(False, [1, 2, 3])
    assert session(True, [2, 3, 4]) == first  # resumed from step 1: 2 and 3 were sent already
    fresh = session(False, [1])  # checkpoint.resume = none: the metrics start over, so does the W&B run
    assert fresh != first
    assert [r["_step"] for r in wandb_history(tmp_path, first)] == [1, 2, 3, 4]
    assert [r["_step"] for r in wandb_history(tmp_path, fresh)] == [1]


def test_on_a_terminal_the_bar_says_when_an_eval_runs():
    """On a TTY an eval's start is no log line (the bar is the progress) but the bar's label: before, the bar
    stood still for the whole eval with nothing said. The next step puts the label back."""
    import io

    from rich.console import Console as RichConsole

    from treadle.metrics.sinks import Console

    console = Console(total_steps=10, live=True)
    console.console = RichConsole(file=io.StringIO(), force_terminal=True, width=120)
    console.start(0)
    console.step(1, {"loss": 2.0})
    console.status("eval 1: validation loss on 2 batches ...")
    shown = console.console.file.getvalue()
    console.step(2, {"loss": 1.9})
    console._progress.refresh()
    after = console.console.file.getvalue()[len(shown):]
    console.stop()
    assert "eval 1: validation loss" in shown
    assert "eval 1" not in after and "train" in after
