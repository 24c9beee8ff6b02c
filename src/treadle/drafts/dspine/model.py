"""DSpine: DFlash's block draft (drafts/dflash/model.py) with "adjacent causal injection" after every draft layer,
and a decode that walks each slot's top-k candidates, each scored after the token picked before it.

Written from the method as SpecForge trains it (sgl-project/SpecForge ``specforge/modeling/draft/dspine.py`` @9aafadf,
``specforge/algorithms/dspine/model.py`` @105c1b2; Tencent/DSpine's README for the serving claim); the code is
treadle's. Shapes: d the draft's width, r the transfer rank, m the message width, V the target's vocabulary.

- **Transfer space.** Fixed token codes ``transfer_codes`` [V, r]: the target head's rows, each normalized to unit
  length, centred, projected on their r leading principal directions and whitened (divided by the square root of
  each direction's eigenvalue), normalized again. Computed once from the frozen head when a draft is new (float64
  here, so every rank and every engine gets the same bytes); never trained. Each layer's ``readouts.i`` [r, d]
  starts as those directions.
- **Injection after layer i** (``Injection``): every slot's feature ``f = sqrt(r) * unit(readouts.i(x))``. Slot
  j >= 1 receives from its predecessor p (the anchor token's code ``sqrt(r) * codes[anchor]`` for slot 1, slot
  j - 1's feature at this layer otherwise): ``x_j += rms(x_j) * writes.i(gate * message(p))`` with ``gate =
  sigmoid(receiver_gate(f_j) + predecessor_gate(p) + bias)``; slot 0 is left as it is. All slots at once, so a
  block is still one forward; the left-to-right dependency grows one slot per layer. ``writes.i`` and
  ``predecessor_gate`` start at zero: a new DSpine draft computes what its DFlash backbone computes.
- **Refinement** (the decode's scores, ``refine``): a slot's hidden state before the last layer's injection,
  injected again with the code of a given predecessor token instead of the predicted feature, then the final norm;
  its logits at the slot's candidates (the top-k of the backbone's logits) through the target's head. The decode
  walks the block: slot 1 after the anchor (the bonus token), slot t after the token picked at t - 1; greedy takes
  the best candidate, sampled draws from the softmax over the candidates (that row is the slot's q).
- **Loss** (SpecForge's, per scored slot, under DFlash's slot weights): ``0.1 * CE + 0.9 * L1`` of the backbone's
  distribution against the data token and the target's distribution; plus the refinement's ``0.1 * CE + 0.9 * L1``
  over the candidates, the predecessor teacher-forced (the data token before the slot), the CE only where the data
  token is a candidate, the L1 against the target's distribution renormalized on the candidates and only where
  that mass exceeds 1e-4; plus alignment: ``0.5 * CE(slot, detached) * sum_i (1 - cos(f_i, codes[data token]))``
  over the layers' features after injection. SpecForge scales the alignment by the step's mean backbone CE with a
  146-step warm-up, and in the first third of training replaces the first 3 layers' predecessor features by the data
  tokens' codes at random; treadle scales by each slot's own CE (a micro-batch split cannot change it) and trains
  without the replacement (docs/drafts.md says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from treadle.data.packed import IGNORE_INDEX
from treadle.drafts.dflash.model import DFlashDraft, DFlashModel, DFlashOutput, build_dflash
from treadle.drafts.dspine import layout as dspine_layout
from treadle.drafts.dspine import settings
from treadle.drafts.glide.model import init_linears
from treadle.drafts.targets import head_rows
from treadle.errors import UserError
from treadle.models.chunked_ce import chunked_rows, model_logits
from treadle.models.upcast import at_least_fp32

KIND = "dspine"


class Injection(nn.Module):
    """The per-layer readouts and writes and the shared message and gates (SpecForge's ``AdjacentInjection``)."""

    def __init__(self, hidden_size: int, num_layers: int, rank: int, message_size: int):
        super().__init__()
        self.rank = rank
        self.readouts = nn.ModuleList(nn.Linear(hidden_size, rank, bias=False) for _ in range(num_layers))
        self.writes = nn.ModuleList(nn.Linear(message_size, hidden_size, bias=False) for _ in range(num_layers))
        self.message = nn.Linear(rank, message_size, bias=False)
        self.receiver_gate = nn.Linear(rank, message_size, bias=False)
        self.predecessor_gate = nn.Linear(rank, message_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(message_size))

    def reset(self) -> None:
        """Writes and predecessor gate at zero: the injection adds nothing until trained."""
        with torch.no_grad():
            for write in self.writes:
                write.weight.zero_()
            self.predecessor_gate.weight.zero_()
            self.bias.zero_()

    def feature(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        f = self.readouts[layer](x)
        return (math.sqrt(self.rank) * F.normalize(at_least_fp32(f), dim=-1)).to(x.dtype)

    def _write(self, x, receiver, predecessor, layer: int) -> torch.Tensor:
        gate = torch.sigmoid(self.receiver_gate(receiver) + self.predecessor_gate(predecessor) + self.bias)
        scale = (torch.linalg.vector_norm(at_least_fp32(x), dim=-1, keepdim=True) / math.sqrt(x.shape[-1]))
        return x + scale.to(x.dtype) * self.writes[layer](gate * self.message(predecessor))

    # One ``forward`` for both uses: DeepSpeed ZeRO-3 gathers a module's own parameters (``bias``) only around it.
    def forward(self, x: torch.Tensor, layer: int, first: torch.Tensor | None = None,
                predecessor: torch.Tensor | None = None):
        """Blocks ``x`` [..., S, d] with their anchors' codes ``first`` [..., r] -> (the injected blocks, their
        features after it [..., S, r]); or, with ``predecessor`` codes [..., r], the rows ``x`` [..., d] injected
        after those (the refinement)."""
        f = self.feature(x, layer)
        if predecessor is not None:
            return self._write(x, f, predecessor, layer)
        before = torch.cat((first[..., None, :].to(f.dtype), f[..., 1:-1, :]), -2)
        x = torch.cat((x[..., :1, :], self._write(x[..., 1:, :], f[..., 1:, :], before, layer)), -2)
        return x, self.feature(x, layer)


def transfer_space(head: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [V, rank], directions [rank, d]) of a target head [V, d] (float64; the module docstring says how)."""
    rows = F.normalize(head.detach().double(), dim=-1)
    mean = rows.mean(0)
    centred = rows - mean
    values, vectors = torch.linalg.eigh(centred.T @ centred)
    values, vectors = values[-rank:], vectors[:, -rank:]
    if not bool((values > 0).all()):
        raise UserError(f"the target's head has fewer than {rank} principal directions with positive variance; "
                        "accepted: a target whose head spans the DSpine transfer rank")
    codes = F.normalize(centred @ vectors / values.sqrt(), dim=-1)
    return codes, vectors.T.contiguous()


class DSpineDraft(DFlashDraft):
    """DFlash's draft with the injection after every layer and the fixed transfer codes (a buffer: saved, never
    trained)."""

    kind = KIND
    layout = dspine_layout
    speculators = None  # speculators 0.9.0 has no DSpine class
    settings = settings

    def __init__(self, target_config, feature_layers, num_layers: int = settings.dflash.NUM_LAYERS,
                 block_size: int = settings.dflash.BLOCK_SIZE, mask_token_id: int | None = None,
                 candidates: int = settings.CANDIDATES, transfer_rank: int | None = None,
                 message_size: int | None = None):
        super().__init__(target_config, feature_layers, num_layers, block_size, mask_token_id)
        d, vocab = target_config.hidden_size, target_config.vocab_size
        rank = transfer_rank or min(settings.TRANSFER_RANK, d, vocab - 1)
        message = message_size or min(settings.MESSAGE_SIZE, d)
        if not 1 <= candidates <= vocab:
            raise UserError(f"draft.candidates = {candidates}; accepted: 1..{vocab} (the target's vocabulary)")
        if not 1 <= rank <= min(d, vocab - 1):
            raise UserError(f"dspine transfer_rank = {rank}; accepted: 1..{min(d, vocab - 1)} (the target's width "
                            "and vocabulary - 1)")
        self.candidates = candidates
        self.injection = Injection(d, num_layers, rank, message)
        init_linears(self.injection, target_config)
        self.injection.reset()
        self.register_buffer("transfer_codes", torch.zeros(vocab, rank))

    @torch.no_grad()
    def init_transfer(self, head: torch.Tensor) -> None:
        """The transfer codes and the readouts' start from the target's head [V, d]."""
        codes, directions = transfer_space(head, self.injection.rank)
        self.transfer_codes.copy_(codes)
        for readout in self.injection.readouts:
            readout.weight.copy_(directions)

    def codes(self, tokens: torch.Tensor) -> torch.Tensor:
        return math.sqrt(self.injection.rank) * F.embedding(tokens, self.transfer_codes)

    @classmethod
    def run_options(cls, cfg) -> dict:
        return {"candidates": settings.candidates(cfg)}

    @classmethod
    def layout_options(cls, config: dict, target_config, where) -> dict:
        return dspine_layout.options(config, where)

    def init_keys(self) -> tuple:
        return (("candidates", self.candidates),)

    def forward(self, embeds, rope, context_kv, mask, tokens: torch.Tensor):
        """DFlash's forward with the injection after every layer: (final hidden states [B, Q, d], the last layer's
        rows before its injection [B, Q, d], every layer's features after it [L, B, N, S, r]) of blocks of ``tokens``
        [B, N, S] (only their anchors are read)."""
        cos, sin = rope
        B, N, S = tokens.shape
        x, first, features = embeds, self.codes(tokens[..., 0]), []
        for i, (layer, kv) in enumerate(zip(self.layers, context_kv)):
            x = layer(x, kv, cos, sin, mask)
            before = x
            x, f = self.injection(x.view(B, N, S, -1), i, first)
            x = x.view(B, N * S, -1)
            features.append(f)
        return self.norm(x), before, torch.stack(features)

    def refine(self, before: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """Rows ``before`` [..., d] (the last layer's, before its injection) injected after the tokens
        ``predecessors`` [...], then normed: what the head reads for the candidates after that predecessor."""
        return self.norm(self.injection(before, self.num_layers - 1, predecessor=self.codes(predecessors)))


@dataclass
class DSpineOutput(DFlashOutput):
    # With slot labels, per slot [B, N, K]: the backbone's CE and L1 to the target, the refinement's and the
    # alignment's terms (weighted as the module docstring says), whether the data token is a candidate.
    spine_ce: torch.Tensor | None = None
    spine_l1: torch.Tensor | None = None
    refinement: torch.Tensor | None = None
    alignment: torch.Tensor | None = None
    covered: torch.Tensor | None = None


def _backbone_terms(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, k: int):
    """(CE, L1, candidate ids [.., k], the target's log-probs at them) of fp32 slot logits and the target's."""
    logp = F.log_softmax(logits, -1)
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher, -1)
    ce = -logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    l1 = (logp.exp() - teacher_logp.exp()).abs().sum(-1)
    ids = logits.detach().topk(k, dim=-1).indices
    return ce, l1, ids, teacher_logp.gather(-1, ids)


class DSpineModel(DFlashModel):
    """A dspine run's model: DFlash's forward with the injection's states kept for the head on the candidates."""

    draft_class = DSpineDraft

    def draft_blocks(self, embeds, rope, kv, mask, tokens):
        hidden, before, features = self.draft_model(embeds, rope, kv, mask, tokens)
        B, N, S = tokens.shape
        self.spine = (before.view(B, N, S, -1), features)  # read by head_scores / slot_guesses / the drafter
        return hidden

    def candidate_scores(self, before: torch.Tensor, ids: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """[..., k] fp32 logits (the target's transform applied) of candidates ``ids`` [..., k] at rows ``before``
        [..., d], each row after its token ``predecessors`` [...]."""
        refined = self.draft_model.refine(before, predecessors)
        rows = head_rows(self.target, ids)
        return at_least_fp32(model_logits(self.target.config, torch.einsum("...d,...kd->...k", refined, rows)))

    def _slot_terms(self, out: DFlashOutput, labels: torch.Tensor):
        k = self.draft_model.candidates
        if out.logits is not None:
            return _backbone_terms(at_least_fp32(out.logits), at_least_fp32(out.target_logits), labels, k)
        module, config = self.target.get_output_embeddings(), self.target.config

        def terms(h, t, y):  # the head as a module: ZeRO-3 gathers it around each call (chunked_rows' recompute too)
            head = lambda x: at_least_fp32(model_logits(config, module(x)))  # noqa: E731
            return _backbone_terms(head(h), head(t), y, k)

        K = out.hidden.shape[:-1]
        parts = chunked_rows(terms, [out.hidden.flatten(0, -2), out.teacher_hidden.flatten(0, -2), labels.flatten()],
                             self.loss_chunk_tokens)
        return tuple(p.view(*K, *p.shape[1:]) for p in parts)

    def head_scores(self, out, input_ids, anchors, doc, features, slot_labels) -> DSpineOutput:
        """``hit``: the walk's pick with the data token before the slot as predecessor against the target's greedy
        token; with ``slot_labels`` every loss term per slot."""
        out = DSpineOutput(**{f.name: getattr(out, f.name) for f in fields(out)})
        before, layer_features = self.spine
        before, layer_features = before[:, :, 1:], layer_features[:, :, :, 1:]
        K = before.shape[2]
        rows = (anchors[..., None] + torch.arange(K, device=anchors.device)).clamp_max(input_ids.shape[1] - 1)
        predecessors = input_ids.gather(1, rows.flatten(1)).view_as(rows)  # token a + k - 1 before slot k
        labels = slot_labels if slot_labels is not None else torch.full_like(rows, IGNORE_INDEX)
        ce, l1, ids, teacher_at = self._slot_terms(out, labels)
        scores = self.candidate_scores(before, ids, predecessors)
        pick = ids.gather(-1, scores.detach().argmax(-1, keepdim=True)).squeeze(-1)
        top = out.teacher_top if out.teacher_top is not None else out.target_logits.argmax(-1)
        valid = labels != IGNORE_INDEX if slot_labels is not None else torch.ones_like(pick, dtype=torch.bool)
        out.hit = (pick == top) & valid
        if slot_labels is not None:
            w = settings.CE_WEIGHT
            logq = F.log_softmax(scores, -1)
            match = ids == labels[..., None]
            out.covered = match.any(-1) & valid
            mass = teacher_at.exp().sum(-1)
            target_q = F.softmax(teacher_at, -1)
            refined_ce = -(logq * match).sum(-1)
            refined_l1 = (logq.exp() - target_q).abs().sum(-1) * (mass > settings.CANDIDATE_MASS)
            codes = self.draft_model.transfer_codes[labels.clamp_min(0)]
            cos = F.cosine_similarity(at_least_fp32(layer_features), codes.float()[None], dim=-1).movedim(0, -1)
            out.spine_ce, out.spine_l1 = ce * valid, l1 * valid
            out.refinement = (w * refined_ce + (1 - w) * refined_l1) * valid
            out.alignment = settings.ALIGNMENT_WEIGHT * ce.detach() * (1 - cos).sum(-1) * valid
        return out

    def slot_guesses(self, texts, anchors, hidden, features, doc) -> torch.Tensor:
        """The walk's picks, each slot's predecessor the text's token before it (what the decode proposes wherever
        the chain has been accepted up to that slot)."""
        before = self.spine[0][:, :, 1 : hidden.shape[2] + 1]
        _, ids, _ = self.slot_top_k(hidden, self.draft_model.candidates)
        rows = (anchors[..., None] + torch.arange(hidden.shape[2], device=anchors.device)).clamp_max(texts.shape[1] - 1)
        scores = self.candidate_scores(before, ids, texts.gather(1, rows.flatten(1)).view_as(rows))
        return ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, before: torch.Tensor, anchor: int, choose) -> tuple[list[int], list]:
        """The decode's path through slots 1..k of one block: ``hidden`` / ``before`` [k, d], ``anchor`` the bonus
        token, ``choose(row)`` -> (token, q or None) from a [V] row that is -inf outside the slot's candidates."""
        _, ids, _ = self.slot_top_k(hidden, self.draft_model.candidates)
        vocab = self.target.get_output_embeddings().out_features  # the weight's shape is a stub under ZeRO-3
        tokens, qs, previous = [], [], anchor
        for t in range(hidden.shape[0]):
            scores = self.candidate_scores(before[t], ids[t], torch.tensor(previous, device=ids.device))
            token, q = choose(scores.new_full((vocab,), float("-inf")).scatter(0, ids[t], scores))
            tokens.append(token)
            qs.append(q)
            previous = token
        return tokens, qs


def init_transfer(model: DSpineModel, target_dir) -> None:
    """A new draft's transfer space from its target's head: the live head, or read from the target's files when the
    target is built empty (sharded loading fills it later)."""
    head = model.target.get_output_embeddings().weight
    if head.device.type == "meta":
        from treadle.models.checkpoint_files import read_target_tensor

        names = ("lm_head.weight", "model.embed_tokens.weight")
        if getattr(model.target.config, "tie_word_embeddings", False):
            names = names[1:]
        head = read_target_tensor(target_dir, names, "draft.target")
    model.draft_model.init_transfer(head)


def build_dspine(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    model, target_dir, ident = build_dflash(cfg, data_vocab, data_tokenizer_fingerprint, empty, DSpineModel)
    if cfg.init is None:
        init_transfer(model, target_dir)
    return model, target_dir, ident
