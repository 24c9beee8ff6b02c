"""Which drafter makes a target fastest, judged on a target that does not loop, at equal training wall time.

The target is configs/bench-target.toml's (the demo's tiny Llama trained 4x longer), trained once into
runs/bench-target and reused (an interrupted training resumes). Its greedy outputs on the held-out prompts are
checked for loops (distinct n-grams) and prompt lookup's tau says how much repetition there is to exploit.

Every trainable drafter in ``RECIPES`` gets the same training wall time (``--train-seconds``), not the same
steps: short probe runs, all taken first and back to back, measure each recipe's step time, and its cosine schedule
is sized to the budget.
Then each drafter decodes the same held-out prompts against the frozen target, in every mode of ``MODES``:
a greedy chain of gamma drafts, a greedy static tree, a greedy EAGLE-2 dynamic tree, and a sampled chain,
static tree and dynamic tree (T = 1). Greedy rows must be lossless.

``dflash`` is a DFlash block draft (block 8): its chain rows draft the whole block (gamma 7) in one draft forward.
Every row gives tau by output position (per 64 generated tokens: acceptance decays as the output grows), the draft
forwards run per verification call (counted), and sum_k prod_{i<=k} acc_i from the pooled per-position counts.

Beside measured tokens/s (this CPU, where a draft step of the tiny target costs a large share of a target step),
a cost model projects the speedup a real target would give: batch-1 decoding reads every weight once per
forward, so a step's cost is taken as the parameters it reads (embedding rows excluded, LM head included);
with c = draft step / target step, a chain of gamma costs 1 + gamma c target steps per verification call
(the verify forward of gamma + 1 tokens about one step: memory-bound), a tree 1 + depth c and a DFlash block
1 + c (one draft forward, counted: the draft forwards per round replace gamma);
projected speedup = tau / that.

    python bench/spec.py [--suite spec|mtp|frontier] [--train-seconds 150 | --steps N] [--only glide-kl,lm,prompt-lookup] [--modes chain,tree,dynamic,t1,tree-t1,dynamic-t1] [--reuse-trained]

``glide-kl-longspec`` (not in the default list) is glide-kl in LongSpec's layout (``draft.layout = "longspec"``),
the row to set beside glide-kl to choose the default layout: ``--only glide-kl,glide-kl-longspec``.
``eagle3-imported`` (not in the default list) is eagle3's draft rewritten as another trainer ships one and imported
(``--only eagle3,eagle3-imported``): the row proves the import path, its tau must be eagle3's.
``glide-kl-regen`` (not in the default list) trains GLIDE-kl on *regenerated* data: prompts cut from the
built-in corpus' train split, answered greedily by the target itself (``treadle generate``), trained as SFT.
``--suite mtp`` benches MTP heads (``draft.kind = "mtp"``), which need a target family with an MTP layout: the
target is configs/bench-target-mtp.toml's GLM-4-MoE of the Llama's size (trained once into runs/bench-target-mtp),
the recipes ``mtp`` (a new module, kl), ``glide-kl`` (the same recipe as above, on this target), ``mtp-shipped`` and
``mtp-shipped-ft``, decoded as chains (``chain``, ``t1``), results in runs/bench-spec-mtp. ``mtp-shipped`` is a proxy
for a target that ships its MTP head: after the trunk is trained, one module is trained as pretraining trains it
(one step, hard-label CE on the corpus), stitched into the target checkpoint (its export's draft/stitched/) and
decoded from there ("before"); ``mtp-shipped-ft`` starts from that checkpoint's head (draft.target = it) and
fine-tunes it on regenerated data with kl and the recursive unroll ("after"; its budget is the same again, sized
with ``mtp``'s probe: the same step).

``--suite frontier`` benches the block drafts that top the 2026 comparisons against EAGLE-3 on one contract (issue 41):
``eagle3``, ``dflash``, ``dflash2``, ``dspark``, ``lilicorr`` and, once the registry has them, issue 50's ``dspine``
and ``xpress`` (``FRONTIER``: the suite's default list follows ``registry.KINDS``), each trained on the same
target-regenerated data
(train-split prompts answered by the bench target itself, at ``--regen-temperature``, T = 1 in this suite: its greedy
text loops), with the same budget (``--train-seconds`` of wall or CPU time, sized by the probes as above), the same
loss (kl against the target) and the same draft length: 7 tokens per round, the DSpark paper's Table 1 setting (chain,
T = 1, block and TTT length 7; ModelOpt PR #2342's matched table uses block 16, too long for this tiny target).
So DSpark's block is 7 (every slot drafts), DFlash's, DFlash2's, LiLiCorr's, DSpine's and XPress' 8 (the anchor + 7
mask slots),
EAGLE-3 unrolls 7 steps in training and drafts a chain of 7; the block drafts all have 2 layers and 32 anchors per
256-token row, their slots weighed exp(-k / 4). Each decodes a greedy chain and a T = 1 chain of 7, and a second
table gives per drafter tau greedy and at T = 1, tau at T = 1 over EAGLE-3's (the issue's goal: 1.25x), acceptance by
position within the block and the expected acceptance length. ``lilicorr-conv`` (not in the suite's list) is
LiLiCorr on DFlash2's convolving backbone. ``--target-steps`` trains the suite's target that many steps instead of
its config's (a shorter bench target for a short session; point ``--target`` at a directory of its own).
With ``--budget cpu`` every recipe is probed in CPU seconds a step (one training thread, ``model.dtype`` pinned to
bf16 so that no run measures its own precision); a kind added to a table later is sized against the earlier ones by
naming one of them first with ``--reuse-trained`` (``--only dflash,dspine,xpress --reuse-trained``): that one is
probed again and every new probe scaled by its recorded / current step cost (``load_scale``).
``--quick`` is a smoke run of the whole pipeline in a few minutes (a 30-step target, 3 training steps per drafter,
2 prompts x 16 tokens): it checks that every recipe trains, exports and decodes losslessly, not which one is best.

Results go to stdout as a table and to ``runs/bench-spec/results.json`` (``--suite mtp``: runs/bench-spec-mtp/);
rows of earlier invocations with the same settings stay in it (the table can be built over several ``--only`` runs),
and ``--reuse-trained`` decodes with the drafters an earlier invocation trained.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import platform
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoTokenizer

from treadle.config import load_config
from treadle.corpus import corpus_files, split_of
from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.dflash.model import load_dflash
from treadle.drafts.registry import KINDS
from treadle.drafts.registry import drafter as exported_drafter
from treadle.drafts.eagle3.model import load_eagle3
from treadle.drafts.glide.layout import load_glide
from treadle.drafts.mtp.drafter import MtpDrafter
from treadle.drafts.mtp.kind import STITCHED
from treadle.drafts.mtp.model import load_mtp
from treadle.model_dirs import resolve_model_dir
from treadle.models.hf import load_causal_lm
from treadle.speculative.acceptance import lookup_tau
from treadle.speculative.decode import target_generate
from treadle.speculative.drafters import ModelDrafter, PromptLookupDrafter
from treadle.drafts.eagle3.drafter import Eagle3Drafter
from treadle.speculative.evaluate import evaluate_drafter
from treadle.drafts.glide.drafter import GlideDrafter
from treadle.speculative.prompts import heldout_prompts
from treadle.speculative.sampling import Sampler
from treadle.speculative.tree import DynamicTree
from treadle.train.run import run_training

BENCH_TARGET = Path("configs/bench-target.toml")
TREE = (2, 2, 1, 1)  # 2 + 4 + 4 + 4 = 14 nodes, depth 4: the same depth as the chain's gamma
DYNAMIC = DynamicTree(top_k=4, depth=4, nodes=16)  # EAGLE-2's: the 16 likeliest of 4 expansions per depth
TOKENS_PER_STEP = 8 * 256

# An independent draft LM of about GLIDE's trainable size (~0.9M for the tiny target):
# one tied embedding/head of width 96 plus two thin layers.
LM_DRAFT = "{hidden_size=96,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,tie_word_embeddings=true}"

# Llama-3-8B (d 4096, 32 layers, GQA 8 kv heads, MLP 14336, vocab 128256): parameters read per decode step.
_D, _KV, _FF, _V = 4096, 1024, 14336, 128256
_LAYER_8B = _D * (2 * _D + 2 * _KV) + 3 * _D * _FF  # attention q/o + k/v, SwiGLU MLP: 218M
TARGET_8B = 32 * _LAYER_8B + _D * _V  # 7.5B read per step (the input embedding row aside)
COST_8B = {
    # GLIDE at 8B: one such layer plus cross-attention q/o, and the target's LM head.
    "glide": _LAYER_8B + 2 * _D * _D + _D * _V,
    # EAGLE-3 at 8B: one decoder layer whose q/k/v read [embedding ; feature] (2d wide), the fc fusing three
    # target layers (3d -> d; counted on every step although only the first link of a chain runs it), and its
    # own head over a 32k draft vocabulary (EAGLE-3's choice for Llama-3).
    "eagle3": 2 * _D * (_D + 2 * _KV) + _D * _D + 3 * _D * _FF + 3 * _D * _D + _D * 32000,
    # DFlash at 8B: the bench's two draft layers (attention reads the fused context through its own k/v, so no wider
    # than a plain layer), the fc fusing z-lab's five target layers (5d -> d), and the target's head over the
    # block; one such forward drafts the whole block (memory-bound: the weights are read once for all its slots).
    "dflash": 2 * _LAYER_8B + 5 * _D * _D + _D * _V,
    # DFlash2 at 8B: DFlash's, plus the selector's state projection (d -> rank 256) and, per slot, 16 candidates'
    # successor-codebook rows and one predecessor row (the grouped convolutions' taps are a few thousand weights).
    "dflash2": 2 * _LAYER_8B + 5 * _D * _D + _D * _V + _D * 256 + 17 * 256,
    # DSpark at 8B: DFlash's, plus the Markov head's rank-256 bias over the vocabulary (markov_w2: 256 x V; w1 is one
    # embedding row per slot) and the confidence head (one d-wide row).
    "dspark": 2 * _LAYER_8B + 5 * _D * _D + _D * _V + 256 * _V + _D,
    # LiLiCorr at 8B: DFlash's, plus a 2-layer correlator over 7 x 8 candidates (counted as two width-d attention +
    # MLP blocks: an upper bound, the PR's correlator is narrower).
    "lilicorr": 2 * _LAYER_8B + 5 * _D * _D + _D * _V + 2 * (4 * _D * _D + 2 * 4 * _D * _D),
    # DSpine at 8B: DFlash's, plus the transfer codes (rank 1024 over the vocabulary: the 16 candidates' rows of a
    # slot and its predecessor's, read per slot) and the message projections (d -> 512 -> d) of the injection.
    "dspine": 2 * _LAYER_8B + 5 * _D * _D + _D * _V + 7 * 17 * 1024 + 2 * _D * 512,
    # XPress at 8B: DFlash's, plus the refiner (rank-256 bottleneck d -> 256, a SwiGLU MLP 256 -> 512 -> 256, the
    # rank-256 readout over the vocabulary), read once per Jacobi pass: 6 passes a round (counted here, as one
    # forward of the backbone: the rows' draft forwards a round stay the backbone's one).
    "xpress": 2 * _LAYER_8B + 5 * _D * _D + _D * _V + 6 * (_D * 256 + 3 * 256 * 512 + 256 * _V),
    # An independent draft for an 8B target: a Llama-3.2-1B-like model (16 layers of d 2048, tied 128k head).
    "lm": 16 * (2048 * (2 * 2048 + 2 * 512) + 3 * 2048 * 8192) + 2048 * _V,
    # An MTP module at 8B: eh_proj (2d -> d), one decoder layer of the target's (counted dense: a shipped MoE one
    # reads only its active experts), the target's head (its shared_head.head is a copy).
    "mtp": 2 * _D * _D + _LAYER_8B + _D * _V,
    "prompt-lookup": 0,
}


@dataclass
class Recipe:
    """One drafter of the bench: how to train it (None: nothing to train) and how to load it for decoding.

    ``family`` keys COST_8B (the draft's step cost for an 8B target).
    """

    name: str
    train_args: Callable[[argparse.Namespace], list[str]] | None
    drafter: Callable[[Path | None, torch.nn.Module], object]
    family: str
    imports: str | None = None  # the recipe whose trained draft this one re-imports (nothing trained of its own)
    gamma: int | None = None  # the chain it is judged on (None: --gamma); trees keep the tree's depth
    regen: bool = False  # trains on regenerated data (``regenerate``: the target's own greedy answers)
    after: str | None = None  # the recipe whose trained run this one starts from (trained first, in this invocation
    # or an earlier one with the same --out)
    probe_as: str | None = None  # the recipe whose probed step time this one's budget is sized with (the same step)


def _glide_args(loss: str, regen: bool = False, ttt_steps: int = 1, layout: str = "treadle"):
    def args_for(args) -> list[str]:
        return [*_data_args(args, regen), "--draft.kind=glide", f"--draft.target={args.target}",
                f"--draft.loss={loss}", f"--draft.gamma={args.gamma}", f"--draft.ttt_steps={ttt_steps}",
                f"--draft.layout={layout}"]
    return args_for


def _eagle3_args(args) -> list[str]:
    # A 2048-token head (the bench target's 8192 cut to the most frequent training tokens) and an unroll as long
    # as the gamma-4 chain it is judged on, as configs/demo-eagle3.toml.
    return [*_data_args(args, False), "--draft.kind=eagle3", f"--draft.target={args.target}", "--draft.loss=kl",
            f"--draft.gamma={args.gamma}", "--draft.vocab_size=2048", f"--draft.ttt_steps={args.gamma}"]


DFLASH_BLOCK = 8  # the anchor + 7 mask slots: one draft forward proposes 7 tokens (configs/demo-dflash.toml's)
DSPARK_BLOCK = 7  # every slot drafts (the anchor's too): the same 7 tokens a forward (DeepSpec's block)
# The frontier suite's rank for DSpark's Markov head and DFlash2's selector: 256 at Qwen3's 152k vocabulary, 64 at
# the bench target's 8192 (configs/demo-dspark.toml's; at 256 the two [8192, 256] tables would outweigh the backbone).
FRONTIER_RANK = 64


def _block_args(kind: str, block_size: int, *extra: str):
    """A block draft's recipe: two draft layers (z-lab's are 5 at 8B), slot k weighed exp(-(k - 1) / 4) (the paper's
    choice at block 8), anchors = 32 (every position of a 256-token row anchors a block about once), kl, tau_sim over
    the block's 7 drafts; ``extra``: the kind's own keys."""
    def args_for(args) -> list[str]:
        return [*_data_args(args, False), f"--draft.kind={kind}", f"--draft.target={args.target}", "--draft.loss=kl",
                f"--draft.block_size={block_size}", "--draft.num_layers=2", "--draft.slot_gamma=4",
                "--draft.anchors=32", f"--draft.gamma={FRONTIER_GAMMA}", *extra]
    return args_for


FRONTIER_GAMMA = 7  # every block kind drafts 7 tokens a round; EAGLE-3 a chain of 7 in the frontier suite
_dflash_args = _block_args("dflash", DFLASH_BLOCK)


def _lm_args(args) -> list[str]:
    return [*_data_args(args, False), f"--model.overrides={LM_DRAFT}"]


def _data_args(args, regen: bool) -> list[str]:
    if regen or args.regen_all:  # the frontier suite trains every recipe on the regenerated data
        return [f'--data.sources=[{{name="regen",path="{args.regen}"}}]', "--data.val=builtin"]
    return [f"--data.train={args.data}", "--data.val=builtin"]


def as_trained_elsewhere(run: Path, out: Path, target_dir: Path) -> Path:
    """``run``'s EAGLE-3 export rewritten as another trainer ships one (SpecForge, EAGLE's: ``layers.0.*`` names,
    the target's embedding included, no ``t2d``, no treadle keys in config.json) into ``out``/draft: the draft a
    user imports with ``draft.init`` / ``spec-eval --draft``. Same weights, so its tau must be the original's."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src, dst = run / "draft", out / "draft"
    shutil.rmtree(out, ignore_errors=True)
    dst.mkdir(parents=True)
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in load_file(src / "model.safetensors").items() if k != "t2d"}
    # the one tensor read from the target's file (the bench target is a Llama), not the whole model built again
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        tensors["embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
    save_file(tensors, dst / "model.safetensors")
    config = {k: v for k, v in json.loads((src / "config.json").read_text()).items()
              if k not in ("treadle_draft_kind", "target", "target_config", "training")}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _glide(run, target):
    return GlideDrafter(load_glide(run / "draft", target))


def shipped_checkpoint(args) -> Path:
    """The bench target with an MTP head stitched in (the mtp-shipped run's draft/stitched/): a target that ships
    its head, as DeepSeek-V3 and GLM-4.5 checkpoints do."""
    return args.out / "mtp-shipped" / "draft" / STITCHED


def _mtp_args(loss: str, ttt_steps: int | None = None, regen: bool = False, shipped: bool = False):
    """An mtp draft (draft.kind = "mtp") on the bench target: a new module (treadle's ``init_new``), or with
    ``shipped`` the one the stitched checkpoint carries (draft.target = that checkpoint: treadle starts from the
    layer a target ships). ``ttt_steps`` None: the chain it is judged on (--gamma), as eagle3's unroll."""
    def args_for(args) -> list[str]:
        target = shipped_checkpoint(args) if shipped else args.target
        return [*_data_args(args, regen), "--draft.kind=mtp", f"--draft.target={target}", f"--draft.loss={loss}",
                f"--draft.gamma={args.gamma}", f"--draft.ttt_steps={ttt_steps or args.gamma}"]
    return args_for


def _mtp(run, target):
    return MtpDrafter(load_mtp(run / "draft", target))


def _mtp_shipped(run, target):
    # read from the stitched checkpoint (model.layers.{N}.*), as a serving engine reads a target's own head
    return MtpDrafter(load_mtp(run / "draft" / STITCHED, target))


RECIPES = [
    Recipe("glide-kl", _glide_args("kl"), _glide, "glide"),
    Recipe("glide-ce", _glide_args("ce"), _glide, "glide"),
    Recipe("glide-kl-ttt", _glide_args("kl", ttt_steps=3), _glide, "glide"),  # the training-time test, 3 steps
    Recipe("glide-kl-regen", _glide_args("kl", regen=True), _glide, "glide", regen=True),
    # LongSpec's layer (draft.layout = "longspec": biased q/k/v, 512-token window, no final norm), vs glide-kl's.
    Recipe("glide-kl-longspec", _glide_args("kl", layout="longspec"), _glide, "glide"),
    Recipe("eagle3", _eagle3_args, lambda run, target: Eagle3Drafter(load_eagle3(run / "draft", target)), "eagle3"),
    # eagle3's draft as another trainer ships it, imported (tau must equal eagle3's): needs eagle3 in the same
    # invocation or an earlier one's record (--reuse-trained)
    Recipe("eagle3-imported", None, lambda run, target: Eagle3Drafter(load_eagle3(run / "draft", target)), "eagle3",
           imports="eagle3"),
    Recipe("dflash", _dflash_args, lambda run, target: DFlashDrafter(load_dflash(run / "draft", target)), "dflash",
           gamma=DFLASH_BLOCK - 1),
    # The frontier suite's block kinds (issue 41), each loaded from its export as spec-eval loads it; decoded at the
    # block's 7 drafts. DFlash2: DFlash plus grouped in-block convolutions and the selector's walk through 16
    # candidates a slot; DSpark: its Markov head and confidence head (no early stop: both engines default to the
    # whole block); LiLiCorr: DFlash's backbone and a 2-layer correlator over 8 candidates a slot, trained jointly
    # (ModelOpt PR #2342's default); lilicorr-conv: the same on DFlash2's convolving backbone (the paper's best row).
    Recipe("dflash2", _block_args("dflash2", DFLASH_BLOCK, f"--draft.selector_rank={FRONTIER_RANK}"),
           lambda run, target: exported_drafter(run / "draft", target), "dflash2", gamma=FRONTIER_GAMMA),
    Recipe("dspark", _block_args("dspark", DSPARK_BLOCK, f"--draft.markov_rank={FRONTIER_RANK}"),
           lambda run, target: exported_drafter(run / "draft", target), "dspark", gamma=FRONTIER_GAMMA),
    Recipe("lilicorr", _block_args("lilicorr", DFLASH_BLOCK),
           lambda run, target: exported_drafter(run / "draft", target), "lilicorr", gamma=FRONTIER_GAMMA),
    Recipe("lilicorr-conv", _block_args("lilicorr", DFLASH_BLOCK, "--draft.conv_group_size=16"),
           lambda run, target: exported_drafter(run / "draft", target), "lilicorr", gamma=FRONTIER_GAMMA),
    # Issue 50's two: DSpine (DFlash's backbone with adjacent causal injection, 16 candidates a slot: SpecForge's
    # default) and XPress (DFlash's backbone and speculators' refiner, 6 Jacobi passes a round), block 8 as DFlash.
    Recipe("dspine", _block_args("dspine", DFLASH_BLOCK),
           lambda run, target: exported_drafter(run / "draft", target), "dspine", gamma=FRONTIER_GAMMA),
    Recipe("xpress", _block_args("xpress", DFLASH_BLOCK),
           lambda run, target: exported_drafter(run / "draft", target), "xpress", gamma=FRONTIER_GAMMA),
    Recipe("lm", _lm_args, lambda run, target: ModelDrafter(load_causal_lm(run / "hf", "lm draft"), name="lm"), "lm"),
    Recipe("prompt-lookup", None, lambda run, target: PromptLookupDrafter(), "prompt-lookup"),
    # MTP heads (a target with an MTP layout: --suite mtp). mtp: a new module trained against the frozen target,
    # as glide-kl (kl, built-in corpus), its recursive unroll as deep as the chain it is judged on.
    Recipe("mtp", _mtp_args("kl"), _mtp, "mtp"),
    # The shipped head, a proxy: trained as pretraining trains an MTP module (one step, hard-label CE on the corpus,
    # DeepSeek-V3's D = 1), but after the trunk and against it frozen; judged from the stitched checkpoint ("before").
    Recipe("mtp-shipped", _mtp_args("ce", ttt_steps=1), _mtp_shipped, "mtp"),
    # ... then fine-tuned by treadle from the checkpoint that ships it ("after"): the target's own greedy answers
    # (regenerated data) and kl, the recursive unroll as mtp's (FastMTP's; research/frontier-2026-11.md §1.3-1.4).
    Recipe("mtp-shipped-ft", _mtp_args("kl", regen=True, shipped=True), _mtp, "mtp", regen=True,
           after="mtp-shipped", probe_as="mtp"),
]
DEFAULT = "glide-kl,glide-ce,glide-kl-ttt,eagle3,dflash,lm,prompt-lookup"
MODES = {
    "chain": dict(),
    "tree": dict(tree=TREE),
    "dynamic": dict(tree=DYNAMIC),
    "t1": dict(temperature=1.0),
    "tree-t1": dict(tree=TREE, temperature=1.0),
    "dynamic-t1": dict(tree=DYNAMIC, temperature=1.0),
}
# The frontier suite's drafters: EAGLE-3 and every block kind this treadle has (registry.KINDS): a kind merged later
# (issue 50's dspine, xpress) joins the suite's default list by itself.
FRONTIER = ",".join(name for name in ("eagle3", "dflash", "dflash2", "dspark", "lilicorr", "dspine", "xpress")
                    if name in KINDS)
# --suite: the bench's target and recipes. spec: the Llama bench target and every drafter kind it takes (the
# default); mtp: a GLM-4-MoE bench target (MTP heads need a family with an MTP layout) with MTP heads beside GLIDE.
# An MTP drafter decodes chains only (a tree falls back to a chain of its depth), so that suite's modes are chains.
SUITES = {
    "spec": dict(target_config=BENCH_TARGET, target="runs/bench-target", out="runs/bench-spec", only=DEFAULT,
                 modes=",".join(MODES)),
    "mtp": dict(target_config=Path("configs/bench-target-mtp.toml"), target="runs/bench-target-mtp",
                out="runs/bench-spec-mtp", only="mtp,glide-kl,mtp-shipped,mtp-shipped-ft", modes="chain,t1"),
    # frontier: every block kind and EAGLE-3 on one contract (the module docstring): regenerated data for all,
    # sampled at T = 1, chains of 7 greedy and at T = 1.
    "frontier": dict(target_config=BENCH_TARGET, target="runs/bench-target", out="runs/bench-spec-frontier",
                     only=FRONTIER, modes="chain,t1", gamma=FRONTIER_GAMMA,
                     regen_all=True, regen_temperature=1.0),
}
# What a flag is when neither it nor the suite nor --quick sets it.
DEFAULTS = dict(gamma=4, prompts=8, max_new_tokens=64, probe_steps=6, regen_prompts=512, regen_new_tokens=192,
                regen_all=False, regen_temperature=0.0, target_steps=None, steps=None)
# --quick: a smoke run (every step of the pipeline, tiny sizes); explicit flags still win.
QUICK = dict(target_steps=30, steps=3, probe_steps=2, prompts=2, max_new_tokens=16, regen_prompts=16,
             regen_new_tokens=32)


def regenerate(args) -> Path:
    """Train-split prompts answered by the target (greedily, or sampled at ``--regen-temperature``): an SFT file of
    the target's own outputs (cached)."""
    sampled = f"-t{args.regen_temperature:g}" if args.regen_temperature else ""
    out = args.out / f"regen-{args.regen_prompts}x{args.regen_new_tokens}{sampled}.jsonl"
    prompts = args.out / f"regen-prompts-{args.regen_prompts}.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(Path(args.target), "--target"))
    windows = train_windows(tokenizer, args.regen_prompts, args.prompt_len)
    args.out.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"prompt": tokenizer.decode(w)}) + "\n" for w in windows)
    if not prompts.is_file() or prompts.read_text() != text:  # left alone when unchanged: another invocation with
        prompts.write_text(text)  # the same --out may be reading it (--train-only runs side by side)
    # Resumable: a finished file is only read back (every row skipped), an interrupted one is continued.
    subprocess.run([sys.executable, "-m", "treadle", "generate", "--model", str(args.target), "--prompts", str(prompts),
                    "--out", str(out), "--max-new-tokens", str(args.regen_new_tokens), "--batch-size", "64",
                    "--temperature", str(args.regen_temperature)], check=True)
    return out


def train_windows(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompt windows from the built-in corpus' *train* split (the eval prompts come from val)."""
    files = [path for rel, path in corpus_files() if split_of(rel) == "train"]
    random.Random(0).shuffle(files)
    windows = []
    for path in files:
        ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        windows += [ids[s : s + prompt_len] for s in range(0, len(ids) - prompt_len, 4 * prompt_len)][:4]
        if len(windows) >= n:
            return windows[:n]
    return windows


def bench_target(args, *overrides: str) -> Path:
    """The suite's target config's run (configs/bench-target.toml's by default), trained once (an interrupted run
    resumes from its checkpoint); ``overrides``: more --key=value settings (a smoke run's lighter evaluation)."""
    steps = [f"--train.max_steps={args.target_steps}"] if args.target_steps else []
    cfg = load_config(args.target_config, [f"--train.output_dir={args.target}", *steps, *overrides])
    if not any((Path(args.target) / sub / "config.json").is_file() for sub in ("hf", ".")):  # a run, or an HF dir
        print(f"training the bench target ({args.target_config}) into {args.target} ...", file=sys.stderr, flush=True)
        run_training(cfg, live=False)
    return Path(args.target)


def _train(args, recipe: Recipe, name: str, steps: int, eval_every: int) -> object:
    out = args.out / name
    shutil.rmtree(out, ignore_errors=True)  # each bench run trains from scratch
    common = [
        f"--train.output_dir={out}", f"--train.max_steps={steps}", "--train.micro_batch_size=8",
        "--data.seq_len=256", f"--train.threads={1 if args.budget == 'cpu' else 2}",
        # about 20 loss points a run: enough to see whether the loss has flattened (metrics.jsonl)
        f"--train.log_every={max(1, steps // 20)}",
        f"--train.eval_every={eval_every}", "--train.eval_batches=4", "--schedule.warmup_proportion=0.1",
        "--optim.lr=3e-3", "--checkpoint.resume=none", "--checkpoint.every_minutes=0",
        # compile = auto would decide per run length: off for the short probe, maybe on for the real run, whose
        # step time would then not be the one the budget was sized with.
        "--model.compile=false",
        # dtype = auto measures bf16 against fp32 per run on a loaded machine (not cached there): two kinds, or a
        # probe and its run, could then train at different precisions and step costs. bf16 (autocast over fp32
        # weights) is what auto picks on this bench's CPUs when quiet.
        "--model.dtype=bf16",
    ]
    return run_training(load_config(None, common + recipe.train_args(args)), live=False)


def probe(args, recipe: Recipe) -> float:
    """Seconds per training step of ``recipe``: wall seconds from a short run, or with ``--budget cpu`` this process's
    CPU seconds per step from two runs (probe_steps and twice that; their difference leaves start-up out). CPU time
    hardly moves when other jobs share the cores, where wall time can change several-fold between two probes."""
    if args.budget == "wall":
        summary = _train(args, recipe, f"{recipe.name}-probe", args.probe_steps, eval_every=0)
        shutil.rmtree(args.out / f"{recipe.name}-probe", ignore_errors=True)
        return TOKENS_PER_STEP / summary.tokens_per_s
    cpu = []
    for steps in (args.probe_steps, 2 * args.probe_steps):
        start = time.process_time()
        _train(args, recipe, f"{recipe.name}-probe", steps, eval_every=0)
        cpu.append(time.process_time() - start)
        shutil.rmtree(args.out / f"{recipe.name}-probe", ignore_errors=True)
    return (cpu[1] - cpu[0]) / args.probe_steps


def load_scale(args, names: list[str], recipes: dict) -> float:
    """Recorded over current step cost of a drafter trained by an earlier invocation (the first of ``names`` reused
    with ``--reuse-trained``), probed again now: the factor that puts this invocation's probes on the earlier ones'
    footing. CPU seconds a step still rise with the load (caches and cores shared), so drafters added to a table
    later (``--only dflash,dspine,xpress --reuse-trained``: dflash the reference) get the budget the earlier ones got.
    1.0 when no drafter is reused."""
    for name in names:
        record = args.out / f"{name}.train.json"
        if args.reuse_trained and record.is_file() and recipes[name].train_args and not recipes[name].imports:
            recorded = json.loads(record.read_text()).get("probe_step_s")
            if recorded:
                now = probe(args, recipes[name])
                print(f"load reference {name}: {recorded:.3f} {args.budget} s/step when trained, {now:.3f} now: "
                      f"probes scaled by {recorded / now:.2f}", file=sys.stderr, flush=True)
                return recorded / now
    return 1.0


def train(args, recipe: Recipe, step_s: float) -> dict:
    """Train for about ``args.train_seconds`` (wall, or CPU with ``--budget cpu``) at ``step_s`` a step."""
    # --steps: the same step count for every drafter, for a machine others share (a probe's step time there is
    # not the run's); the probe's step time is still reported, so equal steps can be read as equal wall time only
    # where the recipes' step times are equal.
    steps = args.steps or max(args.probe_steps, int(args.train_seconds / step_s))
    print(f"training {recipe.name}: {step_s:.2f} {args.budget} s/step in the probe -> {steps} steps", file=sys.stderr,
          flush=True)
    start = time.process_time()
    summary = _train(args, recipe, recipe.name, steps, eval_every=steps)
    # train_s: the steps' time at the run's own pace (the budget spent); wall_s adds its start and evaluations.
    return {"probe_step_s": step_s, "budget": args.budget, "trainable_params": summary.parameters,
            "train_s": TOKENS_PER_STEP * steps / summary.tokens_per_s, "cpu_s": time.process_time() - start,
            "wall_s": summary.elapsed_s, "steps": steps,
            "train_tokens_per_s": summary.tokens_per_s, "run": str(args.out / recipe.name)}


def params_read(model: torch.nn.Module) -> int:
    """Parameters a batch-1 decode step reads: all but the input embedding (one row), the LM head counted."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return total - embedding.numel() + (head.numel() if head is embedding else 0)


def draft_step_params(recipe: Recipe, drafter, target) -> int:
    if recipe.family == "glide":
        return sum(p.numel() for p in drafter.model.draft_model.parameters()) + target.get_output_embeddings().weight.numel()
    if recipe.family == "eagle3":
        return sum(p.numel() for p in drafter.model.draft_model.parameters())  # own head; the embedding is one row
    if recipe.family in ("dflash", "dflash2", "dspark", "lilicorr", "dspine", "xpress"):
        # its layers and fc (and the kind's own heads), and the target's head it scores the block with
        return sum(p.numel() for p in drafter.model.draft_model.parameters()) + target.get_output_embeddings().weight.numel()
    if recipe.family == "lm":
        return params_read(drafter.model)
    if recipe.family == "mtp":  # the module (its active experts only) and the target's head
        module = drafter.model.draft_model
        experts = module.mtp_block.mlp.experts if hasattr(module.mtp_block.mlp, "experts") else None
        idle = 0
        if experts is not None:
            c = module.config
            idle = sum(p.numel() for p in experts.parameters()) * (1 - c.num_experts_per_tok / c.n_routed_experts)
        return sum(p.numel() for p in module.parameters()) - int(idle) + target.get_output_embeddings().weight.numel()
    return 0


def distinct_n(outputs: list[list[int]], n: int) -> float:
    """Distinct n-grams / n-grams within each output, averaged: near 1 for text that does not repeat, low for loops."""
    rates = []
    for tokens in outputs:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        if grams:
            rates.append(len(set(grams)) / len(grams))
    return sum(rates) / len(rates)


def real_continuations(tokenizer, prompts: list[list[int]], length: int) -> list[list[int]]:
    """What follows each held-out prompt in its val file: the text a target that does not loop should resemble."""
    docs = [tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
            for rel, path in corpus_files() if split_of(rel) == "val"]
    found = []
    for prompt in prompts:
        for ids in docs:
            at = next((s for s in range(len(ids) - len(prompt) + 1) if ids[s : s + len(prompt)] == prompt), None)
            if at is not None:
                found.append(ids[at + len(prompt) : at + len(prompt) + length])
                break
    return found


def repetition(prompts: list[list[int]], outputs: list[list[int]], gamma: int) -> dict:
    """distinct-1/2/3 of ``outputs`` and prompt lookup's tau over them (model-free: how much repetition a drafter
    could exploit without learning anything)."""
    n = min(map(len, outputs))
    texts = torch.tensor([p + o[:n] for p, o in zip(prompts, outputs)])
    return {**{f"distinct_{k}": distinct_n(outputs, k) for k in (1, 2, 3)},
            "lookup_tau": lookup_tau(texts, len(prompts[0]), gamma)}


def loops_of(args, model_dir: Path):
    """(model, tokenizer, held-out prompts, loop check): how much the model's greedy outputs and T = 1 samples
    repeat themselves, and the real continuations of the same prompts."""
    target = load_causal_lm(model_dir, "--target")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_dir, "--target"))
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_len)
    greedy = [target_generate(target, torch.tensor([p]), args.max_new_tokens, tokenizer.eos_token_id)[0] for p in prompts]
    sampled = [target_generate(target, torch.tensor([p]), args.max_new_tokens, tokenizer.eos_token_id,
                               Sampler(1.0, generator=torch.Generator().manual_seed(i)))[0]
               for i, p in enumerate(prompts)]
    loops = {"target": repetition(prompts, greedy, args.gamma), "target_t1": repetition(prompts, sampled, args.gamma),
             "real": repetition(prompts, real_continuations(tokenizer, prompts, args.max_new_tokens), args.gamma)}
    return target, tokenizer, prompts, loops


def loop_check(args, model_dirs: list[str]) -> int:
    print("| model | greedy distinct-1 / 2 / 3 | greedy lookup tau | T = 1 distinct-1 / 2 / 3 | T = 1 lookup tau |")
    print("|---|---|---|---|---|")
    for model_dir in model_dirs:
        loops = loops_of(args, Path(model_dir))[3]
        cells = [f"{r['distinct_1']:.2f} / {r['distinct_2']:.2f} / {r['distinct_3']:.2f} | {r['lookup_tau']:.2f}"
                 for r in (loops["target"], loops["target_t1"])]
        print(f"| {model_dir} | {' | '.join(cells)} |")
    real = loops["real"]
    print(f"| the real continuations | {real['distinct_1']:.2f} / {real['distinct_2']:.2f} / {real['distinct_3']:.2f} "
          f"| {real['lookup_tau']:.2f} | | |")
    return 0


def settings(args) -> dict:
    """What makes rows of two invocations comparable (one table)."""
    return {k: str(getattr(args, k)) for k in ("target", "data", "train_seconds", "budget", "steps", "gamma", "prompts",
                                               "prompt_len", "max_new_tokens", "target_steps", "regen_all",
                                               "regen_temperature")}


def merged(args, rows: list[dict], retrained: set[str]) -> list[dict]:
    """``rows`` plus the rows of runs/bench-spec/results.json that they do not replace, when its settings are the
    same: the table grows over several invocations. A drafter trained anew drops all its old rows; one reused
    (``--reuse-trained``) only those of the modes decoded again. Sorted as RECIPES and MODES."""
    path = args.out / "results.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    if old.get("settings") == settings(args):
        new = {(r["drafter"], r["mode"]) for r in rows}
        rows = [r for r in old["rows"] if r["drafter"] not in retrained and (r["drafter"], r["mode"]) not in new] + rows
    order = {r.name: i for i, r in enumerate(RECIPES)}
    return sorted(rows, key=lambda r: (order.get(r["drafter"], len(order)), list(MODES).index(r["mode"])
                                       if r["mode"] in MODES else len(MODES)))


def _cells(values) -> str:
    return ", ".join("n/a" if v is None else f"{v:.2f}" for v in values or [])


def frontier_table(rows: list[dict]) -> None:
    """The matched table of --suite frontier: per drafter, its chain greedy beside T = 1, acceptance by position
    within the block (conditional: slot k accepted given slots 1..k-1 were), the expected acceptance length
    1 + sum_k prod_{i<=k} acc_i (tokens a round, the bonus included) and tau at T = 1 over EAGLE-3's."""
    by = {(r["drafter"], r["mode"]): r for r in rows}
    base = by.get(("eagle3", "t1"))
    print("\n| drafter | params | steps | train s (CPU) | tau greedy | tau T = 1 | T = 1 vs EAGLE-3 | c | draft fwd / "
          "round | cost / round | acceptance by block position, greedy (k=1..) | acceptance by block position, T = 1 | "
          "expected acceptance length, greedy / T = 1 | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["drafter"] for r in rows):
        greedy, t1 = by.get((name, "chain")), by.get((name, "t1"))
        any_row = greedy or t1

        def tau(r):
            return "-" if r is None else f"{r['tau']:.2f}"

        def length(r):
            return "-" if r is None or r.get("expected_accepted") is None else f"{1 + r['expected_accepted']:.2f}"

        ratio = f"{t1['tau'] / base['tau']:.2f}x" if t1 and base else "-"
        # the draft's decode cost a round in target steps: its forwards a round (a chain: 7; a block: 1) x c
        forwards = any_row.get("draft_forwards_per_round") or any_row["gamma"]
        cpu = f" ({any_row['cpu_s']:.0f})" if any_row.get("cpu_s") else ""
        print(f"| {name} | {any_row['trainable_params'] / 1e6:.2f}M | {any_row['steps']} | "
              f"{any_row['train_s']:.0f}{cpu} | "
              f"{tau(greedy)} | {tau(t1)} | {ratio} | {any_row['cost_ratio']:.3f} | {forwards:.1f} | "
              f"{forwards * any_row['cost_ratio']:.2f} | "
              f"{_cells(greedy and greedy['acceptance_conditional'])} | {_cells(t1 and t1['acceptance_conditional'])} | "
              f"{length(greedy)} / {length(t1)} | {greedy['lossless'] if greedy else '-'} |")


def projected(tau: float, forwards: float, c: float) -> float:
    """tau per verification call over its cost in target steps: the verify forward (about one step, memory-bound)
    plus ``forwards`` draft forwards of cost ``c`` each."""
    return tau / (1 + forwards * c)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=list(SUITES), default="spec",
                        help="spec: the Llama bench target and its drafters; mtp: MTP heads beside GLIDE on a GLM-4-MoE "
                             "bench target (configs/bench-target-mtp.toml); frontier: the block drafts (" + FRONTIER +
                             ") on one contract, 7 drafts a round, all on "
                             "regenerated data (--target, --out, --only, --modes, --gamma default to the suite's)")
    parser.add_argument("--target-steps", type=int,
                        help="train the suite's target this many steps instead of its config's (name a --target of "
                             "its own: an existing target directory is reused as it is)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()) +
                             ", --target and --out under runs/bench-quick-<suite> (explicit flags win)")
    parser.add_argument("--target", help="where the suite's target config's run lives (spec: runs/bench-target)")
    parser.add_argument("--data", default="builtin", help="draft training data: shard dir or 'builtin'")
    parser.add_argument("--train-seconds", type=float, default=150.0, help="training time per drafter (--budget)")
    parser.add_argument("--budget", choices=["wall", "cpu"], default="wall",
                        help="what --train-seconds counts: wall time (an idle machine; 2 training threads), or "
                             "this process's CPU time (a machine others share; 1 training thread, so no thread waits "
                             "spinning on another)")
    parser.add_argument("--steps", type=int, default=None, help="train every drafter this many steps instead of --train-seconds")
    parser.add_argument("--probe-steps", type=int, help="steps of the run that measures a recipe's step time")
    parser.add_argument("--gamma", type=int, help="chain length of the drafters without a block (spec, mtp: 4; "
                        "frontier: 7)")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--only", help=f"recipes, of {', '.join(r.name for r in RECIPES)} (spec: {DEFAULT})")
    parser.add_argument("--modes", help=f"decoding modes, of {', '.join(MODES)} (spec: all)")
    parser.add_argument("--regen-prompts", type=int,
                        help="glide-kl-regen, mtp-shipped-ft: prompts the target answers")
    parser.add_argument("--regen-new-tokens", type=int,
                        help="glide-kl-regen, mtp-shipped-ft: tokens per answer")
    parser.add_argument("--regen-temperature", type=float,
                        help="the regenerated answers' sampling temperature (0 = greedy; frontier: 1, else 0)")
    parser.add_argument("--out", type=Path, help="results and trained drafters (spec: runs/bench-spec)")
    parser.add_argument("--loop-check", nargs="+", metavar="MODEL_DIR",
                        help="only print the loop check of these models (e.g. exported checkpoints of a target)")
    parser.add_argument("--reuse-trained", action="store_true",
                        help="decode with drafters an earlier invocation trained (same --out) instead of retraining")
    parser.add_argument("--train-only", action="store_true",
                        help="train (and record) the drafters, decode none: several invocations with the same --out "
                             "can train recipes side by side, one --reuse-trained invocation decodes them all")
    args = parser.parse_args()
    suite = SUITES[args.suite]
    args.target_config = suite["target_config"]
    quick = {**QUICK, "target": f"runs/bench-quick-{args.suite}/target", "out": Path(f"runs/bench-quick-{args.suite}")}
    defaults = {**DEFAULTS, **{k: v for k, v in suite.items() if k != "out"}, "out": Path(suite["out"]),
                **(quick if args.quick else {})}
    for key, value in defaults.items():  # a flag given wins over --quick, which wins over the suite's and the default
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    recipes = {r.name: r for r in RECIPES}
    names, modes = args.only.split(","), args.modes.split(",")
    for name in names:
        if name not in recipes:
            parser.error(f"--only {name}: not a recipe ({', '.join(recipes)})")
        after = recipes[name].after
        if after and after not in names[: names.index(name)] and not (args.out / f"{after}.train.json").is_file():
            parser.error(f"--only {name}: starts from {after}'s trained run; name {after} before it (or run it first "
                         "with the same --out)")
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.loop_check:
        return loop_check(args, args.loop_check)

    bench_target(args)
    args.regen = regenerate(args) if args.regen_all or any(recipes[n].regen for n in names) else None
    trained, retrained = {}, set()
    # Every recipe that trains is probed first, back to back: on a machine whose load changes, probes taken one
    # right after another compare the recipes' step times under the same load (the budget is shared fairly).
    # A recipe whose step is another's (probe_as: the same module and objective, another start or data) is sized with
    # that one's probe; it needs a run to start from that does not exist before training.
    probed = [recipes[name].probe_as or name for name in names
              if recipes[name].train_args and not recipes[name].imports
              and not (args.reuse_trained and (args.out / f"{name}.train.json").is_file())]
    scale = load_scale(args, names, recipes) if probed else 1.0
    step_s = {name: probe(args, recipes[name]) * scale for name in dict.fromkeys(probed)}
    for name in names:
        recipe, record = recipes[name], args.out / f"{name}.train.json"
        if recipe.imports:
            source = trained.get(recipe.imports) or json.loads((args.out / f"{recipe.imports}.train.json").read_text())
            trained[name] = {**source, "run": str(as_trained_elsewhere(
                Path(source["run"]), args.out / name, resolve_model_dir(Path(args.target), "--target")))}
        elif args.reuse_trained and record.is_file():
            trained[name] = json.loads(record.read_text())  # decode again (e.g. in new modes) without retraining
        elif recipe.train_args:
            trained[name] = train(args, recipe, step_s[recipe.probe_as or name])
            retrained.add(name)
            record.write_text(json.dumps(trained[name]) + "\n")
        else:
            trained[name] = {"trainable_params": 0, "train_s": 0.0, "wall_s": 0.0, "steps": 0,
                             "train_tokens_per_s": None, "run": None}

    if args.train_only:
        return 0
    target, tokenizer, prompts, loops = loops_of(args, Path(args.target))
    target_params = params_read(target)
    rows = []
    for name in names:
        recipe = recipes[name]
        run = Path(trained[name]["run"]) if trained[name]["run"] else None
        drafter = recipe.drafter(run, target)
        c = draft_step_params(recipe, drafter, target) / target_params
        c_8b = COST_8B[recipe.family] / TARGET_8B
        for mode in modes:
            gamma = recipe.gamma if recipe.gamma and "tree" not in MODES[mode] else args.gamma
            got = evaluate_drafter(target, drafter, prompts, gamma, args.max_new_tokens, tokenizer.eos_token_id,
                                   **MODES[mode])
            # The draft forwards a round runs in a row, as counted (a chain of one-token drafts: its length; a
            # DFlash block: 1); the tree's depth for a drafter without a model.
            forwards = got["draft_forwards_per_round"] or got["gamma"]
            rows.append({"drafter": name, "mode": mode, **trained[name], "cost_ratio": c, "cost_ratio_8b": c_8b,
                         "projected_speedup": projected(got["tau"], forwards, c),
                         "projected_speedup_8b": projected(got["tau"], forwards, c_8b),
                         **{k: got[k] for k in ("gamma", "tau", "acceptance_conditional", "acceptance_unconditional",
                                                "expected_accepted", "tau_by_position", "draft_forwards_per_round",
                                                "tokens_per_s_spec", "tokens_per_s_target", "speedup", "lossless")}})

    # Invocations decoding side by side with the same --out (one per recipe) merge their rows in turn.
    with open(args.out / "results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = merged(args, rows, retrained)
        f2 = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731  (a reused run's loop check may be unset)
        print(f"\nspec bench: target {args.target}; " + "; ".join(
              f"{who}: distinct-1/2/3 {f2(r['distinct_1'])} / {f2(r['distinct_2'])} / {f2(r['distinct_3'])}, "
              f"lookup tau {f2(r['lookup_tau'])}" for who, r in (("its greedy outputs", loops["target"]),
                                                                  ("its T = 1 samples", loops["target_t1"]),
                                                                  ("the real continuations", loops["real"]))))
        budget = f"{args.steps} steps" if args.steps else f"{args.train_seconds:.0f} {args.budget} s"
        print(f"gamma {args.gamma}, tree {','.join(map(str, TREE))}, dynamic tree {DYNAMIC}, "
              f"{args.prompts} held-out prompts x {args.max_new_tokens} new tokens; "
              f"{budget} of training per drafter (8 x 256 tokens per step); "
              f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
        print("| drafter | mode | gamma | trainable params | steps | probe s/step | train s | tau | "
              "acceptance (conditional, k=1..) | sum_k prod acc | tau by output position (per 64 tokens) | "
              "draft fwd / round | spec tok/s | "
              "target tok/s | speedup | c | projected | c (8B) | projected (8B) | lossless |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            acc = ", ".join(f"{a:.2f}" if a is not None else "n/a" for a in r["acceptance_conditional"])
            lossless = "n/a (sampled)" if r["lossless"] is None else r["lossless"]
            by_position = ", ".join(f"{t:.2f}" for t in r.get("tau_by_position") or [])
            forwards = r.get("draft_forwards_per_round")
            print(f"| {r['drafter']} | {r['mode']} | {r.get('gamma', args.gamma)} | "
                  f"{r['trainable_params'] / 1e6:.2f}M | "
                  f"{r['steps']} | {r.get('probe_step_s') or 0:.3f} | {r['train_s']:.0f} | {r['tau']:.2f} | {acc} | "
                  f"{r.get('expected_accepted') or 0:.2f} | {by_position} | "
                  f"{'-' if forwards is None else f'{forwards:.1f}'} | "
                  f"{r['tokens_per_s_spec']:.0f} | {r['tokens_per_s_target']:.0f} | "
                  f"{r['speedup']:.2f}x | {r['cost_ratio']:.3f} | {r['projected_speedup']:.2f}x | "
                  f"{r['cost_ratio_8b']:.3f} | "
                  f"{r['projected_speedup_8b']:.2f}x | {lossless} |")
        if args.suite == "frontier":
            frontier_table(rows)
        (args.out / "results.json").write_text(json.dumps({"settings": settings(args), "target_loops": loops,
                                                           "rows": rows}, indent=2) + "\n")
        return 0 if all(r["lossless"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
