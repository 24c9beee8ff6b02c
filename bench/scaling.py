"""Data-parallel engines at world size 1 and 2 on CPU: total tokens/s and what each rank holds.

Every engine (local, ddp, fsdp2, deepspeed ZeRO-1/2/3) trains the tiny Llama from
configs/demo.toml with the same GLOBAL batch (8 x 256 tokens: micro-batch 4, grad
accumulation 2 at world size 1 and 1 at world size 2) on the machine's 2 cores
(2 torch threads at world size 1, 1 per rank at world size 2). Each (engine, world
size) is its own launch: this script re-invokes itself under torchrun (a 1-rank
process group at world size 1, so ddp/fsdp2/deepspeed run there too); `local`, the
baseline, runs in a plain subprocess.

Throughput: `Trainer.fit()` first runs the warm-up steps, then once per timed step
(max_steps + 1 each time), timed between barriers; tokens/s = global tokens per step /
the median step time (rank 0), so that a burst of another job on the two cores moves
it less than a mean would. Only the metrics callback is kept: no eval, checkpoint or
export runs inside the timing.
Memory: `engine.memory_report()` is taken inside `clip_grad_norm` of the last warm-up
step: every backward of the step has run and the optimizer state exists since the
first step; `optimizer_step` frees the gradients right after (`zero_grad`), so no
callback could see them. It is a snapshot, not a peak: by then FSDP2 and ZeRO-1/2/3
have reduced the gradients into this rank's partition (ZeRO-1's full gradients during
the last backward are gone) and FSDP2 has resharded its root, which stays gathered
from forward to the end of backward. DDP's gradient buckets, which memory_report does
not see, are printed below the table. Per-rank figures are the largest over the
ranks; peak RSS is `ru_maxrss` at the end of the launch (imports included).

    python bench/scaling.py [--steps 8] [--warmup 3] [--engines local,ddp,fsdp2,zero1,zero2,zero3] [--json out.json]

Parallel layouts (``--layouts``, issue 30): one model (``--preset``, default ``medium``) under each layout of
LAYOUTS at world size 2 or 4 on gloo, the same micro-batch per rank everywhere (1 x 256 tokens, grad accumulation
2, fp32, one thread per rank), a few steps each. Per layout: the step losses (sanity: every row starts from the
same seeded weights), ``memory_report()`` on the last step (params / grads / optimizer state this rank holds), peak
RSS per rank over the training steps (the kernel's VmHWM, reset after the engine is built, so the whole-model
build every rank does first is not what is measured) and over the whole launch, and the collective volume per
step per rank, both computed from the model's shapes (``comm_volume``) and measured on the last step (every
collective op torch dispatches, counted by a dispatch mode). A layout the code refuses is a row "refused: <its
one-line error>", not a crash.

    python bench/scaling.py --layouts [all|name,name] [--preset medium] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("local", "ddp", "fsdp2", "zero1", "zero2", "zero3")
MIB = 2**20


def worker(args) -> None:
    """One rank of one launch: train, measure, write <results>/<engine>-ws<N>-rank<R>.json."""
    from treadle import distributed
    from treadle.config import load_config
    from treadle.errors import first_line
    from treadle.train.callbacks import MetricsCallback
    from treadle.train.run import build_trainer

    signal.alarm(args.timeout)  # a hung launch (a peer stuck in a collective) ends itself; SIGALRM kills
    rank, ws = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(args.worker)
    out = {"engine": args.worker, "ws": ws, "rank": rank}
    try:
        cfg = load_config(REPO / "configs/demo.toml", [
            f"--train.output_dir={Path(args.results) / f'{args.worker}-ws{ws}-run'}",  # one run dir for all ranks
            "--train.device=cpu", "--model.preset=tiny", "--data.seq_len=256", "--train.micro_batch_size=4",
            f"--train.grad_accum_steps={2 // ws}", f"--train.threads={2 // ws}",  # same global batch, same 2 cores
            f"--train.max_steps={args.warmup + args.steps}", f"--train.log_every={10**6}", "--schedule.warmup_proportion=0",
            "--data.val=[]", "--checkpoint.export_hf=false", "--checkpoint.resume=none",
            f"--distributed.engine={'deepspeed' if stage else args.worker}", f"--distributed.zero_stage={stage or 0}",
            "--distributed.health_check_every=0", "--distributed.timeout_s=120",  # a dead peer fails, not hangs
        ])
        trainer = build_trainer(cfg, live=False)
        trainer.console.enabled = False
        trainer.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, MetricsCallback)]
        engine, report = trainer.engine, {}
        clip = engine.clip_grad_norm

        def clip_and_measure(max_norm):
            if trainer.state.step == args.warmup - 1:  # the last warm-up step (state.step counts finished ones)
                report.update(engine.memory_report())
            return clip(max_norm)

        engine.clip_grad_norm = clip_and_measure
        barrier = distributed.barrier  # a no-op without a process group (local)
        trainer.max_steps = args.warmup
        trainer.fit()
        walls = []
        for _ in range(args.steps):  # one step per fit(), between barriers: the slowest rank's time of each step
            barrier()
            t0 = time.perf_counter()
            trainer.max_steps += 1
            trainer.fit()
            barrier()
            walls.append(time.perf_counter() - t0)
        out.update(tokens_per_s=trainer.tokens_per_step / statistics.median(walls),
                   step_tokens_per_s=[trainer.tokens_per_step / w for w in walls],
                   threads=torch.get_num_threads(), memory=report,
                   peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if args.worker == "ddp":  # DDP's reducer buckets: a second copy of the gradients memory_report cannot see
            sizes = engine.model._get_ddp_logging_data()["bucket_sizes"]  # "b1, b2, ..." in bytes
            out["ddp_buckets"] = sum(int(b) for b in sizes.split(",") if b.strip())
        trainer.metrics.close()
        distributed.destroy()
    except Exception as exc:  # reported as one line in the table; the other engines go on
        out["error"] = f"{type(exc).__name__}: {first_line(exc)}"
    (Path(args.results) / f"{args.worker}-ws{ws}-rank{rank}.json").write_text(json.dumps(out))
    if "error" in out:
        sys.exit(1)


def launch(engine: str, ws: int, args, results: Path) -> dict:
    """Run one (engine, world size); return its row, or {"error": first line}."""
    flags = [str(Path(__file__).resolve()), "--worker", engine, "--results", str(results),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(args.timeout)]
    cmd = [sys.executable] + ([] if engine == "local" else
                              ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}"]) + flags
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:  # each worker ends itself at --timeout (SIGALRM): torchrun runs them in sessions of their own
        log, _ = proc.communicate(timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:  # torchrun itself hangs
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    timed_out = time.perf_counter() - t0 >= args.timeout
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob(f"{engine}-ws{ws}-rank*.json"))]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors or proc.returncode or len(ranks) != ws:
        if timed_out:  # whatever the ranks wrote is the alarm's consequence (a peer gone), not the cause
            errors = [f"timed out after {args.timeout}s"]
        elif not errors:  # died before it could write: the first exception line of its output (not torchrun's)
            lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
            errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)
                      and "ChildFailedError" not in ln][:1] or lines[-1:] or ["?"]
        return {"error": errors[0][:160]}
    mem = {k: max(r["memory"].get(k, 0) for r in ranks) for k in ("params", "grads", "optim")}
    mem["state"] = max(sum(r["memory"].get(k, 0) for k in ("params", "grads", "optim")) for r in ranks)
    keep = ("tokens_per_s", "step_tokens_per_s", "threads", "ddp_buckets")  # rank 0's: the same on every rank
    return {**{k: v for k, v in ranks[0].items() if k in keep}, "memory": mem,
            "peak_rss": max(r["peak_rss"] for r in ranks)}


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


# ---------------------------------------------------------------------------------------------- parallel layouts


@dataclass(frozen=True)
class ParallelLayout:
    """One row of ``--layouts``: the mesh's axis sizes and the ``[distributed]`` flags that launch it."""

    title: str
    flags: tuple[str, ...]
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp


def _axes(pp=1, replicate=1, shard=1, tp=1, engine="fsdp2") -> tuple[str, ...]:
    return (f"--distributed.engine={engine}", f"--distributed.pipeline_parallel={pp}",
            f"--distributed.data_parallel_replicate={replicate}", f"--distributed.data_parallel_shard={shard}",
            f"--distributed.tensor_parallel={tp}")


LAYOUTS = {  # each TP / PP row beside the plain FSDP2 row of its world size (TP 1, the baseline)
    "fsdp2-ws2": ParallelLayout("FSDP 2 (TP 1)", _axes(shard=2), dp_shard=2),
    "tp2": ParallelLayout("TP 2", _axes(tp=2), tp=2),
    "fsdp2-ws4": ParallelLayout("FSDP 4 (TP 1)", _axes(shard=4), dp_shard=4),
    "fsdp2xtp2": ParallelLayout("FSDP 2 x TP 2", _axes(shard=2, tp=2), dp_shard=2, tp=2),
    "hsdp2x2": ParallelLayout("HSDP 2 x 2 (replicate x shard)", _axes(replicate=2, shard=2), dp_replicate=2, dp_shard=2),
    # FSDP2 inside each pipeline stage: asked for as the fsdp2 engine with pipeline stages (refused where not built).
    "pp2xfsdp2": ParallelLayout("PP 2 x FSDP 2", _axes(pp=2, shard=2), pp=2, dp_shard=2),
    # Today's pipeline engine beside it: two pipelines whose stage gradients are all-reduced (DDP-like replicas).
    "pp2xdp2": ParallelLayout("PP 2 x DP 2 (stages replicated)", _axes(pp=2, shard=-1, engine="auto"),
                              pp=2, dp_replicate=2),
}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")


def comm_volume(model: dict, layout: ParallelLayout, *, seq_len: int, micro_batch: int, grad_accum: int,
                reshard_after_forward: bool = True, itemsize: int = 4) -> dict[str, float]:
    """Bytes each rank moves per optimizer step, by collective, from a Llama-shaped ``model`` config (a dict).

    A collective's size is its whole tensor: an all-gather's output, a reduce-scatter's input, an all-reduce's
    tensor, a point-to-point message; ``sent`` is what one rank puts on the wire for them under ring algorithms
    (all-gather and reduce-scatter (n-1)/n of the size, all-reduce 2(n-1)/n, a send all of it). Per rank means the
    busiest rank (a pipeline's end stage with the embedding or the head). Scalars (token count, grad norm, the
    finite check) are left out, and so is FSDP2's padding of each shard to equal sizes.

    * FSDP2 (``dp_shard`` > 1; units: each decoder layer, then the root = embedding + final norm + head): every
      micro-batch all-gathers every unit in forward and, with ``reshard_after_forward``, again in backward, the
      root included (treadle passes the flag explicitly, and torch 2.13 then applies it to the root too; only
      torch's default, None, keeps the root gathered from forward to backward); the last micro-batch
      reduce-scatters the gradients once (the others accumulate unsharded, ``no_sync``). Under TP it gathers the
      TP-local tensors.
    * HSDP (``dp_replicate`` > 1): each rank's gradient shard all-reduced across the replicas once a step; a
      pipeline's replicas all-reduce their stage's gradients the same way.
    * TP with sequence parallel: per layer per micro-batch, the [B, T, H] activations are all-gathered into
      attention and the MLP and reduce-scattered out of them (2 + 2) in forward, and backward does the converse
      (2 + 2); the embedding's output is reduce-scattered (all-gathered in backward), the head's input
      all-gathered (reduce-scattered in backward). The norms' replicated weights have their gradients (partial
      sums over each rank's tokens) all-reduced over TP once a step, when FSDP2 reduces the accumulated
      gradients; the vocabulary-parallel loss all-reduces three [B, T] vectors (max, sum of exp, the target's
      logit) every micro-batch.
    * PP: every micro-batch sends the stage boundary's [B, T, H] activations forward and their gradient back: an
      end stage sends one of each per micro-batch, a middle stage two.
    """
    h, f, n_layers, vocab = (model[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                "vocab_size"))
    heads, kv = model["num_attention_heads"], model.get("num_key_value_heads") or model["num_attention_heads"]
    d = model.get("head_dim") or h // heads
    tied = bool(model.get("tie_word_embeddings"))
    pp, rep, shard, tp = layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp
    # Parameters this rank holds before FSDP shards them (the TP-local shares): matmul weights split over tp,
    # the two norms replicated.
    layer = (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * f) / tp + 2 * h
    embed = vocab * h / tp
    head_and_norm = (0 if tied and pp == 1 else vocab * h / tp) + h
    # A pipeline's busiest rank: its first stage (the embedding) or its last (the head, which a tied model holds
    # on both ends); without stages one rank holds both.
    root = embed + head_and_norm if pp == 1 else max(embed, head_and_norm)
    layers = n_layers / pp
    params = layers * layer + root
    act = micro_batch * seq_len * h  # one [B, T, H] activation
    size = dict.fromkeys(COLLECTIVES, 0.0)
    sent = 0.0
    if shard > 1:
        gathered = grad_accum * (layers * layer + root) * (2 if reshard_after_forward else 1)
        size["all_gather"] += gathered
        size["reduce_scatter"] += params
        sent += (gathered + params) * (shard - 1) / shard
    if rep > 1:
        size["all_reduce"] += params / shard
        sent += 2 * (params / shard) * (rep - 1) / rep
    if tp > 1:
        ends = 1 if pp > 1 else 2  # the embedding's and the head's exchanges: a pipeline's end stage has one
        moves = grad_accum * (4 * layers + ends) * act
        reduced = (2 * layers + 1) * h + grad_accum * 3 * micro_batch * seq_len
        size["all_gather"] += moves
        size["reduce_scatter"] += moves
        size["all_reduce"] += reduced
        sent += 2 * moves * (tp - 1) / tp + 2 * reduced * (tp - 1) / tp
    if pp > 1:
        size["send_recv"] += grad_accum * act * (1 if pp == 2 else 2)
        sent += size["send_recv"]
    return {k: v * itemsize for k, v in size.items()} | {"sent": sent * itemsize}


class CommCounter:
    """Every collective torch dispatches while active, as bytes by kind (``comm_volume``'s sizes: an all-gather's
    output, a reduce-scatter's input, an all-reduce's tensor), over groups of more than one rank.

    torch's ``CommDebugMode`` counts the same ops (FSDP2's c10d calls and DTensor's functional collectives) but
    not their bytes; this reuses its op sets and adds the sizes. Like it, it sees a collective issued from Python
    (FSDP2's hooks, DTensor's redistributes between modules), not one a DTensor op handler issues while it is
    itself being dispatched (a dispatch mode is switched off inside its own handler): loss_parallel's three
    all-reduces per micro-batch are such ones."""

    def __init__(self):
        from torch.distributed.tensor.debug import _comm_mode as cm
        from torch.utils._python_dispatch import TorchDispatchMode

        c10d, funcol = cm.c10d_ops, cm.funcol_native
        kinds = {c10d._allgather_base_: "all_gather", c10d.allgather_into_tensor_coalesced_: "all_gather",
                 c10d._reduce_scatter_base_: "reduce_scatter", c10d.reduce_scatter_tensor_coalesced_: "reduce_scatter",
                 c10d.allreduce_: "all_reduce", c10d.allreduce_coalesced_: "all_reduce",
                 c10d.alltoall_base_: "all_to_all", c10d.send: "send_recv",
                 funcol.all_gather_into_tensor: "all_gather", funcol.all_gather_into_tensor_coalesced: "all_gather",
                 funcol.reduce_scatter_tensor: "reduce_scatter",
                 funcol.reduce_scatter_tensor_coalesced: "reduce_scatter",
                 funcol.all_reduce: "all_reduce", funcol.all_reduce_coalesced: "all_reduce",
                 funcol.all_to_all_single: "all_to_all"}
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self.unknown: set[str] = set()  # collectives dispatched that the table above does not size
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                packet = func._overloadpacket
                if packet in kinds:
                    counter._record(kinds[packet], packet, args)
                elif packet in cm.c10d_collective_ops or packet in cm.NATIVE_TO_PY_MAPPING:
                    counter.unknown.add(str(packet))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _record(self, kind: str, packet, args) -> None:
        import torch.distributed as dist

        def nbytes(x) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            return sum(nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0

        name = str(packet)
        if name.startswith("_c10d_functional"):  # (input(s), ..., group_size?, group_name): the group by name
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            n = nbytes(args[0]) * (group.size() if kind == "all_gather" else 1)  # a gather's output
        else:  # c10d.<op>(output(s), input(s), process_group, ...) or (tensors, process_group, ...)
            # The group arrives boxed (a ScriptObject, the first one among the arguments; a ReduceOp may follow).
            group = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
            n = nbytes(args[0]) if kind in ("all_gather", "all_reduce", "send_recv") else nbytes(args[1])
        if group.size() > 1:  # a one-rank group (FSDP2 over dp_shard = 1 under TP) moves nothing
            self.bytes[kind] += n
            self.calls[kind] += 1

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _hwm() -> int | None:
    """This process's peak RSS since the last reset (VmHWM), in bytes."""
    try:
        return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def layout_worker(args) -> None:
    """One rank of one layout's launch: train ``--steps`` steps, write <results>/<layout>-rank<R>.json."""
    from treadle import distributed
    from treadle.config import load_config
    from treadle.errors import first_line
    from treadle.train.callbacks import Callback
    from treadle.train.run import build_trainer

    signal.alarm(args.timeout)
    name, rank = args.layout_worker, int(os.environ.get("RANK", 0))
    layout = LAYOUTS[name]
    out = {"layout": name, "rank": rank}

    class Probe(Callback):
        """Step losses; the last step's memory report (taken in clip_grad_norm below) and its collectives."""

        def __init__(self):
            self.losses, self.counter = [], None

        def on_step_start(self, trainer):
            if trainer.state.step == args.steps - 1:
                self.counter = CommCounter().__enter__()

        def on_step_end(self, trainer, result):
            self.losses.append(result.loss)
            if self.counter is not None:
                self.counter.__exit__(None, None, None)

    try:
        cfg = load_config(REPO / "configs/demo.toml", [
            f"--train.output_dir={Path(args.results) / f'{name}-run'}",
            "--train.device=cpu", f"--model.preset={args.preset}", "--model.dtype=fp32", "--model.compile=false",
            f"--data.seq_len={LAYOUT_SEQ}", f"--train.micro_batch_size={LAYOUT_MB}",
            f"--train.grad_accum_steps={LAYOUT_GA}", "--train.threads=1",
            f"--train.max_steps={args.steps}", f"--train.log_every={10**6}", "--schedule.warmup_proportion=0",
            "--data.val=[]", "--checkpoint.export_hf=false", "--checkpoint.resume=none",
            "--distributed.health_check_every=0", "--distributed.timeout_s=600", *layout.flags,
        ])
        trainer = build_trainer(cfg, live=False)
        trainer.console.enabled = False
        probe = Probe()
        trainer.callbacks = [probe]  # no metrics, eval, checkpoint or export inside the measurement
        engine, report = trainer.engine, {}
        clip = engine.clip_grad_norm

        def clip_and_measure(max_norm):  # after the last step's backward, before its update frees the gradients
            if trainer.state.step == args.steps - 1:
                report.update(engine.memory_report())
            return clip(max_norm)

        engine.clip_grad_norm = clip_and_measure
        build_peak = _hwm()
        reset = _reset_hwm()
        trainer.fit()
        out.update(losses=probe.losses, memory=report, build_peak_rss=build_peak,
                   train_peak_rss=_hwm() if reset else None,
                   peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   measured=probe.counter.bytes, calls=probe.counter.calls, unknown=sorted(probe.counter.unknown),
                   model={k: v for k, v in trainer.engine.module.config.to_dict().items()
                          if isinstance(v, (int, float, bool)) or v is None})
        distributed.destroy()
    except Exception as exc:  # one line in the table; the other layouts go on
        out["error"] = f"{type(exc).__name__}: {first_line(exc)}"
    (Path(args.results) / f"{name}-rank{rank}.json").write_text(json.dumps(out))
    if "error" in out:
        sys.exit(1)


# The same work per rank in every layout: one micro-batch of LAYOUT_MB x LAYOUT_SEQ tokens, LAYOUT_GA per step
# (a pipeline needs >= 2 micro-batches to overlap its stages; the FSDP rows then show accumulation's re-gathers).
LAYOUT_SEQ, LAYOUT_MB, LAYOUT_GA = 256, 1, 2


def launch_layout(name: str, args, results: Path) -> dict:
    """One layout's torchrun launch: its row (the max over ranks), or {"error": the first line}."""
    ws = LAYOUTS[name].world_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}",
           str(Path(__file__).resolve()), "--layout-worker", name, "--results", str(results), "--preset", args.preset,
           "--steps", str(args.steps), "--timeout", str(args.timeout)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    t0 = time.perf_counter()
    try:
        log, _ = proc.communicate(timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob(f"{name}-rank*.json"))]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors or proc.returncode or len(ranks) != ws:
        if time.perf_counter() - t0 >= args.timeout:
            errors = [f"timed out after {args.timeout}s"]
        elif not errors:
            lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
            errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)
                      and "ChildFailedError" not in ln][:1] or lines[-1:] or ["?"]
            print("\n".join(lines[-15:]), file=sys.stderr)  # no rank said why: the launcher's own words
        # A UserError is the code refusing the layout (its one line), anything else a failure.
        refused = errors[0].startswith("UserError")
        return {"error": errors[0].split(": ", 1)[-1][:400] if refused else errors[0][:400], "refused": refused}
    peak = lambda key: max((r[key] for r in ranks if r.get(key) is not None), default=None)  # noqa: E731
    mem = {k: max(r["memory"].get(k, 0) for r in ranks) for k in ("params", "grads", "optim")}
    mem["state"] = max(sum(r["memory"].get(k, 0) for k in ("params", "grads", "optim")) for r in ranks)
    return {"losses": ranks[0]["losses"], "memory": mem, "peak_rss": peak("peak_rss"),
            "train_peak_rss": peak("train_peak_rss"), "build_peak_rss": peak("build_peak_rss"),
            "measured": {k: max(r["measured"][k] for r in ranks) for k in COLLECTIVES},
            "unknown": sorted({u for r in ranks for u in r["unknown"]}), "model": ranks[0]["model"],
            "seconds": time.perf_counter() - t0}


def run_layouts(args, names: list[str]) -> None:
    rows = {}
    with tempfile.TemporaryDirectory(prefix="treadle-layouts-") as results:
        for name in names:
            rows[name] = launch_layout(name, args, Path(results))
            print(f"  {name}: {rows[name].get('seconds', 0):.0f}s {rows[name].get('error', 'ok')}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "preset": args.preset, "steps": args.steps,
                                               "rows": rows}, indent=1))
    print_layouts(rows, args.preset, args.steps, machine())


def print_layouts(rows: dict, preset: str, steps: int, machine_line: str) -> None:
    """The two markdown tables (memory; collectives) of ``--layouts``, from its rows (also as ``--json`` wrote
    them: ``--render out.json`` prints them again, e.g. after a change to ``comm_volume``)."""
    model = next((r["model"] for r in rows.values() if "model" in r), None)
    mib = lambda b: "" if b is None else f"{b / MIB:,.0f}"  # noqa: E731
    print(f"# layouts: preset {preset}, fp32, micro-batch {LAYOUT_MB} x {LAYOUT_SEQ} tokens per rank, "
          f"grad accumulation {LAYOUT_GA}, {steps} steps, 1 thread per rank, gloo; {machine_line}")
    print("\n| layout | ranks | losses (steps 1..) | params / grads / optim MiB per rank | state MiB per rank | "
          "peak RSS MiB per rank, training steps | peak RSS MiB per rank, whole launch |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        lay = LAYOUTS[name]
        if "error" in row:
            word = "refused" if row["refused"] else "FAILED"
            print(f"| {lay.title} | {lay.world_size} | {word}: {row['error']} | | | | |")
            continue
        m = row["memory"]
        print(f"| {lay.title} | {lay.world_size} | {', '.join(f'{x:.4f}' for x in row['losses'])} | "
              f"{mib(m['params'])} / {mib(m['grads'])} / {mib(m['optim'])} | {mib(m['state'])} | "
              f"{mib(row['train_peak_rss'])} | {mib(row['peak_rss'])} |")
    if model is None:
        return
    print("\n| layout | all-gather MiB | reduce-scatter MiB | all-reduce MiB | all-to-all MiB | send/recv MiB | "
          "sent per rank (ring) MiB | measured, last step: AG / RS / AR / send MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        lay = LAYOUTS[name]
        v = comm_volume(model, lay, seq_len=LAYOUT_SEQ, micro_batch=LAYOUT_MB, grad_accum=LAYOUT_GA)
        got = row.get("measured")
        measured = "" if got is None else " / ".join(
            f"{got[k] / MIB:,.2f}" for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv"))
        print(f"| {lay.title} | " + " | ".join(f"{v[k] / MIB:,.2f}" for k in (*COLLECTIVES, "sent")) +
              f" | {measured} |")
    if unknown := sorted({u for r in rows.values() for u in r.get("unknown", ())}):
        print(f"\n- collectives dispatched but not sized: {', '.join(unknown)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, help="timed steps per launch (default 8); with --layouts, steps (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 2: optimizer state exists)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    p.add_argument("--layouts", nargs="?", const="all", help=f"parallel layouts instead of engines: all, or "
                   f"comma-separated of {','.join(LAYOUTS)}")
    p.add_argument("--preset", default="medium", help="the model of --layouts (src/treadle/presets)")
    p.add_argument("--render", help="print the --layouts tables again from the JSON a --layouts --json run wrote")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--layout-worker", choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        return print_layouts(saved["rows"], saved["preset"], saved["steps"], saved["machine"])
    if args.layouts is not None or args.layout_worker:
        args.steps = args.steps or 3
        if args.steps < 2:
            p.error("--steps must be >= 2 with --layouts (memory and traffic are measured on the last step, "
                    "after the first update made the optimizer state)")
        if args.layout_worker:
            return layout_worker(args)
        names = list(LAYOUTS) if args.layouts == "all" else [n for n in args.layouts.split(",") if n]
        if unknown := set(names) - set(LAYOUTS):
            p.error(f"unknown layouts {sorted(unknown)}; accepted: all, {','.join(LAYOUTS)}")
        return run_layouts(args, names)
    args.steps = args.steps or 8
    if args.warmup < 2:
        p.error("--warmup must be >= 2 (memory is measured on the last warm-up step, after the first update)")
    if args.worker:
        return worker(args)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}; accepted: {','.join(ENGINES)}")

    rows = {}
    with tempfile.TemporaryDirectory(prefix="treadle-scaling-") as results:
        for engine in engines:
            for ws in (1,) if engine == "local" else (1, 2):
                t0 = time.perf_counter()
                rows[engine, ws] = launch(engine, ws, args, Path(results))
                print(f"  {engine} ws{ws}: {time.perf_counter() - t0:.0f}s {rows[engine, ws].get('error', 'ok')}",
                      file=sys.stderr)

    base = rows.get(("local", 1), {}).get("tokens_per_s")
    print(f"# scaling: tiny Llama, global batch 8 x 256 tokens, fp32, {args.warmup} warm-up + {args.steps} timed steps; "
          f"{machine()}; 2 threads at ws 1, 1 per rank at ws 2")
    print("| engine | ws | tokens/s total: median step (min-max) | vs local | ws2/ws1 tokens/s | params MiB/rank | "
          "grads MiB/rank | optim MiB/rank | state total MiB/rank | ws2/ws1 state | peak RSS MiB/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (engine, ws), row in rows.items():
        if "error" in row:
            print(f"| {engine} | {ws} | FAILED: {row['error']} | | | | | | | | |")
            continue
        one = rows.get((engine, 1), {"error": ""}) if ws == 2 else {"error": ""}  # ws2/ws1 only on ws 2 rows
        speed = "" if "error" in one else f"{row['tokens_per_s'] / one['tokens_per_s']:.3f}x"
        state = "" if "error" in one else f"{row['memory']['state'] / one['memory']['state']:.3f}x"
        vs_local = f"{row['tokens_per_s'] / base:.3f}x" if base else ""
        m = {k: f"{v / MIB:.2f}" for k, v in row["memory"].items()}
        steps = row["step_tokens_per_s"]
        print(f"| {engine} | {ws} | {row['tokens_per_s']:,.0f} ({min(steps):,.0f}-{max(steps):,.0f}) | {vs_local} | "
              f"{speed} | {m['params']} | {m['grads']} | {m['optim']} | {m['state']} | {state} | "
              f"{row['peak_rss'] / MIB:,.0f} |")
    for (engine, ws), row in rows.items():
        if "ddp_buckets" in row:
            print(f"- ddp ws{ws}: DDP's gradient buckets hold another {row['ddp_buckets'] / MIB:.2f} MiB/rank "
                  "(gradient_as_bucket_view is off), not in the grads column")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "steps": args.steps, "warmup": args.warmup,
                                               "rows": [{"engine": e, "ws": w, **r} for (e, w), r in rows.items()]},
                                              indent=1))


if __name__ == "__main__":
    main()
