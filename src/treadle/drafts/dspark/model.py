"""DSpark: a DFlash-style block draft whose every slot drafts, sampled left to right through a Markov head, with a
confidence head that predicts each draft's acceptance.

Written from the DSpark paper (arXiv 2607.05147, ``DSpark_paper.pdf`` §3 in deepseek-ai/DeepSpec) and DeepSpec's
trainer (``deepspec/modeling/dspark/{common,markov_head,loss}.py``, ``qwen3/modeling.py`` @afdfa7c), as vLLM
(``vllm/model_executor/models/qwen3_dspark.py``, ``v1/worker/gpu/spec_decode/dspark/speculator.py``) and SGLang
(``python/sglang/srt/models/dspark.py``) serve it:

    backbone    the DFlash draft (dflash/model.py): fused target features as extra keys/values, a block
                [anchor, MASK, ..., MASK] of ``block_size`` rows at positions anchor..anchor + block_size - 1,
                bidirectional inside the block, context strictly before the anchor
    slot k      k = 0..block_size - 1 guesses the token at anchor + k + 1: the anchor's own slot drafts too
                (block_size inputs give block_size drafts; vLLM's "sample_from_anchor", not DFlash's 1 + N)
    Markov      logits_k = head(h_k) + W2 W1[x_{k-1}], x_{-1} = the anchor, x_{k-1} the previous slot's token:
                teacher-forced (the data's token) in training, the drafted token at decode, left to right
    confidence  c_k = proj([h_k ; W1[x_{k-1}]]) (with bias), trained by BCE toward the slot's acceptance
                rate 1 - TV(draft, target) (detached); sigmoid(c_k) lets an engine verify a shorter prefix

The embedding and head are the target's, frozen (DeepSpec copies and freezes them; both engines share the
target's when the draft ships none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treadle.data.packed import IGNORE_INDEX
from treadle.drafts.dflash.model import (
    DFlashDraft, DFlashModel, _target_ce, check_feature_layers,
)
from treadle.drafts.dspark import layout as dspark_layout
from treadle.drafts.dspark import settings
from treadle.drafts.dspark import speculators as dspark_speculators
from treadle.drafts.glide.model import document_ids
from treadle.models.chunked_ce import chunked_rows
from treadle.models.upcast import at_least_fp32

KIND = "dspark"


class DSparkDraft(DFlashDraft):
    """The DFlash backbone plus the Markov head (``markov_w1`` V x r, ``markov_w2`` r x V) and the confidence head
    (``confidence``: [h ; W1[prev]] -> 1, with bias)."""

    # lora.target_modules = "all-linear" leaves the output heads out (models/lora.py decoder_linear_names): a rank-r
    # update of a 1-output layer or of the rank-r Markov projection adds parameters, not capacity where it helps
    lora_heads = ("markov_w2", "confidence")

    def __init__(self, target_config, feature_layers: tuple[int, ...], num_layers: int = settings.NUM_LAYERS,
                 block_size: int = settings.BLOCK_SIZE, mask_token_id: int | None = None,
                 markov_rank: int = settings.MARKOV_RANK):
        super().__init__(target_config, feature_layers, num_layers, block_size, mask_token_id)
        d, V = self.shape.hidden_size, target_config.vocab_size
        self.markov_rank = markov_rank
        self.markov_w1 = nn.Embedding(V, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, V, bias=False)
        self.confidence = nn.Linear(d + markov_rank, 1)
        std = getattr(target_config, "initializer_range", 0.02)  # as DeepSpec's post_init draws every new module
        for w in (self.markov_w1.weight, self.markov_w2.weight, self.confidence.weight):
            nn.init.normal_(w, std=std)
        nn.init.zeros_(self.confidence.bias)

    kind = KIND
    layout = dspark_layout  # the Qwen3DSparkModel layout, not z-lab's
    speculators = dspark_speculators
    settings = settings  # DSpark's defaults (block 7)

    @classmethod
    def run_options(cls, cfg) -> dict:
        return {"markov_rank": settings.markov_rank(cfg)}

    def init_keys(self) -> tuple:
        return (("markov_rank", self.markov_rank),)

    @classmethod
    def layout_name(cls) -> str:
        return (f"DSpark draft (config.json with architectures = [{dspark_layout.ARCHITECTURE!r}], or "
                "speculators_model_type = 'dspark')")

    @classmethod
    def layout_spec(cls, config: dict, target_config, where) -> dict:
        """The DeepSpec / speculators keys read (dspark/layout.py: ``read_spec``), not z-lab's alone."""
        spec = dspark_layout.read_spec(config, target_config, where)
        check_feature_layers(spec["feature_layers"], target_config.num_hidden_layers,
                             f"{where}/config.json target_layer_ids + 1")
        return spec

    def markov_bias(self, prev_embed: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(prev_embed)

    def confidence_logit(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """Slot logits of acceptance [...]: sigmoid gives the estimated probability the slot's draft is accepted."""
        return self.confidence(torch.cat((hidden, prev_embed.to(hidden.dtype)), -1)).squeeze(-1)



@dataclass
class DSparkOutput:
    """Per scored slot [B, N, block_size] (0 where not scored), computed a chunk of rows at a time."""

    ce: torch.Tensor  # the draft's CE on the data token
    kl: torch.Tensor  # KL(target || draft)
    bce: torch.Tensor  # the confidence head's BCE toward ``accept``
    accept: torch.Tensor  # 1 - TV(draft, target): the slot's acceptance probability under sampled verification
    hit: torch.Tensor  # the draft's argmax equals the target's (bool)
    target_ce: torch.Tensor  # the target's own CE summed over the row's labels (the floor), scalar

    logits = None  # never whole: DFlash's objective reads the per-slot scores (as a chunked DFlash output's)


class DSparkModel(DFlashModel):
    """What a dspark draft run trains: a frozen target and a trainable ``DSparkDraft`` on its fused features."""

    draft_class = DSparkDraft  # what build_dflash / load_dflash make for this run model

    def slot_logits(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """Slot logits [..., V]: the shared head on the slot's hidden state plus the Markov bias of the token before
        it (what training scores and what the drafter samples from)."""
        return self.draft_logits(hidden) + self.draft_model.markov_bias(prev_embed).to(hidden.dtype)

    def _scores(self, hidden, prev, teacher, labels):
        """One chunk of slot rows: the draft's CE, KL(target || draft), the confidence BCE, the acceptance rate and
        whether the argmaxes agree (fp32 softmaxes; the teacher is the target's head on its own last hidden state)."""
        draft = self.draft_model
        embed = draft.markov_w1(prev)
        logp = F.log_softmax(at_least_fp32(self.slot_logits(hidden, embed)), -1)
        with torch.no_grad():  # the teacher is fixed: recomputed in backward, never differentiated
            teacher_logp = F.log_softmax(at_least_fp32(self.draft_logits(teacher)), -1)
        valid = labels != IGNORE_INDEX
        ce = F.nll_loss(logp, labels, ignore_index=IGNORE_INDEX, reduction="none")
        kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="none").sum(-1) * valid
        accept = (1 - 0.5 * (logp.detach().exp() - teacher_logp.exp()).abs().sum(-1)).clamp(0, 1) * valid
        conf = at_least_fp32(draft.confidence_logit(hidden, embed))
        bce = F.binary_cross_entropy_with_logits(conf, accept.to(conf.dtype), reduction="none") * valid
        hit = (logp.detach().argmax(-1) == teacher_logp.argmax(-1)) & valid
        return ce, kl, bce, accept, hit

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, anchors: torch.Tensor,
                doc_position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                slot_labels: torch.Tensor | None = None, reads: dict | None = None) -> DSparkOutput:
        """Blocks at ``anchors`` [B, N] scored against the target: slot k against token anchor + k + 1
        (``slot_labels`` [B, N, block_size], -100 where a slot is not scored; unset: the row's next tokens) and the
        target's distribution at index anchor + k. With ``loss_chunk_tokens`` the slots' and the target's [rows, V]
        logits are made a chunk of rows at a time (recomputed in backward), never whole."""
        doc = document_ids(position_ids if doc_position_ids is None else doc_position_ids)
        bs = self.draft_model.block_size
        T = input_ids.shape[1]
        rows = (anchors[..., None] + torch.arange(bs, device=anchors.device)).clamp_max(T - 1)  # a + k
        B, N, K = rows.shape
        if slot_labels is None:
            nxt = torch.cat((input_ids[:, 1:], input_ids.new_full((B, 1), IGNORE_INDEX)), 1)
            slot_labels = nxt.gather(1, rows.flatten(1)).view(B, N, K)
        target_hidden, features = self._target_forward(input_ids, position_ids, hidden=True, reads=reads)
        hidden = self._blocks(input_ids, position_ids, features, anchors, doc)
        prev = input_ids.gather(1, rows.flatten(1))  # x_{k-1}: the anchor, then the data's tokens (teacher forcing)
        teacher = target_hidden.gather(1, rows.flatten(1)[..., None].expand(-1, -1, target_hidden.shape[-1]))
        flat = [hidden.flatten(0, -2), prev.flatten(), teacher.flatten(0, -2), slot_labels.flatten()]
        chunk = self.loss_chunk_tokens or flat[0].shape[0]
        ce, kl, bce, accept, hit = (chunked_rows(lambda *c: self._scores(*c), flat, chunk) if self.loss_chunk_tokens
                                    else self._scores(*flat))
        target_ce = target_hidden.new_zeros(())
        if labels is not None:
            weight, config = self.target.get_output_embeddings().weight, self.target.config
            with torch.no_grad():
                target_ce = chunked_rows(lambda t, y: _target_ce(t, weight, y, config),
                                         [target_hidden.flatten(0, -2), labels.flatten()], chunk)[0].sum()
        shape = (B, N, K)
        return DSparkOutput(ce.view(shape), kl.view(shape), bce.view(shape), accept.view(shape), hit.view(shape),
                            target_ce)

    @torch.no_grad()
    def chain_guesses(self, texts: torch.Tensor, gamma: int, chunk: int = 64) -> list[torch.Tensor]:
        """Per chain step k = 1..gamma, [N, L] target ids: entry i is the draft's guess for token i + 1 from the
        block anchored at token i - k + 1 (-1 where none), its Markov head fed the text's tokens: in a greedy chain
        slot k is reached only when slots before it were accepted, i.e. equal the text (the target's own)."""
        if gamma > self.draft_model.block_size:
            raise ValueError(f"gamma {gamma} exceeds the block's {self.draft_model.block_size} drafts")
        N, L = texts.shape
        positions = torch.arange(L, device=texts.device).expand_as(texts)
        _, features = self._target_forward(texts, positions, hidden=True, reads=self.eval_reads(texts))
        doc = torch.ones_like(texts)
        slots = []
        for first in range(0, L, chunk):
            anchors = torch.arange(first, min(L, first + chunk), device=texts.device).expand(N, -1)
            hidden = self._blocks(texts, positions, features, anchors, doc)[:, :, :gamma]
            rows = (anchors[..., None] + torch.arange(gamma, device=texts.device)).clamp_max(L - 1)
            prev = texts.gather(1, rows.flatten(1)).view(rows.shape)
            slots.append(self.slot_logits(hidden, self.draft_model.markov_w1(prev)).argmax(-1))
        guess = torch.cat(slots, dim=1)  # [N, L, gamma]: anchor a's slot k - 1 guesses token a + k
        return [torch.cat((guess.new_full((N, k - 1), -1), guess[:, : L - k + 1, k - 1]), dim=1)
                for k in range(1, gamma + 1)]
