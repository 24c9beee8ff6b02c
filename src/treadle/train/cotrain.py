"""A draft trained beside its target, in the target's own step (``draft.target = "self"``).

The target's training forward already computes what a draft reads (drafts/run_model.py: the fused features, the final
hidden state its head reads). ``DraftBeside`` taps them there, with the taps the kinds use, and hands them to the
kind's objective as a feature store would (``target.*`` batch keys): no second target forward. It owns the draft,
its objective, its own AdamW and schedule, and the draft's tensors in the run's checkpoints.

The loop does not know: the step's loss function is ``BesideLoss`` (the target's loss, the draft's loss beside it);
the draft's update is a step callback (``DraftStepCallback``, before the metrics are logged); its weights and
optimizer ride in the checkpoint as a companion of the engine's (checkpoint/manager.py), so a resume and a rollback
restore them with the target's; its acceptance is an eval callback and its export follows the target's.

- Detached (``draft.joint = false``): the reads are detached and the target's parameters are frozen while the draft
  reads them (its embedding, its head as the teacher), and the draft's loss is backpropagated on its own graph at
  once: the target's step is the one it takes alone, bit for bit. The draft's gradients are loss sums, divided by
  the step's label tokens (the target's N, as a draft run divides) when the draft steps.
- Joint (``draft.joint = true``): the features keep their graph and ``draft.weight`` x the draft's loss joins the
  step's loss, so it reaches the trunk through the hidden states the draft reads (the teacher's distribution and
  the target's embedding and head stay inputs: the target is not pulled toward its draft).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from treadle.drafts.registry import kind
from treadle.drafts.run_model import READS_PREFIX
from treadle.drafts.targets import beside
from treadle.engine.optim import build_optimizer, build_schedule
from treadle.train.callbacks import Callback, ExportCallback
from treadle.train.draft import AcceptanceCallback, TTTAccuracyCallback, eval_prompts
from treadle.train.step import StepResult, split_loss

if TYPE_CHECKING:
    from treadle.config import Config
    from treadle.train.trainer import Trainer


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """``module``'s trainable parameters stop recording gradients inside the block (ops on them build no graph);
    what its earlier forward recorded is untouched, and the flags are back before any backward runs."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


class DraftBeside:
    """A draft of ``cfg.draft.kind`` beside ``target`` (a model being trained): the kind's run model around it, the
    kind's objective, the draft's own optimizer and schedule (peak lr ``draft.lr``, else ``optim.lr``; the run's
    warmup and decay), and ``state_dict`` / ``load_state_dict`` of its weights and optimizer (DCP's format)."""

    def __init__(self, cfg: Config, target: nn.Module, datasets, data_vocab: int, device: torch.device):
        d = cfg.draft
        found = kind(d.kind)
        with beside(target):  # the kind builds its draft around the run's model, which keeps training
            self.model, _, self.identity = found.build(d, data_vocab, None)
            self.objective = found.setup(cfg, self.model, datasets)
        self.target = target
        for child in self.model.children():  # the draft and its own buffers (rotary); the target moves with the run
            if child is not target:
                child.to(device)
        self.draft = self.model.draft_model
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.draft, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = d.lr or cfg.optim.lr
        self.schedule = build_schedule(self.optimizer, cfg)
        self.joint, self.weight, self.grad_clip = d.joint, d.weight, cfg.train.grad_clip

    def reading(self):
        """Inside the block, the target's forwards record what the draft reads; yields ``take()``."""
        return self.model.reading()

    def loss(self, batch: dict, reads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The draft's summed loss of a micro-batch from the target's ``reads`` of it, and its side sums."""
        kept = set(self.model.trunk_reads) if self.joint else set()  # what reaches the trunk (the kind says)
        reads = {k: v if k in kept else v.detach() for k, v in reads.items()}
        with frozen(self.target):  # its embedding and head feed the draft; never trained by the draft's loss
            summed, side = split_loss(self.objective(self.model, {**batch, **{READS_PREFIX + k: v
                                                                                for k, v in reads.items()}}))
        side.pop("target_loss", None)  # the target's own CE: the step's loss already
        return summed.sum(), side

    def step(self, reduce: Callable[[torch.Tensor], torch.Tensor], agree: Callable[[bool], bool], label_tokens: int,
             scaled: bool, loss_multiplier: float = 1) -> dict[str, float]:
        """The draft's update after the target's: gradients summed over data-parallel ranks (``reduce``: the draft
        is whole on each), divided by the step's label tokens unless the step's loss already was (``scaled``:
        joint; then by the factor the engine's backward multiplied that loss by, ``loss_multiplier``: DeepSpeed's
        world size, which it divides out of its own gradients only), clipped; skipped where not finite (``agree``:
        all ranks)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.flatten() for g in grads])
        flat = flat / loss_multiplier if scaled else flat / max(label_tokens, 1)
        flat = reduce(flat)
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).to(p.dtype)
            offset += g.numel()
        clip = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        lr = self.optimizer.param_groups[0]["lr"]
        applied = agree(math.isfinite(norm))
        if applied:
            self.optimizer.step()
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"draft_grad_norm": norm, "draft_lr": lr, "draft_skipped": float(not applied)}

    def state_dict(self) -> dict:
        from treadle.engine.local import trainable_state

        model_sd, optim_sd = trainable_state(self.draft, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from treadle.engine.local import _LOAD

        set_state_dict(self.draft, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_LOAD)

    def export(self, out_dir: Path, target_dir: Path | None, cfg, step: int | None = None,
               command: str = "train", extra: bool = True) -> Path:
        """The draft in its kind's serving layout, written atomically (``out_dir`` replaced only when treadle wrote
        it), naming ``target_dir``'s model (the target as exported) as its target; without one, the target by its
        config alone (a target that lives in someone else's loop). ``extra``: ``export_draft``'s."""
        from treadle.checkpoint.export import export_draft
        from treadle.drafts.targets import target_identity

        weights = {f"draft_model.{k}": v for k, v in self.draft.state_dict().items()}
        if target_dir is None:
            import tempfile

            with tempfile.TemporaryDirectory() as empty:  # no tokenizer to copy, no checkpoint to stitch into
                return export_draft(self.model, weights, out_dir, Path(empty), self.identity, cfg, step=step,
                                    command=command)
        identity = target_identity(Path(target_dir), self.target)
        return export_draft(self.model, weights, out_dir, target_dir, identity, cfg, step=step, command=command,
                            extra=extra)


class BesideLoss:
    """The step's loss function: the target's (``base``) on the micro-batch, the draft's from what that forward
    read. Detached: the draft's gradients are made here, on its own graph; joint: ``weight`` x its loss joins the
    returned sum. Side sums: ``draft_loss`` (and the objective's: ``draft_ce``, ``acc_k``'s counts)."""

    def __init__(self, base, draft: DraftBeside):
        self.base, self.draft = base, draft
        self.label = getattr(base, "label", "cross-entropy per label token")

    def __call__(self, model: nn.Module, batch: dict):
        with self.draft.reading() as take:
            summed, side = split_loss(self.base(model, batch))
            reads = take()
        draft_sum, draft_side = self.draft.loss(batch, reads)
        side = {**side, "draft_loss": draft_sum.detach(), **{k: v.detach() for k, v in draft_side.items()}}
        if not self.draft.joint:
            if torch.is_grad_enabled():
                draft_sum.backward()
            return summed, side
        return summed.sum() + self.draft.weight * draft_sum, {"target_loss": summed.detach().sum(), **side}


class DraftStepCallback(Callback):
    """After the target's update: the draft's (``DraftBeside.step``), its figures in the step's metrics. Its
    schedule's position is its state (the weights and optimizer are the checkpoint's companion)."""

    def __init__(self, draft: DraftBeside):
        self.draft = draft

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        engine = trainer.engine
        result.metrics.update(self.draft.step(engine.all_reduce_sum, engine.all_agree, result.label_tokens,
                                              scaled=self.draft.joint, loss_multiplier=engine.loss_multiplier))

    def state_dict(self) -> dict:
        return {"schedule": self.draft.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.draft.schedule.load_state_dict(state["schedule"])


class BesideAcceptance(AcceptanceCallback):
    """tau_sim of the draft beside its target: the target changes every step, so its greedy texts are made again at
    every evaluation, and it is left training."""

    def __init__(self, draft: DraftBeside, cfg, prompts: torch.Tensor, eval_every: int, at_start: bool = True):
        super().__init__(cfg, prompts, eval_every, at_start)
        self.draft = draft

    def scored_model(self, trainer: Trainer) -> nn.Module:
        return self.draft.model

    def measure(self, trainer: Trainer) -> dict:
        if self.texts is not None:  # generated (and judged for loops) at the first evaluation, made again after
            self.texts = self.fresh(trainer)
        try:
            return super().measure(trainer)
        finally:
            self.draft.target.train()  # the draft run model's train() keeps a target in eval mode

    def fresh(self, trainer: Trainer) -> torch.Tensor:
        model = self.draft.model
        model.eval()
        return model.continue_greedily(self.prompts.to(trainer.engine.device), self.cfg.eval_new_tokens)


class BesideExportCallback(ExportCallback):
    """At the end, the target (``hf/``), then the draft in its serving layout (``draft/``) naming that export as its
    target. A kind whose weights belong to the model's checkpoint (mtp: ``DraftKind.carried_by_model``) is in
    ``hf/`` too, where transformers' ``generate(use_mtp=True)``, vLLM and a later mtp run (``draft.target = hf/``)
    read it; its ``draft/`` is then the stand-alone layout alone (SGLang's NextN draft path, treadle's draft tools),
    without a ``stitched/`` copy of ``hf/``."""

    def __init__(self, hf: ExportCallback, draft: DraftBeside, out_dir: Path, cfg):
        super().__init__(hf.out_dir, hf.tokenizer_dir, hf.chat_template, kind(cfg.kind).into_model(draft.draft))
        self.draft, self.draft_dir, self.cfg = draft, out_dir, cfg

    def outputs(self) -> list[Path]:
        return [Path(self.out_dir), Path(self.draft_dir)]

    def on_train_end(self, trainer: Trainer) -> None:
        super().on_train_end(trainer)
        if trainer.engine.rank == 0:
            self.draft.export(self.draft_dir, self.out_dir, self.cfg, step=trainer.state.step,
                              extra=self.into is None)


def beside_setup(cfg: Config, setup, data, device: torch.device, checkpoints):
    """A model run's ``ModelSetup`` with a draft beside its model: the step's loss, the draft's update, acceptance
    and export; the draft's tensors a companion of the run's checkpoints."""
    from dataclasses import replace

    from treadle import distributed
    from treadle.checkpoint.export import claim_export
    from treadle.data.loader import check_token_ids

    # Every engine: the draft is whole on each rank, outside the engine (its gradients summed by DraftBeside.step), and
    # reads the target's embedding and head whole: FSDP2 keeps its root unit gathered from the model's forward to
    # its backward (engine/fsdp2.py whole_root), ZeRO-3 gathers a module's parameters whenever it runs (its hooks).
    out = Path(cfg.train.output_dir)
    draft = DraftBeside(cfg, setup.model, [o.dataset for o in data.sources], data.train.vocab_size, device)
    checkpoints.companions["draft"] = draft
    if cfg.checkpoint.export_hf:  # a user's files in <output_dir>/draft are refused now, not after the training
        distributed.on_main(claim_export, out / "draft", "the run's draft export")
    val = data.val or data.train
    prompts = eval_prompts(val, cfg.draft.eval_prompts, cfg.draft.eval_prompt_len)
    check_token_ids(prompts, setup.vocab_size, lambda: f"the draft's eval prompts ({val.where})")
    acceptance = BesideAcceptance(draft, cfg.draft, prompts, cfg.train.eval_every, cfg.train.eval_at_start)
    line = (f"treadle: draft.kind = {cfg.draft.kind} beside the model ({sum(p.numel() for p in draft.params):,} "
            f"trainable parameters, its own AdamW at lr {cfg.draft.lr or cfg.optim.lr:g}), "
            + (f"joint: its loss x {cfg.draft.weight:g} trains the target too" if cfg.draft.joint
               else "detached: the target trains as it would alone"))
    return replace(setup, loss_fn=BesideLoss(setup.loss_fn, draft), eval_loss_fn=setup.eval_loss_fn or setup.loss_fn,
                   eval_callbacks=[*setup.eval_callbacks, acceptance],
                   export=BesideExportCallback(setup.export, draft, out / "draft", cfg.draft),
                   step_callbacks=[DraftStepCallback(draft), TTTAccuracyCallback(), *setup.step_callbacks],
                   notes=replace(setup.notes, always=[*setup.notes.always, line]))
