"""What a draft run trains, whatever its kind: a frozen target and a trainable draft, and what the draft reads from
the target, served by the live target or by an offline store (drafts/features/), the kinds unaware which.

A kind's model reads its target through one method, ``_target_forward(..., reads=None)``: without ``reads`` the live
target runs; with ``reads`` (what ``target_reads`` returned for the same rows, stored per token by ``treadle
features``: the final hidden state ``hidden`` the head reads, and the kind's own, EAGLE-3's fused ``features``,
GLIDE's last-layer ``k`` / ``v``) nothing of the target runs but its shared head (the teacher's logits). A run that
trains from a store has no decoder layers in its target (``live`` False): it asks the store for the reads of its
evaluations' texts too (``StoredEval``), and refuses to run the target rather than run an empty stack.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from treadle.drafts.targets import capture_features
from treadle.models.chunked_ce import model_logits
from treadle.models.hf import greedy_continuations


@dataclass
class StoredEval:
    """The target's greedy continuations of the acceptance prompts and its reads on them, from a store."""

    texts: torch.Tensor  # [N, L]: prompts then the target's greedy continuation
    reads: dict[str, torch.Tensor]  # name -> [N, L, ...]

    def continuations(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        P = prompts.shape[1]
        if (self.texts.shape[0] != prompts.shape[0] or self.texts.shape[1] != P + new_tokens
                or not torch.equal(self.texts[:, :P].to(prompts.device), prompts)):
            raise RuntimeError("the feature store's acceptance texts were made for other prompts (the store's "
                               "fingerprint should have refused it)")
        return self.texts.to(prompts.device)

    def reads_of(self, texts: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.texts.shape != texts.shape or not torch.equal(self.texts.to(texts.device), texts):
            raise RuntimeError("a store-backed draft run evaluated texts its store holds no target reads for")
        return {k: v.to(texts.device) for k, v in self.reads.items()}


class DraftRunModel(nn.Module):
    """A frozen target and a trainable ``draft_model`` (GLIDE's, EAGLE-3's).

    Only ``draft_model.*`` parameters require grad, so checkpoints (which skip frozen parameters) and the optimizer
    never hold a target tensor.
    """

    def __init__(self, target, draft_model: nn.Module):
        super().__init__()
        self.target = target
        self.draft_model = draft_model
        target.requires_grad_(False)
        target.eval()
        self.rotary = type(target.model.rotary_emb)(config=target.config)  # buffers only, not saved
        self.loss_chunk_tokens = 0  # > 0: forward(labels=...) scores chunk by chunk (model.loss_chunk_tokens)
        self.stored: StoredEval | None = None  # a store-backed run's evaluation reads (set with ``live`` False)
        self.live = True  # False: the target's decoder layers are not built (the run reads a feature store)
        self.origin: str | None = None  # where the draft's weights came from, for the run's start line (kinds that say)
        # True: the draft's training attention goes through FlexAttention BlockMasks of its mask rules (drafts/masks.py)
        # instead of dense [T, T] masks; set by train/run.py's choose_attention (model.attention varlen / flex on CUDA).
        self.flex_masks = False

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()  # frozen means frozen: no dropout, whatever the loop asks of the wrapper
        return self

    def teacher_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits from its final hidden state: its head and logit transform (soft-cap, scale)."""
        return model_logits(self.target.config, self.target.get_output_embeddings()(hidden))

    def continue_greedily(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """[N, P] prompts -> [N, P + new_tokens], continued greedily by the target (or as its store holds them)."""
        if self.stored is not None:
            return self.stored.continuations(prompts, new_tokens)
        self.check_live()
        return greedy_continuations(self.target, prompts, new_tokens)

    def eval_reads(self, texts: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """What a store holds of the target on evaluation ``texts`` (None: the live target runs)."""
        return None if self.stored is None else self.stored.reads_of(texts)

    def check_live(self) -> None:
        """Refuse to run a target whose decoder layers were never built: its forward would be the embedding alone."""
        if not self.live:
            raise RuntimeError("this draft run reads its target from a feature store and has no target decoder "
                               "layers: the target's reads must be passed (batch keys target.*)")

    def target_reads(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """What this kind reads from its target for packed rows, token-major (name -> [B, T, ...]): what ``treadle
        features`` stores and ``_target_forward(reads=...)`` takes back."""
        raise NotImplementedError

    def reads_signature(self) -> dict:
        """What the reads depend on besides the target and the data (EAGLE-3: its feature layers)."""
        return {}

    # Which reads keep their graph when the draft trains beside its target jointly (``draft.joint``): its loss reaches
    # the target's trunk through them. The final hidden state is the teacher's unless a kind reads it as its input.
    trunk_reads: tuple[str, ...] = ()

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
        """Inside the block, every forward of the target (its own training forward, when the draft trains beside
        it) records what ``target_reads`` returns, with the same taps: the final hidden state where the head reads
        it, and the kind's own (``_taps``). Yields ``take()``: the latest forward's reads."""
        got: dict[str, torch.Tensor] = {}
        head = self.target.get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda _module, args: got.__setitem__("hidden", args[0]))
        try:
            with self._taps() as taken:
                yield lambda: {"hidden": got["hidden"], **taken()}
        finally:
            handle.remove()

    @contextlib.contextmanager
    def _taps(self) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
        """The kind's reads besides the final hidden state, tapped where the target makes them (none here)."""
        yield dict


class FusedFeatureReads:
    """What EAGLE-3 and DFlash read from their target (a ``DraftRunModel`` mixin): the final hidden state and the
    fused hidden states of ``draft_model.feature_layers``; their ``_target_forward`` returns ``(teacher, features)``."""

    def target_reads(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, features = self._target_forward(input_ids, position_ids, hidden=True)
        return {"hidden": hidden, "features": features}

    def reads_signature(self) -> dict:
        return {"feature_layers": list(self.draft_model.feature_layers)}

    trunk_reads = ("features",)  # a joint run's draft loss reaches the target through these (run_model.py)

    @contextlib.contextmanager
    def _taps(self) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
        with capture_features(self.target, self.draft_model.feature_layers) as tap:
            yield lambda: {"features": tap.take()}

    def from_reads(self, reads: dict, hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``_target_forward``'s result from a store's reads: the final hidden state (or the teacher's logits from
        it) and the features."""
        return (reads["hidden"] if hidden else self.teacher_logits(reads["hidden"])), reads["features"]


# A store's reads travel in a batch under these keys (drafts/features/dataset.py), beside input_ids and labels.
READS_PREFIX = "target."


def batch_reads(batch) -> dict[str, torch.Tensor] | None:
    """The target's reads a store put in ``batch`` (None: none, the live target runs)."""
    reads = {k[len(READS_PREFIX):]: v for k, v in batch.items() if k.startswith(READS_PREFIX)}
    return reads or None
