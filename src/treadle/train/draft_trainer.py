"""``DraftTrainer``: keep a speculative-decoding draft fresh beside a target trained by a loop treadle does not own.

An RL trainer (verl, TRL, NeMo-RL, your own) updates its policy; its served draft goes stale. ``DraftTrainer`` is the
object a treadle run uses for a draft beside its target (train/cotrain.py ``DraftBeside``), with the loop left out:
tap the hidden states the loop's own forward computes (``reading``), step the draft on that batch (``step``), and
``publish`` its serving layout into a directory a server reloads. docs/python.md has the walk-through,
examples/draft_beside_rl.py a runnable loop.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn

from treadle.errors import UserError


class _TokenCounts:
    """A dataset's ``token_counts`` for a reduced draft vocabulary (EAGLE-3's ``vocab_size``), from given counts."""

    def __init__(self, counts):
        self.counts = np.asarray(torch.as_tensor(counts).cpu(), dtype=np.int64)

    def token_counts(self, vocab: int) -> np.ndarray:
        out = np.zeros(vocab, dtype=np.int64)
        out[: min(vocab, len(self.counts))] = self.counts[:vocab]
        return out


class DraftTrainer:
    """A draft of ``kind`` trained beside ``target``, a Hugging Face causal LM someone else trains.

    ``target`` must hold its whole weights on this process (the draft reads its embedding and head: a rollout
    replica, a DDP module, not an FSDP-sharded one). ``draft``: any ``[draft]`` key (``vocab_size``, ``loss``,
    ``ttt_steps``, ``feature_layers``, ``init`` ...); ``token_counts`` ([V] counts of training tokens) picks a reduced
    vocabulary's tokens. The draft has its own AdamW at ``lr`` (constant after ``warmup_steps``); its loss never reaches
    the target. Under ``torch.distributed``, every rank holds the draft and its gradients are summed over the
    default group at each ``step``.
    """

    def __init__(self, target: nn.Module, kind: str = "eagle3", *, lr: float = 3e-4, warmup_steps: int = 0,
                 grad_clip: float = 1.0, weight_decay: float = 0.0, token_counts=None, **draft):
        from treadle.config import Config, _explain
        from treadle.train.cotrain import DraftBeside

        tree = {"draft": {**draft, "kind": kind, "target": "self", "lr": lr},
                "optim": {"lr": lr, "weight_decay": weight_decay},
                "schedule": {"decay": "constant", "warmup_steps": warmup_steps},
                "train": {"grad_clip": grad_clip, "max_steps": warmup_steps + 1}}
        try:
            self.cfg = Config.model_validate(tree)
        except ValidationError as err:
            raise _explain(err, "") from None
        if self.cfg.draft.vocab_size is not None and token_counts is None and self.cfg.draft.init is None:
            raise UserError(f"DraftTrainer(vocab_size={self.cfg.draft.vocab_size}) without token_counts: a reduced "
                            "vocabulary keeps the most frequent training tokens; accepted: token_counts = a [vocab] "
                            "tensor of counts, or vocab_size unset")
        device = next(target.parameters()).device
        datasets = [] if token_counts is None else [_TokenCounts(token_counts)]
        self.draft = DraftBeside(self.cfg, target, datasets, target.config.vocab_size, device)
        self.steps = 0
        self._reads: dict[str, torch.Tensor] | None = None

    @property
    def model(self) -> nn.Module:
        """The draft module itself (what is trained, saved and published)."""
        return self.draft.draft

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around the loop's own forward of the target: what the draft reads is recorded there (the last forward
        inside the block), so ``step`` runs no target forward of its own."""
        with self.draft.reading() as take:
            yield
            self._reads = take()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> dict[str, float]:
        """One update of the draft on rows ``input_ids`` [B, T]: ``labels`` [B, T] the next tokens with -100 where
        nothing is scored (default: ``input_ids`` shifted, the last -100), ``position_ids`` restarting at 0 where a
        packed document starts (default: one document per row). Reads the target's forward recorded by ``reading``
        on the same rows, else runs the target once (no grad). Returns the step's figures (``draft_loss`` per label
        token, ``draft_grad_norm``, ``draft_lr`` and the kind's own)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if labels is None:
            labels = torch.cat((input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), -100)), dim=1)
        batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        reads, self._reads = self._reads, None
        if reads is None or reads["hidden"].shape[:2] != input_ids.shape:
            with torch.no_grad(), self.draft.reading() as take:
                self.draft.target(input_ids=input_ids, position_ids=position_ids, use_cache=False)
                reads = take()
        loss, side = self.draft.loss(batch, reads)
        loss.backward()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        sums = torch.stack([loss.detach().double(), (labels != -100).sum().double(),
                            *(v.detach().double() for v in side.values())])
        if distributed:
            torch.distributed.all_reduce(sums)
        tokens = int(sums[1])
        figures = self.draft.step(self._reduce if distributed else (lambda t: t),
                                  self._agree if distributed else (lambda ok: ok), tokens, scaled=False)
        self.steps += 1
        per_token = {k: float(v) / max(tokens, 1) for k, v in zip(side, sums[2:].tolist())}
        acc = {f"acc_{k[len('ttt_hits_'):]}": per_token[k] / per_token[k.replace("hits", "rows")]
               for k in per_token if k.startswith("ttt_hits_") and per_token[k.replace("hits", "rows")] > 0}
        plain = {k: v for k, v in per_token.items() if not k.startswith(("ttt_", "block_"))}
        return {"draft_loss": float(sums[0]) / max(tokens, 1), **plain, **acc, **figures}

    @staticmethod
    def _reduce(t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t)
        return t

    @staticmethod
    def _agree(ok: bool) -> bool:
        flag = torch.tensor([0.0 if ok else 1.0])
        torch.distributed.all_reduce(flag)
        return float(flag) == 0.0

    def publish(self, out_dir, target_dir=None) -> Path:
        """The draft's serving layout (its kind's: EAGLE-3's is the one vLLM and SGLang load) written atomically into
        ``out_dir``: a reader sees the previous draft or this one, never half of one; a directory treadle did not
        write is never replaced. ``target_dir``: the target as saved (its tokenizer is copied, its identity
        recorded); unset, the draft names its target by its config. Call it on one rank."""
        if target_dir is None and self.cfg.draft.kind == "mtp":
            raise UserError("DraftTrainer.publish of an mtp draft without target_dir: its stitched layout is the "
                            "target's checkpoint with the layer put back; accepted: target_dir = the saved target")
        return self.draft.export(Path(out_dir), None if target_dir is None else Path(target_dir), self.cfg.draft,
                                 step=self.steps, command="publish")

    def state_dict(self) -> dict:
        """The draft's weights, optimizer and schedule, for the loop's own checkpoints (``torch.save`` it)."""
        return {"draft": self.draft.state_dict(), "schedule": self.draft.schedule.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.draft.load_state_dict(state["draft"])
        self.draft.schedule.load_state_dict(state["schedule"])
        self.steps = state["steps"]
