"""`make gpu-check`: treadle on one GPU in a few minutes, as one markdown table naming the device.

Each item is the treadle command a user runs (`treadle train ... --section.key=value`, `treadle spec-eval`), in a
subprocess of its own with its own time limit; an item that fails is a FAIL row holding its error's last line, and
the others go on:

  tiny        the demo's tiny Llama (configs/demo.toml): bf16, torch.compile, activation checkpointing, chunked loss
  llama-1b    a 1.1B Llama built from a config with random weights (hidden 2048, 16 layers, 32 heads / 8 KV heads,
              MLP 8192, vocab 32768), sequences of 2048, micro-batch 8, the same four features
  torchrun    the tiny Llama under torchrun, one process: FSDP2 over NCCL
  glide       a GLIDE draft (configs/demo-draft.toml) against the tiny target trained by `tiny`
  eagle3      an EAGLE-3 draft (configs/demo-eagle3.toml) against the same target
  dflash      a DFlash block draft (configs/demo-dflash.toml: block 8) against the same target
  glide-1b    the same three drafts against the 1.1B Llama (llama-1b's hf/, 100 steps), sequences of 2048; each
  eagle3-1b   export's config.json and tensor names/shapes are copied beside the table (<item>.config.json,
  dflash-1b   .weights.json)
  spec-KIND   `treadle spec-eval --device cuda` of the tiny target with each draft (KIND: glide, eagle3, dflash),
  spec-KIND-1b and of the 1.1B target with each 1b draft: tau, speed-up, draft forwards per round, lossless; chains
              of 4 (GLIDE, EAGLE-3) and 7 (DFlash: its whole block, one draft forward)
  samples     small JSONL files (`treadle samples`): the data of the two store items
  features-1b `treadle features` of eagle3-1b's run on that data: the 1.1B target's reads stored once (bf16)
  eagle3-1b-stored  eagle3-1b's run trained from that store (draft.features): the target's layers never built
  dsv3-1b     a 1.1B DeepSeek-V3-shaped model from a config (MLA, dense trunk, num_nextn_predict_layers 1)
  mtp-1b-shipped    its MTP head trained as pretraining trains one (1 step, ce), stitched into a copy of it
  mtp-1b-ft   that shipped head fine-tuned from the stitched checkpoint (kl, 3 replayed steps)
  spec-mtp-1b-before / -after  spec-eval of the head before and after fine-tuning (chains of 3): issue 31's tau
  fp8         bench/fp8.py: bf16 against torchao float8 (tensorwise, rowwise) at 1.1B and on an 8B-wide slice, and
              the 200-step loss check (its table in fp8/fp8.md); N/A without CUDA capability 8.9 or torchao
  side-by-side (a group: issue 40) the 1.1B Llama, 8 x 2048 packed built-in-corpus rows a step, bf16, fused AdamW,
              each loop in its own process, one timer (bench/gpu_loops.py: cuda-synchronized wall clock over steps
              16-40, peak = max_memory_allocated in each process): treadle-defaults, treadle-best (bf16, compile,
              varlen, chunked loss off), hf-bf16 and hf-compile (HF Trainer bf16=True, and torch_compile=True),
              bare-compile (a bare loop, each decoder layer compiled); then `attention` (bench/attention.py: dense /
              varlen / flex at 8k and 32k tokens on a 4-layer slice of the 1.1B)
              A second table puts each loop against the Trainer. ~7.3 minutes on an H200.

The table (tokens/s, MFU, peak memory per row) goes to stdout and to runs/gpu-check/gpu-check.md; each item's
command and output are in runs/gpu-check/<item>.log, its run in runs/gpu-check/<item>/. tokens/s and MFU are
treadle's own metrics (metrics.jsonl) over the run's last log window: the first window holds the compile.
Without CUDA the check says so in one line and exits 0.

    python bench/gpu.py                       # the check; exit 1 when an item failed
    python bench/gpu.py --device cpu --tiny   # the same items at toy sizes on CPU (gloo, no compile): the plan's test
    python bench/gpu.py --dry-run [--tiny]    # print and validate every command; runs nothing
    python bench/gpu.py --only llama-1b       # some items (the drafts and spec-evals reuse an earlier `tiny` run)
    python bench/gpu.py --only side-by-side   # issue 40's items (`--device cpu --tiny`: all of them on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
TREADLE = [sys.executable, "-m", "treadle"]  # the `treadle` script's own entry point, with this interpreter
MARKER = ".gpu-check"  # the output directory is ours to clear only when it holds this file

# A Llama-3.2-1B-shaped model (untied head, a 32k vocabulary instead of 128k): 1.1B parameters, built from the
# config by treadle with random weights. Its vocabulary exceeds the built-in tokenizer's 8192, as a real model's
# exceeds the data's; it makes the [tokens, vocab] logits the chunked loss avoids as large as a real run's.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32768, max_position_embeddings=4096)
LLAMA_TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32768, max_position_embeddings=512)
# A DeepSeek-V3-shaped model of about the same size (MLA attention, a dense trunk: first_k_dense_replace = every layer)
# whose config says it carries one MTP module (num_nextn_predict_layers = 1): the MTP items' target. The MTP module
# transformers builds from it is a MoE, as DeepSeek-V3's (8 routed experts of width 1024, 2 per token, one shared).
DSV3_1B = dict(model_type="deepseek_v3", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=16, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, moe_intermediate_size=1024, n_group=1, topk_group=1, num_nextn_predict_layers=1,
               vocab_size=32768, max_position_embeddings=4096)
DSV3_TOY = dict(DSV3_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4, moe_intermediate_size=32,
                max_position_embeddings=512)
MTP_GAMMA = 3  # the MTP items' replay depth: trained (ttt_steps) and decoded (spec-eval's chain)


# The draft kinds checked, each from its demo config, and the chain spec-eval judges it on (DFlash: its whole block).
DRAFT_CONFIGS = {"glide": "configs/demo-draft.toml", "eagle3": "configs/demo-eagle3.toml",
                 "dflash": "configs/demo-dflash.toml"}
DRAFT_NAMES = {"glide": "GLIDE", "eagle3": "EAGLE-3", "dflash": "DFlash"}
SPEC_GAMMA = {"glide": 4, "eagle3": 4, "dflash": 7}
# The 1b drafts' rows are 8x the demo's: DFlash's anchors go back to their default (seq_len / block_size, every
# position anchors about once), or the demo's 32 blocks a row would train on an eighth of the positions (the
# first GPU run did: acc_1 0.15 after 100 steps).
LONG_ROWS = {"dflash": ["--draft.anchors=none"]}


# Issue 40's items (bench/gpu_loops.py): the side-by-side loops, the attention rows and, once they exist, the FP8
# rows; `--only side-by-side` runs them all (the GPU session's one script: about 6 minutes on an H100/H200).
LOOPS = ["treadle-defaults", "treadle-best", "hf-bf16", "hf-compile", "bare-compile"]
SIDE_BY_SIDE = [*LOOPS, "attention"]
# Issue 42's rows: the same 1.1B loop with rank-16 adapters on every decoder linear (the base frozen in bf16 / in
# NF4 through bitsandbytes), timed by the same Timer: peak memory and tokens/s against full training (treadle-*).
LORA = ["lora-r16", "qlora-r16"]
# Expected on an H200 from the first run's timings (research notes of 2026-11: a compiled 1.1B treadle run trained
# 40 steps in ~26 s, compile included; eager 48-54k tokens/s): ~30 s of start-up each (imports, the corpus, a 1.1B
# init), then 45 / 55 / 42 / 90 / 55 s for the loops and ~150 s for the six attention cases (two FlexAttention
# compiles): ~7.3 minutes. The limits below bound a slow start at 10 minutes, the device's per-command limit.
SIDE_BY_SIDE_TIMEOUTS = {"treadle-defaults": 75, "treadle-best": 120, "hf-bf16": 75, "hf-compile": 120,
                         "bare-compile": 90, "attention": 300, "lora-r16": 90, "qlora-r16": 120}
GROUPS = {"side-by-side": SIDE_BY_SIDE, "lora": LORA}


@dataclass(frozen=True)
class Sizes:
    """Steps and shapes of one plan: the GPU check's, or the toy ones that run it on a CPU in a few minutes."""

    tiny_steps: int
    tiny_seq: int
    tiny_batch: int
    big: dict
    big_steps: int
    big_seq: int
    big_batch: int
    dist_steps: int
    draft_steps: int
    draft_batch: int      # the drafts on the 1.1B target (sequences of big_seq)
    log_every: int        # the 1B's; the others log 4 windows per run
    eval_batches: int
    chunk_tokens: int     # model.loss_chunk_tokens: several chunks per micro-batch at either size
    draft_eval: list      # the draft runs' acceptance eval (prompts, their length, new tokens)
    spec: list            # spec-eval's prompts
    timeout: dict         # seconds per item
    samples: int = 300    # rows per `treadle samples` file: the store items' data
    mtp_big: dict = field(default_factory=lambda: DSV3_1B)  # the MTP items' target (a DeepSeek-V3 shape)
    loop_steps: int = 40  # the side-by-side: steps each loop runs; the last 25 are timed (gpu_loops.TIMED)
    attn_seqs: str = "2048,8192,32768"  # the attention rows' row lengths (micro-batch 1)
    attn_model: dict = field(default_factory=lambda: dict(LLAMA_1B, num_hidden_layers=4, max_position_embeddings=32768))
    attn_steps: int = 2   # timed, after a warm-up
    profile_step: int = 12  # treadle-defaults' and hf-bf16's profiled step (before the timed ones): profile.md


GPU = Sizes(tiny_steps=200, tiny_seq=256, tiny_batch=8, big=LLAMA_1B, big_steps=100, big_seq=2048, big_batch=8,
            dist_steps=40, draft_steps=100, draft_batch=4, log_every=10, eval_batches=4, chunk_tokens=1024,
            draft_eval=["--draft.eval_prompts=8", "--draft.eval_new_tokens=32"],
            spec=["--num-prompts", "8", "--prompt-len", "64", "--max-new-tokens", "128"],
            timeout={"tiny": 420, "llama-1b": 600, "torchrun": 300, "glide": 300, "eagle3": 300,
                     "dflash": 300, "spec-glide": 240, "spec-eagle3": 240, "spec-dflash": 240,
                     "glide-1b": 300, "eagle3-1b": 300, "dflash-1b": 300,
                     "spec-glide-1b": 300, "spec-eagle3-1b": 300, "spec-dflash-1b": 300, "samples": 120, "features-1b": 600, "eagle3-1b-stored": 300,
                     "dsv3-1b": 600, "mtp-1b-shipped": 300, "mtp-1b-ft": 300, "spec-mtp-1b-before": 300,
                     "spec-mtp-1b-after": 300,
                     "fp8": 600, **SIDE_BY_SIDE_TIMEOUTS},
            samples=300)
TOY = Sizes(tiny_steps=4, tiny_seq=64, tiny_batch=2, big=LLAMA_TOY, big_steps=4, big_seq=64, big_batch=2,
            dist_steps=2, draft_steps=2, draft_batch=2, log_every=2, eval_batches=1, chunk_tokens=32,
            draft_eval=["--draft.eval_prompts=2", "--draft.eval_prompt_len=16", "--draft.eval_new_tokens=8"],
            spec=["--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "8"],
            timeout={"tiny": 300, "llama-1b": 300, "torchrun": 300, "glide": 300, "eagle3": 300,
                     "dflash": 300, "spec-glide": 300, "spec-eagle3": 300, "spec-dflash": 300,
                     "glide-1b": 300, "eagle3-1b": 300, "dflash-1b": 300,
                     "spec-glide-1b": 300, "spec-eagle3-1b": 300, "spec-dflash-1b": 300, "samples": 120, "features-1b": 300, "eagle3-1b-stored": 300,
                     "dsv3-1b": 300, "mtp-1b-shipped": 300, "mtp-1b-ft": 300, "spec-mtp-1b-before": 300,
                     "spec-mtp-1b-after": 300,
                     "fp8": 120, **{name: 300 for name in SIDE_BY_SIDE + LORA}},
            samples=20, mtp_big=DSV3_TOY, loop_steps=4, attn_seqs="256", attn_model=LLAMA_TOY,
            attn_steps=1, profile_step=1)


@dataclass
class Item:
    name: str
    what: str
    treadle: list[str]               # the treadle command line (after `treadle`)
    launcher: list[str] = field(default_factory=lambda: list(TREADLE))
    needs: Path | None = None        # what an earlier item writes (the tiny target)
    env: dict = field(default_factory=dict)
    row: Callable | None = None      # reads its figures (default: by the treadle subcommand)
    validate: Callable | None = None  # the dry run's check of a bench script's arguments (default: treadle's)

    @property
    def argv(self) -> list[str]:
        return [*self.launcher, *self.treadle]


def plan(out: Path, device: str, s: Sizes, only: list[str] | None = None) -> list[Item]:
    cuda = device == "cuda"
    tiny = out / "tiny"
    # Every training item: fresh, on the chosen device, no eval before the first step, one checkpoint kept.
    common = [f"--train.device={device}", f"--train.threads={0 if cuda else 1}", "--checkpoint.resume=none",
              "--checkpoint.keep_last=1", "--train.eval_at_start=false", f"--train.eval_batches={s.eval_batches}",
              f"--model.compile={'true' if cuda else 'false'}", "--model.dtype=bf16"]
    features = ["--model.activation_checkpointing=full"]
    from treadle import compat

    # The chunked loss runs on every supported torch: torch's fused op from 2.13, treadle's own before it.
    features.append(f"--model.loss_chunk_tokens={s.chunk_tokens}")
    ckpt_loss = "act. ckpt, chunked loss" + ("" if compat.HAS_LINEAR_CROSS_ENTROPY else " (treadle's, torch < 2.13)")

    def short(steps: int, seq: int, batch: int, log_every: int | None = None) -> list[str]:
        return [f"--train.max_steps={steps}", f"--train.log_every={log_every or max(steps // 4, 1)}",
                f"--data.seq_len={seq}", f"--train.micro_batch_size={batch}"]

    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in s.big.items())  # a TOML inline table
    n_big = "1.1B" if s.big is LLAMA_1B else "toy-size"
    compiled = "compile" if cuda else "no compile"
    items = [
        Item("tiny", f"tiny Llama (demo), bf16, {compiled}, {ckpt_loss}",
             ["train", "configs/demo.toml", f"--train.output_dir={tiny}", *common, *features,
              *short(s.tiny_steps, s.tiny_seq, s.tiny_batch), "--train.eval_every=0"]),
        Item("llama-1b", f"{n_big} Llama from a config, seq {s.big_seq} x {s.big_batch}, bf16, {compiled}, "
                         f"{ckpt_loss}",
             ["train", f"--train.output_dir={out / 'llama-1b'}", "--model.preset=tiny",
              f"--model.overrides={{{inline}}}", *common, *features,
              *short(s.big_steps, s.big_seq, s.big_batch, s.log_every),
              "--optim.lr=3e-4", "--schedule.warmup_proportion=0.1", "--data.val=[]"]),  # its hf/ is the 1b drafts' target
        Item("torchrun", f"tiny Llama, torchrun 1 process, fsdp2, {'nccl' if cuda else 'gloo'}",
             ["train", "configs/demo.toml", f"--train.output_dir={out / 'torchrun'}", *common,
              *short(s.dist_steps, s.tiny_seq, s.tiny_batch), "--distributed.engine=fsdp2", "--data.val=[]",
              "--checkpoint.export_hf=false", "--distributed.timeout_s=120"],
             launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                       "-m", "treadle"],
             env={"NCCL_DEBUG": "VERSION"}),  # NCCL prints its version once it is up: the row's proof it ran
    ]
    for kind, config in DRAFT_CONFIGS.items():
        items.append(Item(kind, f"{DRAFT_NAMES[kind]} draft on the tiny target, bf16, {compiled}",
                          ["train", config, f"--train.output_dir={out / kind}", f"--draft.target={tiny}", *common,
                           *short(s.draft_steps, s.tiny_seq, s.tiny_batch), "--train.eval_every=0", *s.draft_eval],
                          needs=tiny / "hf"))
    big = out / "llama-1b"
    for kind, config in DRAFT_CONFIGS.items():
        items.append(Item(f"{kind}-1b", f"{DRAFT_NAMES[kind]} draft on the {n_big} Llama, "
                                        f"seq {s.big_seq} x {s.draft_batch}, bf16, {compiled}, its export's config "
                                        f"copied to {kind}-1b.config.json",
                          ["train", config, f"--train.output_dir={out / f'{kind}-1b'}", f"--draft.target={big}",
                           *common, *short(s.draft_steps, s.big_seq, s.draft_batch, s.log_every),
                           "--train.eval_every=0", *s.draft_eval, *LONG_ROWS.get(kind, [])],
                          needs=big / "hf"))
    for kind in DRAFT_CONFIGS:  # each draft at the chain it was trained for, on the run's device (fp32 weights)
        for name, target in ((f"spec-{kind}", tiny), (f"spec-{kind}-1b", big)):
            draft = out / name.removeprefix("spec-")
            items.append(Item(name, f"spec-eval, {'tiny' if target == tiny else n_big} target + {kind} draft, "
                                    f"gamma {SPEC_GAMMA[kind]}, fp32, on {device}",
                              ["spec-eval", "--target", str(target), "--draft", str(draft), "--gamma",
                               str(SPEC_GAMMA[kind]), *s.spec, "--json", str(out / f"{name}.json"),
                               "--threads", "0" if cuda else "1", "--device", device],
                              needs=draft / "draft"))
    # eagle3-1b's run on small data (a store of the whole built-in corpus would be ~100 GB at this width), once with
    # its reads written by `treadle features` and once trained from them: the store's two halves, timed.
    data = ["--data.train=" + str(out / "samples" / "text.jsonl"), "--data.val=[]"]
    stored = ["configs/demo-eagle3.toml", f"--draft.target={big}", *common,
              *short(s.draft_steps, s.big_seq, s.draft_batch, s.log_every), "--train.eval_every=0", *s.draft_eval, *data]
    items += [
        Item("samples", "small JSONL files, the store items' data", ["samples", "--out", str(out / "samples"),
                                                                     "--n", str(s.samples)]),
        Item("features-1b", f"`treadle features` of eagle3-1b's run on that data ({n_big} target, bf16 store)",
             ["features", *stored, f"--train.output_dir={out / 'features-1b-run'}", f"--out={out / 'features-1b'}",
              "--dtype=bf16"], needs=out / "samples" / "text.jsonl"),
        Item("eagle3-1b-stored", f"eagle3-1b's run from that store: no target layer built, {compiled}",
             ["train", *stored, f"--train.output_dir={out / 'eagle3-1b-stored'}",
              f"--draft.features={out / 'features-1b'}"], needs=out / "features-1b" / "manifest.json"),
    ]
    items += mtp_items(out, device, s, common, short)
    items += fp8_items(out)
    items += side_by_side_items(out, device, s)
    return [i for i in items if only is None or i.name in only]


def fp8_items(out: Path) -> list[Item]:
    """Issue 40's FP8 item: bench/fp8.py in one process (its own runs and sizes, the same on every plan: it runs
    only on float8 hardware, and says N/A elsewhere)."""
    return [Item("fp8", "bf16 vs torchao float8 tensorwise / rowwise: 1.1B and an 8B-wide slice (8 layers), seq "
                        "2048 x 4, compile; 200-step loss check", ["--out", str(out / "fp8")],
                 launcher=[sys.executable, str(REPO / "bench" / "fp8.py")], row=fp8_row, validate=_fp8_dry_run)]


def _fp8_dry_run(argv: list[str]) -> None:
    """bench/fp8.py validates its own runs' configs."""
    sys.path.insert(0, str(REPO / "bench"))
    import fp8

    from treadle.errors import UserError

    if fp8.dry_run(Path(argv[1])) != 0:
        raise UserError("bench/fp8.py --dry-run: a run's config is invalid")


def fp8_row(item: Item, out: Path, result: dict) -> dict:
    """bench/fp8.py's summary: each shape's fp8 speed-ups over bf16 and the loss check; N/A where it did not run."""
    r = json.loads((out / "fp8" / "fp8.json").read_text())
    if "skipped" in r:
        return {**result, "status": "N/A", "note": f"not run: {r['skipped']}"}
    rows, check = r["rows"], r["loss_check"]
    notes = []
    for shape in dict.fromkeys(k.split()[0] for k in rows):
        base = rows[f"{shape} bf16"]
        ratios = ", ".join(f"{v.split('-')[1]} {rows[f'{shape} {v}']['tokens_per_s'] / base['tokens_per_s']:.2f}x"
                           for v in ("fp8-tensorwise", "fp8-rowwise") if f"{shape} {v}" in rows)
        notes.append(f"{shape}: bf16 {base['tokens_per_s']:,.0f} tokens/s, {ratios}")
    if check is not None:
        notes.append(f"loss max rel. diff {100 * check['max_rel']:.2f}% (tolerance {100 * check['tolerance']:.0f}%)")
    return {**result, "tokens_per_s": rows["1b fp8-tensorwise"]["tokens_per_s"] if "1b fp8-tensorwise" in rows
            else None, "note": "; ".join(notes) + "; table in fp8/fp8.md"}


def mtp_items(out: Path, device: str, s: Sizes, common: list[str], short) -> list[Item]:
    """Issue 31's GPU item: a DeepSeek-V3-shaped target trained from a config, its MTP head trained as pretraining
    trains one (one step, hard-label CE on data) and stitched into a copy of it (a target that ships its head), that
    head's tau ("before"), the head fine-tuned from the stitched checkpoint (kl, MTP_GAMMA replayed steps), and its
    tau ("after"). Each draft run is the same length; spec-eval decodes chains of MTP_GAMMA."""
    cuda = device == "cuda"
    target, shipped, tuned = out / "dsv3-1b", out / "mtp-1b-shipped", out / "mtp-1b-ft"
    stitched = shipped / "draft" / "stitched"  # drafts/mtp/kind.py STITCHED: the target with the head put back
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in s.mtp_big.items())
    n = "1.1B" if s.mtp_big is DSV3_1B else "toy-size"
    mtp = ["--draft.kind=mtp", f"--draft.gamma={MTP_GAMMA}", *common,
           *short(s.draft_steps, s.big_seq, s.draft_batch, s.log_every), "--train.eval_every=0", *s.draft_eval]

    def spec(name: str, tgt: Path, draft: Path) -> Item:
        return Item(name, f"spec-eval, the {n} DeepSeek-V3 + its MTP head {name.rsplit('-', 1)[1]} fine-tuning, "
                          f"gamma {MTP_GAMMA}, fp32, on {device}",
                    ["spec-eval", "--target", str(tgt), "--draft", str(draft), "--gamma", str(MTP_GAMMA), *s.spec,
                     "--json", str(out / f"{name}.json"), "--threads", "0" if cuda else "1", "--device", device],
                    needs=draft / "draft")

    return [
        Item("dsv3-1b", f"{n} DeepSeek-V3 (MLA, one MTP module in its config) from a config, seq {s.big_seq} x "
                        f"{s.big_batch}, bf16, {'compile' if cuda else 'no compile'}",
             ["train", f"--train.output_dir={target}", "--model.preset=tiny", f"--model.overrides={{{inline}}}",
              *common, *short(s.big_steps, s.big_seq, s.big_batch, s.log_every), "--optim.lr=3e-4",
              "--schedule.warmup_proportion=0.1", "--data.val=[]"]),
        Item("mtp-1b-shipped", "its MTP head as pretraining trains one (1 step, ce on data), stitched in",
             ["train", f"--train.output_dir={shipped}", f"--draft.target={target}", "--draft.loss=ce",
              "--draft.ttt_steps=1", *mtp], needs=target / "hf"),
        spec("spec-mtp-1b-before", target, shipped),
        Item("mtp-1b-ft", f"that shipped head fine-tuned (draft.target = the stitched checkpoint), kl, "
                          f"{MTP_GAMMA} replayed steps",
             ["train", f"--train.output_dir={tuned}", f"--draft.target={stitched}", "--draft.loss=kl",
              f"--draft.ttt_steps={MTP_GAMMA}", *mtp], needs=stitched / "config.json"),
        spec("spec-mtp-1b-after", stitched, tuned),
    ]


def _bench(name: str):
    """A module of bench/ (not a package): gpu_loops, attention."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    import importlib

    return importlib.import_module(name)


def side_by_side_items(out: Path, device: str, s: Sizes) -> list[Item]:
    """Issue 40's side-by-side: the 1.1B Llama, s.big_batch x s.big_seq packed built-in-corpus rows a step, bf16
    autocast over fp32 weights, fused AdamW, each loop in its own process, timed by bench/gpu_loops.py's Timer
    (cuda-synchronized wall clock over the last 25 of loop_steps; peak = max_memory_allocated in the process).
    Then the attention rows: bench/attention.py on a 4-layer slice of the 1.1B (its width; micro-batch 1)."""
    cuda = device == "cuda"
    loops = [sys.executable, str(REPO / "bench" / "gpu_loops.py")]
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in s.big.items())
    n_big = "1.1B" if s.big is LLAMA_1B else "toy-size"
    size = f"{n_big} Llama, {s.big_batch} x {s.big_seq}"

    def treadle(name: str, what: str, settings: list[str]) -> Item:  # the timer: bench/side_by_side.toml
        return Item(name, what, ["train", "bench/side_by_side.toml", f"--train.output_dir={out / name}", "--model.preset=tiny",
                                 f"--model.overrides={{{inline}}}", f"--train.device={device}",
                                 f"--train.threads={0 if cuda else 1}", "--checkpoint.resume=none", "--data.val=[]",
                                 "--checkpoint.export_hf=false", "--checkpoint.every_minutes=0",
                                 f"--data.seq_len={s.big_seq}", f"--train.micro_batch_size={s.big_batch}",
                                 f"--train.max_steps={s.loop_steps}", "--optim.lr=3e-4", *settings],
                    row=loop_row)

    def script(name: str, what: str, args: list[str]) -> Item:
        return Item(name, what, [*args, "--device", device, "--overrides", json.dumps(s.big), "--seq", str(s.big_seq),
                                 "--batch", str(s.big_batch), "--steps", str(s.loop_steps), "--out", str(out / name)],
                    launcher=loops, row=loop_row, validate=lambda argv: _bench("gpu_loops").parser().parse_args(argv))

    compiled = "compile" if cuda else "compile skipped on CPU"
    lora = ["--lora.rank=16", "--lora.alpha=32", "--lora.target_modules=all-linear", "--optim.weight_decay=0"]
    kinds = "dense,varlen,flex" if cuda else "dense,varlen"
    attention_args = ["--seqs", s.attn_seqs, "--kinds", kinds, "--steps", str(s.attn_steps), "--device", device,
                      "--threads", "4" if cuda else "1", "--dtype", "bf16" if cuda else "fp32",
                      "--overrides", json.dumps(s.attn_model), "--json", str(out / "attention.json")]
    return [
        treadle("treadle-defaults", f"treadle at its defaults (dtype, compile, attention, chunked loss: auto), {size}",
                [f"--profile.start_step={s.profile_step}", "--profile.steps=1"]),
        treadle("treadle-best", f"treadle at its best: bf16, {compiled}, attention auto, chunked loss off, {size}",
                ["--model.dtype=bf16", f"--model.compile={'true' if cuda else 'false'}",
                 "--model.loss_chunk_tokens=0"]),
        script("hf-bf16", f"HF Trainer bf16=True, {size} (the same rows, position_ids)",
               ["hf", "--profile-step", str(s.profile_step)]),
        script("hf-compile", f"HF Trainer bf16=True, torch_compile=True ({compiled}), {size}", ["hf", "--compile"]),
        script("bare-compile", f"a bare loop, each decoder layer compiled ({compiled}), {size}", ["bare"]),
        treadle("lora-r16", f"treadle defaults + LoRA r=16 on all decoder linears (base frozen), {size}", lora),
        treadle("qlora-r16", f"the same with the base in NF4 (bitsandbytes), {size}", [*lora, "--lora.quantize=4bit"]),
        Item("attention", f"attention {kinds.replace(',', ' / ')} at {s.attn_seqs} tokens, micro-batch 1, a "
                          f"{s.attn_model['num_hidden_layers']}-layer slice of the {n_big} width",
             attention_args, launcher=[sys.executable, str(REPO / "bench" / "attention.py")], row=attention_row,
             validate=lambda argv: _bench("attention").parser().parse_args(argv)),
    ]




# --------------------------------------------------------------------------- running


def last_error_line(log: str) -> str:
    """The line that says what went wrong: treadle's one-line error, else the last exception line (not torchrun's
    ChildFailedError wrapper), else the last line."""
    lines = [re.sub(r"^\[(default)?rank\d+\]:\s*", "", ln.strip()) for ln in log.splitlines() if ln.strip()]
    for pattern in (r"^treadle: (error|training failed)", r"^[\w.]+(Error|Exception|Interrupt)\b"):
        hits = [ln for ln in lines if re.match(pattern, ln) and "ChildFailedError" not in ln]
        if hits:
            return hits[-1]
    return lines[-1] if lines else "no output"


def run_item(item: Item, out: Path, timeout: int) -> dict:
    """Run one item; its row's fields (status, wall, error) and its log text."""
    if item.needs is not None and not item.needs.exists():
        return {"status": "SKIP", "note": f"needs {item.needs.relative_to(out)} (from an earlier item, not there)"}
    log_path = out / f"{item.name}.log"
    env = {**os.environ, **item.env}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(item.argv)}\n\n")
        log.flush()
        # A session of its own: on a timeout the whole group goes (torchrun and its worker too).
        proc = subprocess.Popen(item.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    wall = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    if rc is None:
        return {"status": "FAIL", "wall": wall, "note": f"timed out after {timeout} s; last line: "
                                                          f"{last_error_line(text)}", "log": text}
    if rc != 0:
        return {"status": "FAIL", "wall": wall, "note": f"exit {rc}: {last_error_line(text)}", "log": text}
    return {"status": "OK", "wall": wall, "log": text}


def training_row(item: Item, out: Path, result: dict) -> dict:
    """tokens/s, MFU and peak memory from the run's metrics.jsonl (treadle's own figures), and a note."""
    run = out / item.name
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in records if "tokens_per_s" in r]
    if not steps:
        return {**result, "status": "FAIL", "note": "no step record in metrics.jsonl"}
    last = steps[-1]
    since = steps[-2]["step"] + 1 if len(steps) > 1 else 1
    cuda = "memory_allocated_gib" in last
    peak = max(r.get("memory_allocated_gib", r.get("peak_rss_gib", 0.0)) for r in steps)
    notes = []
    start = re.search(r"^treadle: (.*?) on (.*?), [\d,]+ train tokens", result["log"], re.M)
    if start:
        notes.append(f"{start.group(1)} on {start.group(2)}")
    notes.append(f"loss {steps[0]['loss']:.2f} -> {last['loss']:.2f}")
    notes.append(f"tokens/s of steps {since}-{last['step']}")
    if cuda:
        notes.append(f"reserved {max(r['memory_reserved_gib'] for r in steps):.1f} GiB")
    if cuda and "mfu" not in last:
        notes.append("MFU: this GPU's peak is not in metrics/flops.py (--metrics.peak_tflops=...)")
    tau = [r["tau_sim"] for r in records if "tau_sim" in r]
    if tau:
        notes.append(f"tau_sim {tau[-1]:.2f}")
    if item.name == "torchrun" and "nccl" in item.what:
        nccl = re.search(r"NCCL version (\S+)", result["log"])
        notes.append(f"NCCL {nccl.group(1)} up" if nccl else "no 'NCCL version' line: did NCCL start?")
    checkpoints = run / "checkpoints"
    if item.name == "llama-1b" and checkpoints.is_dir():  # gigabytes: measured, then removed
        size = sum(p.stat().st_size for p in checkpoints.rglob("*") if p.is_file() and not p.is_symlink())
        shutil.rmtree(checkpoints)
        notes.append(f"its checkpoint ({size / 2**30:.1f} GiB) written, then removed")
    export = run / "draft"
    if item.name.endswith("-1b") and (export / "config.json").exists():  # what the engines would read, kept
        shutil.copy(export / "config.json", out / f"{item.name}.config.json")
        from safetensors import safe_open

        with safe_open(str(export / "model.safetensors"), "pt") as f:
            names = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        (out / f"{item.name}.weights.json").write_text(json.dumps(names, indent=1) + "\n")
        notes.append(f"export: {len(names)} tensors, config and names in {item.name}.config/weights.json")
    mfu = last.get("mfu")
    return {**result, "tokens_per_s": last["tokens_per_s"], "mfu": mfu, "peak_gib": peak,
            "peak_kind": "alloc" if cuda else "RSS", "note": "; ".join(notes)}


def features_row(item: Item, out: Path, result: dict) -> dict:
    """The store's accounting line: tokens/s of the target's forward and writing, bytes per token."""
    got = re.search(r"\(([\d,]+) tokens\).*?([\d,.]+) MiB, ([\d,]+) bytes per token, in ([\d.]+) s", result["log"])
    if item.name == "samples" or got is None:
        return {**result, "note": "" if item.name == "samples" else "no accounting line"}
    tokens, mib, per, seconds = (float(g.replace(",", "")) for g in got.groups())
    return {**result, "tokens_per_s": tokens / seconds, "note": f"{mib:,.0f} MiB, {per:,.0f} bytes per token"}


def loop_row(item: Item, out: Path, result: dict) -> dict:
    """A side-by-side loop: the Timer's figures (gpu_loops.py), the same for every loop."""
    r = json.loads((out / item.name / "step_timer.json").read_text())
    first, last = r["steps"]
    return {**result, "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"], "peak_gib": r["peak_gib"],
            "peak_kind": r["peak_kind"], "note": f"{r['settings']}; steps {first}-{last} timed"}


def attention_row(item: Item, out: Path, result: dict) -> dict:
    """The attention cases: each path against dense per row length in the note; the whole table beside it."""
    got = json.loads((out / "attention.json").read_text())
    (out / "attention.md").write_text(_bench("attention").table(got["results"], got["title"]))
    ok = [r for r in got["results"] if "error" not in r]
    dense = {r["seq_len"]: r for r in ok if r["kind"] == "dense"}
    notes = [f"{r['kind']} at {r['seq_len']:,}: {r['tokens_per_s']:,.0f} tokens/s"
             + (f" ({r['tokens_per_s'] / dense[r['seq_len']]['tokens_per_s']:.2f}x dense), "
                f"peak {r['peak_bytes'] / dense[r['seq_len']]['peak_bytes']:.2f}x" if r["kind"] != "dense"
                and r["seq_len"] in dense else f", peak {r['peak_bytes'] / 2**30:.1f} GiB") for r in ok]
    failed = [f"{r['kind']} at {r['seq_len']:,} FAILED: {r['error']}" for r in got["results"] if "error" in r]
    return {**result, "status": "FAIL" if failed else "OK", "note": "; ".join(notes + failed) + " (attention.md)"}


def side_by_side_table(rows: list[tuple[Item, dict]]) -> str:
    """The loops against the Trainer: treadle at defaults against the Trainer at bf16=True, the compiled loops
    against the Trainer with torch_compile (the targets of issue 40: >= 1.0x and >= 1.15x)."""
    got = {item.name: r for item, r in rows if item.row is loop_row and r.get("tokens_per_s")}
    if not got:
        return ""
    against = {"treadle-defaults": "hf-bf16", "treadle-best": "hf-compile", "bare-compile": "hf-compile",
               "hf-compile": "hf-bf16"}
    lines = ["", "| loop | tokens/s | vs Trainer | MFU | peak GiB |", "|---|---|---|---|---|"]
    for name, r in got.items():
        base = got.get(against.get(name, ""))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x {against[name]}" if base else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {r['peak_gib']:.1f} ({r['peak_kind']}) |")
    return "\n".join(lines) + "\n"


def spec_row(item: Item, out: Path, result: dict) -> dict:
    r = json.loads((out / item.name / "step_timer.json").read_text())
    return {**result, "tokens_per_s": r["tokens_per_s_spec"],
            "note": f"tau {r['tau']:.2f}, {r['speedup']:.2f}x the target alone "
                    f"({r['tokens_per_s_target']:,.0f} tokens/s), "
                    f"{'lossless' if r['lossless'] else 'NOT lossless'}, "
                    f"{r['draft_forwards_per_round'] or 0:.1f} draft forwards per round"}


# --------------------------------------------------------------------------- the table


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def device_line(device: str) -> str:
    import torch

    from treadle import __version__

    commit = _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or "no git"
    soft = f"torch {torch.__version__}, Python {platform.python_version()}, treadle {__version__} ({commit})"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "--id=0"])
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
        memory = props.total_memory / 2**30
        return (f"{torch.cuda.get_device_name(0)} (sm_{props.major}{props.minor}, {memory:.0f} GiB; GPU 0 of "
                f"{torch.cuda.device_count()}), driver {driver or 'unknown (no nvidia-smi)'}, "
                f"CUDA {torch.version.cuda}, NCCL {nccl}, {soft}")
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")] \
        if info.exists() else []
    return f"CPU: {names[0] if names else platform.machine()}, {os.cpu_count()} cores, {soft}"


def table(rows: list[tuple[Item, dict]], device: str, tiny: bool) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sizes = "toy sizes (`--tiny`)" if tiny else "full sizes"
    lines = [f"### treadle gpu-check, {when}, {sizes}", "", f"Device: {device_line(device)}", "",
             "| item | what | result | wall s | tokens/s | MFU | peak GiB | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for item, r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") is not None else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
        peak = f"{r['peak_gib']:.2f} ({r['peak_kind']})" if r.get("peak_gib") is not None else ""
        wall = f"{r['wall']:.0f}" if "wall" in r else ""
        note = r.get("note", "").replace("|", "\\|")
        lines.append(f"| {item.name} | {item.what} | {r['status']} | {wall} | {tps} | {mfu} | {peak} | {note} |")
    lines += ["", "tokens/s and MFU: treadle's metrics over the run's last log window (the first holds the compile); "
              "MFU against metrics/flops.py's bf16 peak. peak GiB: torch.cuda.max_memory_allocated over the run "
              "(alloc), or on a CPU the process's peak RSS. wall s: the whole command (start-up, data, compile, "
              "checkpoint). Each item's command and output: <item>.log beside this file."]
    return "\n".join(lines) + "\n"


def dry_run(items: list[Item]) -> int:
    """Every command printed, and checked the way treadle checks it (the config, spec-eval's flags): a typo in a
    key fails here, on any machine, and not first on a GPU."""
    from treadle.cli import build_parser
    from treadle.config import load_config
    from treadle.errors import UserError

    bad = 0
    for item in items:
        try:
            if item.validate is not None:  # a bench script's own arguments
                item.validate(item.treadle)
            elif item.treadle[0] in ("train", "features"):  # features: a draft run's config, plus its own flags
                words = [w for w in item.treadle[1:] if not w.startswith(("--out=", "--dtype="))]
                files = [w for w in words if not w.startswith("-")]
                cfg = load_config(files[0] if files else None, [w for w in words if w.startswith("-")])
                if cfg.model.overrides:  # HF configs keep an unknown field silently: a typo would change nothing
                    from transformers import AutoConfig

                    family = cfg.model.overrides.get("model_type", "llama")  # the tiny preset's, unless overridden
                    known = AutoConfig.for_model(family).to_dict()
                    if unknown := sorted(set(cfg.model.overrides) - set(known)):
                        raise UserError(f"model.overrides: {unknown} are not {family} config fields")
            else:
                build_parser([item.treadle[0]]).parse_args(item.treadle)
            status = "ok"
        except (UserError, SystemExit) as exc:
            status, bad = f"INVALID: {exc}", bad + 1
        print(f"{item.name}: {status}\n  {shlex.join(item.argv)}")
    return 1 if bad else 0


def profile_section(out: Path, step: int) -> str:
    """treadle-defaults' and hf-bf16's profiled step side by side (bench/trace_summary.py), where both traced."""
    traces = {"treadle-defaults": sorted((out / "treadle-defaults" / "profile").glob("*.pt.trace.json")),
              "hf-bf16": sorted((out / "hf-bf16" / "profile").glob("trace.json"))}
    found = {name: paths[-1] for name, paths in traces.items() if paths}
    if not found:
        return ""
    summary = _bench("trace_summary")
    results = {name: summary.summary(summary.load(path), 10) for name, path in found.items()}
    return f"One profiled step (step {step}), the GPU's view\n\n" + summary.markdown(results, 10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default): the check, on GPU 0; cpu: the same items on the CPU (no NCCL, no compile)")
    p.add_argument("--tiny", action="store_true", help="toy sizes and steps: the plan in a minute or two on a CPU")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check",
                   help="output directory (default: runs/gpu-check); its item directories are replaced")
    p.add_argument("--only", help="comma-separated items or groups (default: all items): "
                                  f"{','.join(i.name for i in plan(REPO / 'runs' / 'gpu-check', 'cuda', GPU))}; "
                                  f"groups: {', '.join(f'{g} (= {chr(44).join(n)})' for g, n in GROUPS.items())}")
    p.add_argument("--max-item-s", type=int, help="cap every item's time limit at this many seconds")
    p.add_argument("--dry-run", action="store_true", help="print and validate every command; run nothing")
    args = p.parse_args()
    out = args.out.resolve()
    only = [n for w in args.only.split(",") for n in GROUPS.get(w, [w])] if args.only else None
    items = plan(out, args.device, TOY if args.tiny else GPU, only)
    if only and (unknown := set(only) - {i.name for i in plan(out, args.device, GPU)}):
        p.error(f"--only: unknown items {sorted(unknown)}")
    if args.dry_run:
        return dry_run(items)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else
               f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device")
        print(f"gpu-check: no CUDA here ({why}), nothing run; `python bench/gpu.py --device cpu --tiny` runs the "
              "same items at toy sizes on the CPU")
        return 0
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        print(f"gpu-check: {out} holds files the check did not write; accepted: a new or empty directory, or an "
              "earlier check's (--out DIR)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by bench/gpu.py: its item directories are replaced on every run\n")

    rows = []
    for item in items:
        for stale in (out / item.name, out / f"{item.name}.json"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
        timeout = min((TOY if args.tiny else GPU).timeout[item.name], args.max_item_s or 10**9)
        print(f"gpu-check: {item.name} ...", file=sys.stderr, flush=True)
        result = run_item(item, out, timeout)
        if result["status"] == "OK":
            try:
                rows_of = {"spec-eval": spec_row, "features": features_row, "samples": features_row}
                result = (item.row or rows_of.get(item.treadle[0], training_row))(item, out, result)
            except (OSError, ValueError, KeyError) as exc:  # ran, but left no readable figures
                result = {**result, "status": "FAIL", "note": f"its results cannot be read: {exc!r}"}
        print(f"gpu-check: {item.name} {result['status']} {result.get('wall', 0):.0f} s", file=sys.stderr, flush=True)
        rows.append((item, result))

    text = table(rows, args.device, args.tiny) + side_by_side_table(rows)
    if (out / "attention.md").exists() and any(item.name == "attention" for item, _ in rows):
        text += "\n" + (out / "attention.md").read_text()
    if profiles := profile_section(out, (TOY if args.tiny else GPU).profile_step):
        text += "\n" + profiles
    (out / "gpu-check.md").write_text(text)
    print(text, end="")
    print(f"(written to {out / 'gpu-check.md'})")
    return 0 if all(r["status"] in ("OK", "N/A") for _, r in rows) else 1  # N/A: needs hardware this one lacks


if __name__ == "__main__":
    sys.exit(main())
