"""Draft training from a feature store against the live target: speed, memory, disk and tau.

    python bench/features.py [--target runs/bench-target-701] [--deep-layers 12] [--steps 60] [--tau-steps 300]

Every training run is an EAGLE-3 draft run of the same config (seq_len 256, 8 rows per step, 3 unroll steps) in a
child process of its own, so its peak RSS (ru_maxrss) is its own:

1. speed: online (the live target every step) against from an fp32 store, on the bench target and on a deeper
   target (its config with --deep-layers layers, random weights: speed only), draft-step tokens/s and peak RSS;
2. disk: bytes per token of fp32 / bf16 / fp8 stores, and what an 8B target's store costs per token in each;
3. tau: drafts trained --tau-steps steps from the fp32, bf16 and fp8 stores of the bench target (tau_sim at the end);
4. the compact teacher: the store keeps the target's final hidden state (the head recomputes the logits exactly);
   the alternative, top-k logits, is measured by the teacher's probability mass outside the top k and the
   KL(teacher || top-k teacher renormalized) on held-out windows;
5. the projection of the speed-up for an 8B target (Llama-3-8B's shapes) from FLOPs per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


KIND_ARGS = {"eagle3": ["--draft.kind=eagle3", "--draft.ttt_steps=3"], "glide": ["--draft.kind=glide"]}


def run_args(target: Path, data: Path, out: Path, steps: int, *extra: str, kind: str = "eagle3") -> list[str]:
    return [f"--train.output_dir={out}", f"--data.train={data / 'train'}", f"--data.val={data / 'val'}",
            *KIND_ARGS[kind], f"--draft.target={target}", "--data.seq_len=256",
            "--train.micro_batch_size=8", f"--train.max_steps={steps}", "--train.threads=2", "--optim.lr=3e-3",
            f"--train.log_every={max(1, steps // 4)}", f"--train.eval_every={steps}", "--train.eval_batches=2",
            "--checkpoint.resume=none", "--checkpoint.every_minutes=0", "--model.compile=false",
            "--model.dtype=fp32", "--draft.eval_prompts=8", "--draft.eval_prompt_len=64",
            "--draft.eval_new_tokens=64", *extra]


def child(argv: list[str]) -> dict:
    """One command in a fresh process: its result line (JSON) and its peak RSS. A run starts fresh (its directory,
    an earlier bench's, removed)."""
    for a in argv:
        if a.startswith("--train.output_dir="):
            shutil.rmtree(a.split("=", 1)[1], ignore_errors=True)
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(argv)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"child failed: {argv[:2]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(argv: list[str]) -> None:
    from treadle.config import load_config

    t0 = time.perf_counter()
    if argv[0] == "features":
        from treadle.train.features import write_features

        out, dtype = Path(argv[1]), argv[2]
        report = write_features(load_config(None, argv[3:]), out, dtype, progress=False)
        got = {"tokens": report.tokens, "bytes": report.bytes, "seconds": report.seconds}
    else:
        from treadle.train.run import run_training

        s = run_training(load_config(None, argv[1:]), live=False)
        got = {"tokens_per_s": s.tokens_per_s, "tau_sim": s.acceptance[1]["tau_sim"] if s.acceptance else None,
               "steps": s.steps}
    got["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    got["wall_s"] = time.perf_counter() - t0
    print(json.dumps(got))


def small_data(tokenizer: Path, out: Path, files: int) -> Path:
    """Shards of the first ``files`` files of the built-in corpus (a store of all of it stays small)."""
    from treadle import corpus
    from treadle.data.prepare import prepare

    if not (out / "val").is_dir():
        paths = [str(p) for _, p in corpus.corpus_files()]
        prepare(paths[:files], out / "train", tokenizer, workers=1)
        prepare(paths[-2:], out / "val", tokenizer, workers=1)
    return out


def deep_target(target: Path, layers: int, out: Path) -> Path:
    """The target's config with ``layers`` decoder layers, random weights (speed only), its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (out / "model.safetensors").is_file():
        config = AutoConfig.from_pretrained(target)
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        for f in target.glob("tokenizer*"):
            shutil.copy(f, out / f.name)
    return out


def topk_teacher(target: Path, data: Path, ks=(8, 32, 64)) -> dict:
    """Mass outside the teacher's top k and KL(teacher || top-k renormalized), mean per token, held-out windows."""
    from transformers import AutoModelForCausalLM

    from treadle.data.packed import PackedDataset

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ds = PackedDataset(data / "val", 256)
    ids = torch.stack([ds[i]["input_ids"] for i in range(min(8, len(ds)))])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    out = {}
    for k in ks:
        top, _ = logp.topk(k, -1)
        kept = top.exp().sum(-1)
        # The top-k teacher renormalized is p / kept on its k tokens: KL(p || it) is infinite (mass off its
        # support), so its error is stated as the dropped mass and KL(it || p) = -log kept (nats per token).
        out[k] = {"missing_mass": float((1 - kept).mean()), "kl_topk_vs_full": float((-kept.log()).mean())}
    return out


def projection_8b() -> dict:
    """FLOPs per token: an 8B target's forward against its EAGLE-3 draft's training step (7 unroll steps)."""
    from transformers import LlamaConfig

    from treadle.drafts.eagle3.model import Eagle3Draft
    from treadle.metrics.flops import matmul_parameters

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        draft = Eagle3Draft(config, (2, 16, 29), 32000)
    fc = draft.fc.weight.numel()
    per_step = matmul_parameters(draft) - fc  # the layer and its head, run once per unroll step
    target_forward = 2 * 8.03e9
    draft_train = 6 * (fc + 7 * per_step)
    # The store's reads cost nothing to compute; the run reads 3 d + d values per token (bf16: 32 KiB per token).
    return {"target_forward_gflop": target_forward / 1e9, "draft_train_gflop": draft_train / 1e9,
            "speedup": (target_forward + draft_train) / draft_train}


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:,.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=Path("runs/bench-target-701"),
                        help="the bench target as a Hugging Face directory (treadle export runs/bench-target DIR)")
    parser.add_argument("--deep-layers", type=int, default=12)
    parser.add_argument("--files", type=int, default=6, help="built-in corpus files in the training data")
    parser.add_argument("--steps", type=int, default=40, help="steps of each speed run")
    parser.add_argument("--tau-steps", type=int, default=120, help="steps of each tau run")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-features"))
    parser.add_argument("--kinds", default="eagle3,glide", help="draft kinds of the speed rows")
    parser.add_argument("--parts", default="speed,tau", help="speed (online vs store), tau (the storage forms)")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return 0
    from treadle.drafts.features.store import bytes_per_token

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    data = small_data(args.target, out / "data", args.files)
    deep = deep_target(args.target, args.deep_layers, out / "deep-target")
    rows, disk, taus = [], [], []
    parts = args.parts.split(",")
    targets = (("bench target", args.target), (f"{args.deep_layers}-layer", deep))
    speed = [(kind, *t) for kind in args.kinds.split(",") for t in targets] if "speed" in parts else []
    for kind, name, target in speed:
        layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
        store = out / (f"store-{layers}-fp32" if kind == "eagle3" else f"store-{kind}-{layers}-fp32")
        shutil.rmtree(store, ignore_errors=True)
        wrote = child(["features", str(store), "fp32", *run_args(target, data, out / "unused", args.steps, kind=kind)])
        online = child(["train", *run_args(target, data, out / f"online-{layers}", args.steps, kind=kind)])
        stored = child(["train", *run_args(target, data, out / f"stored-{layers}", args.steps,
                                           f"--draft.features={store}", kind=kind)])
        rows.append({"draft": kind, "target": f"{name} ({layers} layers)", "online tok/s": online["tokens_per_s"],
                     "store tok/s": stored["tokens_per_s"], "speed-up": stored["tokens_per_s"] / online["tokens_per_s"],
                     "online RSS MiB": online["peak_rss_mib"], "store RSS MiB": stored["peak_rss_mib"],
                     "write s": wrote["seconds"], "write tok/s": wrote["tokens"] / wrote["seconds"]})
        print(json.dumps(rows[-1]), flush=True)
    for dtype in ("fp32", "bf16", "fp8") if "tau" in parts else ():
        store = out / f"store-tau-{dtype}"
        if dtype == "fp32":  # the speed part's store of the bench target, written here when that part did not run
            store = out / f"store-{json.loads((args.target / 'config.json').read_text())['num_hidden_layers']}-fp32"
        if dtype != "fp32" or not (store / "manifest.json").is_file():
            shutil.rmtree(store, ignore_errors=True)
            child(["features", str(store), dtype, *run_args(args.target, data, out / "unused", args.steps)])
        manifest = json.loads((store / "manifest.json").read_text())
        tokens = sum(s["samples"] for s in manifest["splits"].values()) * manifest["seq_len"]
        size = sum(p.stat().st_size for p in store.glob("*-*.safetensors"))
        d8b = {"hidden": [4096], "features": [3 * 4096]}
        disk.append({"dtype": dtype, "bytes/token (bench)": size / tokens, "bytes/token 8B EAGLE-3":
                     bytes_per_token(d8b, dtype), "MB per 8k-token sample (8B)": bytes_per_token(d8b, dtype) * 8192 / 1e6})
        got = child(["train", *run_args(args.target, data, out / f"tau-{dtype}", args.tau_steps,
                                        f"--draft.features={store}")])
        taus.append({"store": dtype, "steps": got["steps"], "tau_sim": got["tau_sim"], "tok/s": got["tokens_per_s"]})
        print(json.dumps(taus[-1]), flush=True)
    topk = topk_teacher(args.target, data)
    proj = projection_8b()
    print(f"\n## bench/features.py on {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    for got in (rows, disk, taus):
        if got:
            print(table(got, list(got[0])), "\n")
    print(table([{"k": k, **v} for k, v in topk.items()], ["k", "missing_mass", "kl_topk_vs_full"]), "\n")
    print(f"8B projection: target forward {proj['target_forward_gflop']:.1f} GFLOP/token, EAGLE-3 draft training "
          f"{proj['draft_train_gflop']:.1f} GFLOP/token (7 unroll steps, 32k head): a store-backed step does "
          f"{proj['speedup']:.1f}x less compute")
    (out / f"results-{'-'.join(parts)}.json").write_text(json.dumps({"speed": rows, "disk": disk, "tau": taus,
                                                                      "topk": topk, "projection_8b": proj}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
