"""A dflash draft run's objective: blocks anchored at random supervised positions, every slot scored at once.

Anchors: per packed row, up to ``draft.anchors`` distinct indices a whose next token is supervised (``labels[a]``
set: the next token is in a's document and in the loss mask), drawn without replacement and sorted, from a
generator seeded by (train.seed, the row's place in the global sample order): the same row gets the same anchors
at any micro-batch split, world size or resume. A row with fewer such indices trains fewer blocks.

Labels: slot k >= 1 of the block at a guesses the token at index a + k (no EAGLE-style shift): scored iff a + k
lies in the row, in a's document, and is supervised (``labels[a + k - 1]``, which holds token a + k, is set).
The data token there (ce), or the target's distribution at index a + k - 1 (kl, its own guess of the same token).

Weighting and normalization: slot k's token loss weighs ``exp(-(k - 1) / slot_gamma)`` (or D-PACE's detached
weights, ``dpace_weights``, with ``draft.slot_weighting = "dpace"``); a row's loss is the sum
over its blocks and slots, which the loop divides by the step's label tokens like any draft loss, so the result
does not depend on how the step is split into micro-batches or ranks.

Memory: with ``model.loss_chunk_tokens`` (auto: on from a 32k vocabulary) neither the draft's slot logits nor the
target's are ever whole ([blocks x slots, V]): both heads run a chunk of rows at a time, recomputed in backward.

Metrics: ``ttt_hits_k`` / ``ttt_rows_k`` (slot k's guess equals the target's greedy token: ``acc_k``) and
``block_hits_k`` / ``block_rows_k`` (slots 1..k all equal it, among blocks whose slot k is scored), which
``TTTAccuracyCallback`` turns into ``eal``, the expected number of drafts a greedy verification accepts per block,
sum_k P(slots 1..k accepted) (speculators' EAL, measured on whole blocks rather than as a product of rates).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from treadle.data.packed import IGNORE_INDEX
from treadle.drafts.run_model import batch_reads
from treadle.drafts.dflash import settings
from treadle.drafts.glide.model import anchored_positions, document_ids
from treadle.models.upcast import at_least_fp32

if TYPE_CHECKING:
    from treadle.train.step import Batch


def slot_weights(block_size: int, gamma: float) -> list[float]:
    """exp(-(k - 1) / gamma) for slots k = 1..block_size - 1 (slot 0, the anchor, is never scored)."""
    return [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]


DPACE_ALPHA = 0.5  # the D-PACE paper's and speculators' floor on a slot's acceptance estimate


def dpace_weights(ce: torch.Tensor, scored: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE's slot weights [..., K] (detached): with q_i = (1 - alpha) exp(-CE_i) + alpha the slot's estimated
    acceptance, slot j weighs sum_{m >= j} prod_{i <= m} q_i, the expected acceptance length it contributes to. A slot
    that is not scored ends its block (q = 0 from there: nothing after it is drafted in that block)."""
    q = ((1 - alpha) * torch.exp(-ce.detach()) + alpha) * scored
    reach = q.cumprod(-1)  # P(slots 1..m accepted)
    return reach.flip(-1).cumsum(-1).flip(-1)


def sample_anchors(labels: torch.Tensor, count: int, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, N] anchor indices, [B, N] valid) with N = ``count``: per row, up to ``count`` distinct sorted indices
    whose label is set, drawn with ``torch.Generator().manual_seed(seeds[row])``; padding rows of index 0, not
    valid."""
    B, _ = labels.shape
    anchors = torch.zeros(B, count, dtype=torch.long)
    valid = torch.zeros(B, count, dtype=torch.bool)
    eligible = (labels != IGNORE_INDEX).cpu()
    for row in range(B):
        idx = eligible[row].nonzero().flatten()
        g = torch.Generator().manual_seed(seeds[row])
        pick = idx[torch.randperm(len(idx), generator=g)[:count]].sort().values
        anchors[row, : len(pick)] = pick
        valid[row, : len(pick)] = True
    return anchors.to(labels.device), valid.to(labels.device)


def scored_slots(labels: torch.Tensor, doc: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, N, K] bool: slot k of each block is scored, [B, N, K] its data token (clamped, meaningful where
    scored)) for K = block_size - 1 slots: index a + k in the row, in a's document, supervised."""
    T = labels.shape[1]
    rows = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)  # a + k - 1: holds token a + k
    inside = rows < T
    rows = rows.clamp_max(T - 1)
    B, N, K = rows.shape
    lab = labels.gather(1, rows.flatten(1)).view(B, N, K)
    same = doc.gather(1, rows.flatten(1)).view(B, N, K) == doc.gather(1, anchors)[..., None]
    # labels[a + k - 1] set means token a + k follows in the same document; ``same`` guards a + k - 1 itself
    return valid[..., None] & inside & same & (lab != IGNORE_INDEX), lab.clamp_min(0)


class DFlashObjective:
    """The draft's summed slot losses of a micro-batch (ce / kl / mix, as for the other kinds) plus side sums:
    ``target_loss`` (the target's own CE, the floor), ``draft_ce`` / ``draft_kl`` (unweighted, over scored slots),
    per slot ``ttt_hits_k`` / ``ttt_rows_k`` and per prefix ``block_hits_k`` / ``block_rows_k``."""

    settings = settings  # the kind's [draft] defaults (block_size, slot_gamma): DSpark has its own
    anchor_drafts = False  # slot 0 (the anchor's) is not scored; DSpark's drafts too (block_size scored slots)

    def __init__(self, cfg, seq_len: int, max_positions: int, seed: int = 0):
        self.cfg = cfg
        self.seed = seed
        self.block_size = self.settings.block_size(cfg)
        self.slots = self.block_size if self.anchor_drafts else self.block_size - 1  # scored slots per block
        self.count = cfg.anchors or max(1, seq_len // self.block_size)
        self.seq_len = seq_len
        self.gamma = self.settings.slot_gamma(cfg)
        self.weights = slot_weights(self.slots + 1, self.gamma)
        self.dpace = cfg.slot_weighting == "dpace"
        self.max_offset = max(0, min(cfg.max_position_offset, max_positions - seq_len - self.block_size))

    @property
    def token_loss(self) -> str:
        """What ``draft.loss`` scores per slot, in words."""
        c = self.cfg
        return {"ce": "cross-entropy on the data", "kl": "KL(target || draft)",
                "mix": f"{1 - c.kl_weight:g} cross-entropy + {c.kl_weight:g} KL(target || draft)"}[c.loss]

    @property
    def label(self) -> str:
        weights = "by D-PACE" if self.dpace else f"exp(-(k-1)/{self.gamma:g})"
        return (f"{self.token_loss} at the {self.slots} slots of up to {self.count} blocks per row, slot k weighted "
                f"{weights}, summed, per label token")

    @property
    def eval_label(self) -> str:
        """Not a mean per scored slot: the loop divides every loss by the label tokens, and a row scores fewer slots
        than it has label tokens, so this figure sits below the draft's mean per slot (and can sit below the
        target's val loss, a mean per label token, while every slot is worse)."""
        slots = self.slots
        return (f"the draft's cross-entropy on the data, summed over the scored slots ({slots} per block, up to "
                f"{self.count} blocks per row: at most {min(self.count * slots, self.seq_len)} of a row's "
                f"{self.seq_len} label tokens), per label token; not a mean per slot")

    def _seeds(self, batch: Batch) -> list[int]:
        B = batch["input_ids"].shape[0]
        order = batch["order_position"].tolist() if "order_position" in batch else list(range(B))
        return [self.seed * 1_000_003 + int(o) for o in order]

    def _offset(self, batch: Batch) -> int:
        if not self.max_offset:
            return 0
        first = int(batch["order_position"][0]) if "order_position" in batch else 0
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + first + 7_919)
        return int(torch.randint(0, self.max_offset + 1, (), generator=g))

    def scored(self, labels: torch.Tensor, doc: torch.Tensor, anchors: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, N, slots] bool: the slot is scored, its data token) of the blocks at ``anchors`` (``scored_slots``;
        DSpark shifts and cuts them)."""
        return scored_slots(labels, doc, anchors, valid, self.block_size)

    def row_loss(self, out, token: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(the rows' loss [B], side sums) from the model's output, the slots' token losses [B, N, K] and the slot
        weights: their weighted sum. A kind with a head on the slots' candidates adds that head's terms (the model's
        ``head_scores`` put them in ``out``): DFlash2 its selector's CE under the same weights, LiLiCorr its lattice
        terms."""
        return (token * w).sum((1, 2)), {}

    def __call__(self, model, batch: Batch):
        return self.losses(model, batch, self._offset(batch), train=True)

    def evaluate(self, model, batch: Batch):
        return self.losses(model, batch, 0, train=False)

    def losses(self, model, batch: Batch, offset: int, train: bool):
        positions, labels = batch["position_ids"], batch["labels"]
        anchors, valid = sample_anchors(labels, self.count, self._seeds(batch))
        scored, tokens = self.scored(labels, document_ids(positions), anchors, valid)
        out = model(input_ids=batch["input_ids"], position_ids=anchored_positions(positions, self.cfg.anchor_positions,
                    offset), anchors=anchors, doc_position_ids=positions, labels=labels,
                    slot_labels=torch.where(scored, tokens, IGNORE_INDEX), reads=batch_reads(batch))
        if out.logits is None:  # a chunked loss (model.loss_chunk_tokens): per-slot scores, logits never whole
            ce, kl, hit = out.ce, out.kl, out.hit
        else:
            draft_log = F.log_softmax(at_least_fp32(out.logits), -1)
            ce = -draft_log.gather(-1, tokens[..., None]).squeeze(-1) * scored  # [B, N, K]
            target_log = F.log_softmax(at_least_fp32(out.target_logits), -1)
            kl = (target_log.exp() * (target_log - draft_log)).sum(-1) * scored
            hit = out.hit if out.hit is not None else (
                (out.logits.detach().argmax(-1) == out.target_logits.argmax(-1)) & scored)
        agreement = self.agreement(hit, scored)
        if not train:  # the CE and the draft's agreement per slot (eval_acc_k, eval_eal: metrics/agreement.py)
            return ce.sum((1, 2)), {"target_loss": out.target_ce, **agreement}
        if self.dpace:
            w = dpace_weights(ce, scored)
        else:
            w = torch.tensor(self.weights, dtype=ce.dtype, device=ce.device)
        if self.cfg.loss == "mix":
            token = (1.0 - self.cfg.kl_weight) * ce + self.cfg.kl_weight * kl
        else:
            token = ce if self.cfg.loss == "ce" else kl
        loss, more = self.row_loss(out, token, w)
        return loss, {"target_loss": out.target_ce, "draft_ce": ce.detach().sum(), "draft_kl": kl.detach().sum(),
                      **more, **agreement}

    def agreement(self, hit: torch.Tensor, scored: torch.Tensor) -> dict:
        """Per slot ``ttt_hits_k`` / ``ttt_rows_k`` and per prefix ``block_hits_k`` / ``block_rows_k`` of the blocks'
        [B, N, slots] hits and scored slots."""
        side = {}
        prefix = hit.long().cumprod(-1).bool()
        for k in range(self.slots):
            side[f"ttt_hits_{k + 1}"] = hit[..., k].sum().double()
            side[f"ttt_rows_{k + 1}"] = scored[..., k].sum().double()
        for k in range(self.slots):
            side[f"block_hits_{k + 1}"] = prefix[..., k].sum().double()
            side[f"block_rows_{k + 1}"] = scored[..., k].sum().double()
        return side


def dflash_setup(cfg, model, objective_class=None) -> DFlashObjective:
    """What a dflash run adds to a draft run's setup: ``model.loss_chunk_tokens`` resolved (auto: on from a 32k
    vocabulary; then the slots' and the target's logits are scored a chunk of rows at a time, never whole, the
    target's logit transform applied inside each chunk), and its objective."""
    from treadle.errors import UserError
    from treadle.models.chunked_ce import resolve_chunk_tokens, unhandled_logit_transforms

    chunk = resolve_chunk_tokens(cfg.model.loss_chunk_tokens, model.target.config.vocab_size)
    unhandled = chunk and unhandled_logit_transforms(model.target.config)
    if unhandled:
        if cfg.model.loss_chunk_tokens != "auto":
            raise UserError(f"model.loss_chunk_tokens = {cfg.model.loss_chunk_tokens} with a {cfg.draft.kind} "
                            f"draft: the target transforms its logits ({', '.join(unhandled)}) in a way the chunked "
                            "scores do not apply; accepted: model.loss_chunk_tokens = 0")
        chunk = 0
    model.loss_chunk_tokens = chunk
    objective_class = objective_class or DFlashObjective  # a kind built on DFlash brings its own (DFlash2, LiLiCorr)
    draft = cfg.draft
    if draft.block_size is None:  # the draft's own block: a draft.init's, or the DSpark stages a target ships
        draft = draft.model_copy(update={"block_size": model.draft_model.block_size})
    return objective_class(draft, cfg.data.seq_len, model.target.config.max_position_embeddings, cfg.train.seed)
