"""``treadle report RUN [RUN ...] --out report.png``: a run's curves from its metrics.jsonl, several runs overlaid.

Panels (each only where some run has the data): a draft's headline first, what its users read: tau_sim, the
chain's acceptance per position (each point annotated with the rounds behind it; as many positions as the run with
most has) and the draft's top-1 agreement with the target per slot (``eval_acc_k`` of the last eval, ``acc_k`` of
the last step). Then train and eval loss against steps and against tokens (models, not drafts), lr, grad norm,
tokens/s, per-source losses (``loss/<name>``) and tflops_per_s (with mfu on a right axis where a run has it: a CPU has
no peak figure). A draft run's loss is its objective (a KL, a CE or a mix, plus a kind's own terms) and its eval
loss the draft's CE: the objective gets a panel of its own, its cross-entropies (the draft's, train and eval, and the
target's, the floor) another, its KL another, and each further term of the objective (``confidence_bce``,
``selector_ce``, ``lattice_penalty`` ...) its own, so that no axis holds a KL beside a CE, or a draft's objective
beside a model's cross-entropy. Skipped (non-finite) steps are marked with an x on the loss panels, rollbacks with a
dotted vertical line. matplotlib is an optional extra (``pip install treadle[report]``), imported only here.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from treadle.metrics.agreement import per_slot, reached
from treadle.errors import UserError
from treadle.fsutil import claim_output

SOFTWARE = "treadle report"  # written into the PNG's metadata: an earlier report is recognized and may be replaced
# A draft objective's further terms: logged as <name>_ce / _bce / _penalty, per label token (drafts/*/objective.py)
TERM_ENDINGS = ("_ce", "_bce", "_penalty")


@dataclass
class Run:
    label: str
    steps: dict[int, dict] = field(default_factory=dict)  # step -> its step record (the last one: a rollback replays)
    evals: dict[int, dict] = field(default_factory=dict)
    acceptance: dict[int, dict] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)

    @property
    def is_draft(self) -> bool:
        """A draft run (its steps report the frozen target's own CE beside the draft's objective, its evals
        tau_sim); not a model run with a draft beside it (its steps carry ``draft_loss``: its loss is the model's)."""
        if any("draft_loss" in rec for rec in self.steps.values()):
            return False
        return bool(self.acceptance) or any("target_loss" in rec for rec in self.steps.values())

    def last(self, records: str) -> dict:
        rows = getattr(self, records)
        return rows[max(rows)] if rows else {}

    def positions(self) -> int:
        """Draft positions of the last acceptance record (accept_1 .. accept_K)."""
        return len(per_slot(self.last("acceptance"), "accept"))

    def slots(self) -> int:
        """Slots with a top-1 agreement (eval_acc_k of the last eval, acc_k of the last step)."""
        return max(len(per_slot(self.last("evals"), "eval_acc")), len(per_slot(self.last("steps"), "acc")))

    def terms(self) -> list[str]:
        """A draft objective's own terms beside its CE and KL (DSpark's confidence_bce, DFlash2's selector_ce ...)."""
        if not self.is_draft:
            return []
        return sorted({k for rec in self.steps.values() for k in rec if k.endswith(TERM_ENDINGS) and k != "draft_ce"})

    def series(self, key: str, records: str = "steps") -> tuple[list[int], list[float]]:
        rows = getattr(self, records)
        xs = [s for s in sorted(rows) if rows[s].get(key) is not None]
        return xs, [rows[s][key] for s in xs]

    def tokens_at(self, steps: list[int]) -> list[float]:
        """Tokens seen by each step (an eval's step included: tokens grow linearly between step records)."""
        known = {s: r["tokens"] for s, r in self.steps.items() if "tokens" in r}
        per_step = max((t / s for s, t in known.items() if s), default=0.0)
        return [known.get(s, s * per_step) for s in steps]


def read_run(path: Path, label: str) -> Run:
    metrics = Path(path) / "metrics.jsonl" if Path(path).is_dir() else Path(path)
    if not metrics.is_file():
        raise UserError(f"report: {path} holds no metrics.jsonl; accepted: a treadle run directory or a metrics.jsonl")
    run = Run(label)
    for n, line in enumerate(metrics.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if not isinstance(record, dict) or "step" not in record:
            raise UserError(f"report: {metrics} line {n} is not a treadle metrics record; accepted: metrics.jsonl "
                            "as treadle train writes it")
        step, event = record["step"], record.get("event")
        if event == "nonfinite_step_skipped":
            run.skipped.append(step)
        elif event == "rollback":
            run.rollbacks.append(step)
        elif "tau_sim" in record:
            run.acceptance[step] = record
        elif "eval_loss" in record:
            run.evals[step] = record
        elif "loss" in record:
            run.steps[step] = record
    return run


def _labels(paths: list[Path]) -> list[str]:
    names = [Path(p).resolve().name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def build_figure(runs: list[Run]):
    """The report as a matplotlib Figure (one axes per panel that some run has data for)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    panels = []
    if any(r.acceptance for r in runs):  # a draft's headline: what its users read
        panels += [("tau_sim", "tau_sim (simulated tokens per verification)"),
                   ("accept", "acceptance per position (n: rounds reaching it)")]
    if any(r.slots() for r in runs):
        panels.append(("agreement", "top-1 agreement per slot (eval: solid; train: dashed)"))
    if any(not r.is_draft for r in runs):
        panels += [("loss", "loss vs step"), ("loss_tokens", "loss vs tokens")]
    if any(r.is_draft for r in runs):  # a draft's objective is no model's loss: on an axis of its own
        panels.append(("objective", "draft objective (train loss)"))
    panels += [("lr", "learning rate"), ("grad_norm", "grad norm (before clipping)"), ("tokens_per_s", "tokens/s")]
    sources = sorted({k for r in runs for rec in r.steps.values() for k in rec if k.startswith("loss/")})
    if sources:
        panels.append(("sources", "loss per source"))
    if any(r.is_draft and r.series(key)[0] for r in runs for key in ("draft_ce", "target_loss")):
        panels.append(("ce", "cross-entropy (draft: solid / dashed eval; target: dotted)"))
    if any(r.is_draft and r.series("draft_kl")[0] for r in runs):
        panels.append(("kl", "KL(target || draft), train"))
    panels += [(f"term:{t}", f"{t} (objective term, train)") for t in sorted({t for r in runs for t in r.terms()})]
    if any("tflops_per_s" in rec for r in runs for rec in r.steps.values()):
        mfu = any("mfu" in rec for r in runs for rec in r.steps.values())  # only where a peak figure is known
        panels.append(("tflops_per_s", "TFLOP/s per device" + (" (mfu: right axis)" if mfu else "")))
    cols = 3
    rows = -(-len(panels) // cols)
    # constrained layout places the figure's title above the panels' (tight_layout let it overlap a panel's title)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, title) in zip(axes.flat, panels):
        ax.set_title(title)
        ax.set_xlabel("tokens" if name == "loss_tokens" else "step")
        ax.grid(alpha=0.3)
        for i, run in enumerate(runs):
            _plot(ax, name, run, colors[i % len(colors)], sources)
        if name in ("accept", "agreement"):  # the axis of the run with most positions (DFlash: block_size - 1)
            positions = max((r.positions() if name == "accept" else r.slots()) for r in runs)
            ax.set_xticks(range(1, positions + 1))
            ax.set_xlim(0.5, positions + 0.5)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.remove()
    fig.suptitle(" vs ".join(r.label for r in runs))
    return fig


def _plot(ax, name: str, run: Run, color: str, sources: list[str]) -> None:
    label = run.label
    if name in ("loss", "loss_tokens", "objective"):
        if (name == "objective") != run.is_draft:  # a model's loss and a draft's objective never share an axis
            return
        xs, ys = run.series("loss")
        ex, ey = run.series("eval_loss", "evals")
        if name == "loss_tokens":
            xs, ex = run.tokens_at(xs), run.tokens_at(ex)
        ax.plot(xs, ys, color=color, lw=1, label=f"{label} train")
        if not run.is_draft:  # a draft's eval loss is its CE, not its objective: on the cross-entropy panel
            ax.plot(ex, ey, color=color, ls="--", marker="o", ms=3, label=f"{label} eval")
        if name != "loss_tokens":
            marks = [s for s in run.skipped if s in run.steps]
            if marks:
                ax.plot(marks, [run.steps[s]["loss"] for s in marks], "x", color="red", ms=8, label=f"{label} skipped step")
            for s in run.rollbacks:
                ax.axvline(s, color=color, ls=":", lw=1)
    elif name == "sources":
        for j, key in enumerate(sources):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, color=color, lw=1, ls=("-", "--", ":", "-.")[j % 4], label=f"{label} {key[5:]}")
    elif name == "ce":
        for key, records, style, what in (("draft_ce", "steps", {"lw": 1}, "draft train"),
                                          ("eval_loss", "evals", {"ls": "--", "marker": "o", "ms": 3}, "draft eval"),
                                          ("target_loss", "steps", {"ls": ":", "lw": 1}, "target train"),
                                          ("eval_target_loss", "evals", {"ls": ":", "marker": "s", "ms": 3},
                                           "target eval")):
            xs, ys = run.series(key, records)
            if xs and run.is_draft:
                ax.plot(xs, ys, color=color, label=f"{label} {what}", **style)
    elif name == "kl":
        xs, ys = run.series("draft_kl")
        if xs:
            ax.plot(xs, ys, color=color, lw=1, label=label)
    elif name == "tau_sim":
        xs, ys = run.series("tau_sim", "acceptance")
        if xs:
            ax.plot(xs, ys, color=color, marker="o", ms=3, label=label)
    elif name == "accept":
        last = run.last("acceptance")
        rates = per_slot(last, "accept")
        if rates:
            ax.set_xlabel("draft position")
            ax.set_ylim(0, 1.12)  # room above 1 for the counts
            positions = range(1, len(rates) + 1)
            ax.plot(positions, rates, color=color, marker="o", ms=3, label=f"{label} at step {last['step']}")
            for k, rate, n in zip(positions, rates, reached(last)):
                ax.annotate(f"n={n}", (k, rate), textcoords="offset points", xytext=(0, 4), ha="center",
                            fontsize=7, color=color)
    elif name == "agreement":
        ax.set_xlabel("draft slot")
        ax.set_ylim(0, 1.02)
        for key, records, style, what in (("eval_acc", "evals", {"marker": "o"}, "eval"),
                                          ("acc", "steps", {"ls": "--", "marker": "x"}, "train")):
            last = run.last(records)
            rates = per_slot(last, key)
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, color=color, ms=3, label=f"{label} {what} at step "
                        f"{last['step']}", **style)
    elif name.startswith("term:"):
        xs, ys = run.series(name[5:])
        if xs:
            ax.plot(xs, ys, color=color, lw=1, label=label)
    elif name == "tflops_per_s":
        xs, ys = run.series("tflops_per_s")
        if xs:
            ax.plot(xs, ys, color=color, lw=1, label=label)
        mx, my = run.series("mfu")
        if mx:
            twin = ax.twinx()
            twin.plot(mx, my, color=color, lw=1, ls=":")
            twin.set_ylabel("mfu")
    else:
        xs, ys = run.series(name)
        if xs:
            ax.plot(xs, ys, color=color, lw=1, label=label)
        if name == "grad_norm" and ys and min(ys) > 0:
            ax.set_yscale("log")


def is_report_png(path: Path) -> bool:
    """A PNG an earlier ``treadle report`` wrote (its tEXt Software field)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and SOFTWARE.encode() in head


def write_report(paths: list[Path], out: Path, html_out: Path | None = None) -> None:
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out}: accepted: a .png file name")
    claim_output(out, "--out", "report", ours=is_report_png, file=True)
    if html_out is not None:
        claim_output(html_out, "--html", "report", ours=lambda p: SOFTWARE in p.read_text(errors="replace")[:2000],
                     file=True)
    runs = [read_run(p, label) for p, label in zip(paths, _labels(paths))]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("treadle report draws with matplotlib, which is not installed; accepted: "
                        "pip install 'treadle[report]'") from None
    fig = build_figure(runs)
    for flag, path in (("--out", out), ("--html", html_out)):  # a directory named for the files is made, as train's
        if path is not None:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"{flag} {path}: its directory cannot be made ({e.strerror}); accepted: a path whose "
                                "directory exists or can be created") from None
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=100, metadata={"Software": SOFTWARE})
    os.replace(tmp, out)
    if html_out is not None:
        Path(html_out).write_text(_html(runs, _image_src(out, Path(html_out))))


def _image_src(png: Path, page: Path) -> str:
    """The PNG as the page's <img src>: a URL relative to the page's directory (--out and --html may name different
    directories; a bare file name pointed beside the page)."""
    relative = os.path.relpath(png.resolve(), page.resolve().parent)
    return urllib.parse.quote(Path(relative).as_posix())


def _html(runs: list[Run], src: str) -> str:
    """A page with the PNG and each run's last step and eval record."""
    rows = []
    for run in runs:
        for kind, records in (("step", run.steps), ("eval", run.evals), ("acceptance", run.acceptance)):
            if records:
                last = records[max(records)]
                cells = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in last.items())
                rows.append(f"<tr><td>{html.escape(run.label)}</td><td>{kind}</td><td>{html.escape(cells)}</td></tr>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><meta name='generator' content='{SOFTWARE}'>"
            f"<title>{SOFTWARE}</title></head><body><img src='{html.escape(src)}' style='max-width:100%'>"
            f"<table border='1'><tr><th>run</th><th>last</th><th>values</th></tr>{''.join(rows)}</table></body></html>\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files), overlaid")
    parser.add_argument("--out", default="report.png", help="PNG to write (default: report.png)")
    parser.add_argument("--html", default=None, help="also an HTML page showing the PNG (linked by its path "
                        "relative to the page) and each run's last values")


def run(args: argparse.Namespace) -> int:
    write_report([Path(p) for p in args.runs], Path(args.out), Path(args.html) if args.html else None)
    print(f"report of {len(args.runs)} run(s) -> {args.out}" + (f" and {args.html}" if args.html else ""))
    return 0
