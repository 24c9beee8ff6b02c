"""Peak host memory per rank when a run loads its model from ``model.path``, at world size 1 and 2.

    python bench/memory_loading_cases.py [--preset medium] [--vocab 32000]

The model: a preset (``medium``: a 250M-parameter Llama, 1 GB in fp32) with random weights, saved once as
bf16 safetensors (split into 200 MB files, as HF saves big models) under $TREADLE_CACHE/bench. Each case is a
real ``treadle train --model.path=...`` of one step (built-in corpus, one 256-token row per rank), its ranks
launched by ``torchrun`` in fresh processes; every rank reports its peak RSS (``ru_maxrss``) at four points:
after the imports and the process group (the floor every process pays); when the engine builds its optimizer
(the model is in memory as the engine holds it, nothing else yet: the part sharded loading changes); after
``build_trainer`` (the engine's own state too: DeepSpeed allocates its flat fp32 partitions, gradient buffers and
AdamW state there); and after the step. "whole" runs load the model with ``from_pretrained`` on every rank;
FSDP2 builds it on the meta device and each rank reads its shards after sharding; ZeRO-3 builds it on the meta
device and reads and partitions it module by module (models/sharded_load.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

CASES = [  # (name, world size, engine flags, how the model is read)
    ("local", 1, ["--distributed.engine=local"], "whole"),
    ("fsdp2-1", 1, ["--distributed.engine=fsdp2"], "meta + shards"),
    ("ddp-2", 2, ["--distributed.engine=ddp"], "whole"),
    ("fsdp2-2", 2, ["--distributed.engine=fsdp2"], "meta + shards"),
    ("zero3-2", 2, ["--distributed.engine=deepspeed", "--distributed.zero_stage=3"], "meta + module by module"),
]


def _mib_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def saved_model(preset: str, vocab: int) -> Path:
    """The preset with random weights as a bf16 HF directory, made once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from treadle.corpus import cache_dir
    from treadle.models.hf import load_preset

    out = cache_dir() / "bench" / f"{preset}-{vocab}-bf16"
    if not (out / "config.json").is_file():
        fields = load_preset(preset) | {"vocab_size": vocab}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
        model.to(torch.bfloat16).save_pretrained(out, max_shard_size="200MB")
    return out


def _peak_when_the_optimizer_is_built() -> list[float]:
    """Every engine builds its optimizer once the model is materialized (and sharded): the peak then is the load's."""
    from treadle.engine import optim

    seen, build = [], optim.build_optimizer

    def measured(*args, **kwargs):
        seen.append(_mib_peak())
        return build(*args, **kwargs)

    optim.build_optimizer = measured  # build_engine imports it at call time
    return seen


def rank_main(out: Path, argv: list[str]) -> None:
    """One rank of a case (under torchrun): the run, its peaks written to out/rank<N>.json."""
    from treadle import distributed
    from treadle.config import load_config
    from treadle.train.run import build_trainer, close_trainer

    rank = int(os.environ.get("RANK", 0))
    cfg = load_config(None, argv)
    distributed.init_distributed("cpu", num_threads=1)
    floor = _mib_peak()
    loaded = _peak_when_the_optimizer_is_built()
    trainer = build_trainer(cfg, live=False)
    built, loaded = _mib_peak(), loaded[0]
    held = trainer.engine.memory_report()["params"] / 2**20
    trainer.fit()
    close_trainer(trainer)
    (out / f"rank{rank}.json").write_text(json.dumps({"floor": floor, "loaded": loaded, "built": built, "step": _mib_peak(),
                                                      "params_mib": held}))
    distributed.destroy()


def run_case(name: str, world: int, flags: list[str], model_dir: Path, work: Path) -> list[dict]:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    argv = [f"--model.path={model_dir}", f"--train.output_dir={out / 'run'}", "--train.max_steps=1",
            "--train.micro_batch_size=1", "--train.grad_accum_steps=1", "--data.seq_len=256", "--train.threads=1",
            "--checkpoint.every=0", "--checkpoint.export_hf=false", "--train.eval_every=0", *flags]
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={world}", __file__, "--rank-out", str(out), "--", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def loading_cases(preset: str = "medium", vocab: int = 32_000, work: Path | None = None,
                  only: list[str] | None = None) -> tuple[Path, list[dict]]:
    import tempfile

    model_dir = saved_model(preset, vocab)
    work = work or Path(tempfile.mkdtemp(prefix="treadle-bench-loading-"))
    rows = []
    for name, world, flags, how in CASES:
        if only and name not in only and name != "local":  # local is every row's baseline
            continue
        ranks = run_case(name, world, flags, model_dir, work)
        rows.append({"case": name, "world": world, "how": how, **{k: max(r[k] for r in ranks) for k in ranks[0]}})
    return model_dir, rows


def print_table(model_dir: Path, rows: list[dict]) -> None:
    import torch

    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    base = next(r for r in rows if r["case"] == "local")
    print(f"# model.path {model_dir.name}: {size:,.0f} MiB of bf16 safetensors, {2 * size:,.0f} MiB as fp32 weights; "
          f"torch {torch.__version__}; peak RSS per rank (the larger rank), MiB")
    print("| case | world | how the model is read | floor | model loaded | load part | vs local | params held "
          "| engine built | after 1 step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        part = r["loaded"] - r["floor"]
        print(f"| {r['case']} | {r['world']} | {r['how']} | {r['floor']:,.0f} | {r['loaded']:,.0f} | {part:,.0f} | "
              f"{part / (base['loaded'] - base['floor']):.2f} | {r['params_mib']:,.0f} | {r['built']:,.0f} | {r['step']:,.0f} |")


def main() -> None:
    if "--rank-out" in sys.argv:  # a rank of a case, launched by torchrun
        i = sys.argv.index("--rank-out")
        rank_main(Path(sys.argv[i + 1]), sys.argv[sys.argv.index("--") + 1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--cases", help="comma-separated case names (local always runs: the baseline); default: all")
    args = ap.parse_args()
    print_table(*loading_cases(args.preset, args.vocab, only=args.cases.split(",") if args.cases else None))


if __name__ == "__main__":
    main()
