"""An MTP head as the serving engines run it, trained against its frozen target.

One module, the target family's own, as vLLM's MTP layers and transformers' ``MtpLayer`` compute it, for every
family with a layout in drafts/mtp/layout.py (DeepSeek-V3, GLM-4-MoE: ``model.layers.{N}.*``; Qwen3-Next, Qwen3.5:
``mtp.*``); the families differ in names and in the few switches of their ``layout.Family``, not in code:

    e   = enorm(embed(token t + 1))       the target's frozen embedding; zero where t is a document's position 0 if
                                          the family's engine does that (``zero_first``: vLLM's DeepSeek/GLM layers)
    x   = eh_proj(cat[e, hnorm(h_t)])     h_t: the target's final (normed) hidden state of token t; cat[h, e] where
                                          the family puts the hidden state first (``hidden_first``)
    x   = block(x)                        one decoder layer of the target's class: DeepSeek/GLM from transformers'
                                          MTP config (MLA attention; MoE, as ``get_mtp_config`` makes every MTP
                                          layer), Qwen from the target's config with the layer forced to full
                                          attention (hybrid Gated-DeltaNet models), its MLP a MoE where the target's
                                          layer 0 rule says so (vLLM's ``Qwen3NextDecoderLayer`` at index 0)
    logits = target.lm_head(post_norm(x)) ``shared_head.norm`` / ``mtp.norm``, then the target's frozen head

Row t guesses token t + 2. Recursive steps (``draft.ttt_steps`` = K): the engines replay the one module K times,
step k feeding the previous step's output back (``MtpDraft.carry``: DeepSeek/GLM the block output before the norm,
as vLLM's proposer hands back what the layer returns; Qwen3-Next the normed one, which its layer returns; transformers'
``MtpModel`` feeds the normed one, but it only chains distinct modules) and the token k further on, at the next
position, attending to step 1's rows of the accepted context and its own chain (``ttt_mask``): exactly what a decode
computes, where step 1's K/V cache depends on accepted tokens only.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from treadle.drafts.glide.model import as_mask, document_ids, target_mask, ttt_mask
from treadle.drafts.kind import init_dir
from treadle.drafts.mtp import layout
from treadle.drafts.recurrent import UnrollOutput, guesses_by_step
from treadle.drafts.ttt_scores import chunked_unroll_scores
from treadle.drafts.run_model import DraftRunModel
from treadle.drafts.targets import draft_target
from treadle.errors import UserError
from treadle.models.checkpoint_files import read_layer, read_target_tensor
from treadle.models.hf import cache_kwargs

KIND = "mtp"


def mtp_config(target, where) -> object:
    """The config the MTP block is built from (one layer, index 0), or a one-line refusal for a family without an
    MTP layout or with more than one stored module."""
    c = target.config
    family = layout.family_of(c.model_type)
    if family.layer_type is not None:  # the target's own config, the one layer of the forced type
        stored = max(getattr(c, k, None) or 0 for k in family.count_keys)
        config = copy.deepcopy(c)
        config.layer_types, config.num_hidden_layers = [family.layer_type], 1
    elif getattr(c, "num_mtp_layers", None) is None or not hasattr(c, "get_mtp_config"):
        raise UserError(f"{where} is a {c.model_type!r} model without an MTP layout (config num_nextn_predict_layers: "
                        "deepseek_v3, glm4_moe, qwen3_next ...; mtp_num_hidden_layers: qwen3_5_text ...); accepted: "
                        "such a target, or draft.kind = 'eagle3' for this one")
    else:  # transformers' MTP config: layer index 0, every MLP a MoE
        stored, config = c.num_mtp_layers, c.get_mtp_config()
        config.num_mtp_layers = 1
    if stored > 1:
        raise UserError(f"{where} stores {stored} MTP modules; treadle fine-tunes one module, replayed ttt_steps times "
                        f"as vLLM and SGLang serve it; accepted: {family.count_keys[0]} = 1")
    return config


class MtpDraft(nn.Module):
    """The trainable MTP module, under transformers' ``MtpLayer`` names for every family (drafts/mtp/layout.py
    converts them to the family's)."""

    def __init__(self, target, config=None):
        super().__init__()
        config = config if config is not None else mtp_config(target, "draft.target")
        self.config = config
        self.family = family = layout.family_of(target.config.model_type)
        self.hidden_first = family.hidden_first or bool(getattr(config, "mtp_hidden_states_first", False))
        # Per family (layout.Family.zero_first); the transformers contract test turns it off to compare with
        # transformers' MtpModel, which does not zero.
        self.zero_first_embedding = family.zero_first
        norm_cls, d = type(target.model.norm), config.hidden_size
        self.enorm = norm_cls(d, eps=config.rms_norm_eps)
        self.hnorm = norm_cls(d, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.mtp_block = type(target.model.layers[-1])(config, 0)
        self.post_norm = norm_cls(d, eps=config.rms_norm_eps)
        for m in self.modules():  # the family's own initialisation (its experts are torch.empty until then)
            if m is not self:
                target._init_weights(m)

    def forward(self, embeds, hidden, rope, mask, position_ids, cache):
        """The block output [B, T, d] (before ``post_norm``: what the next step reads) of one step."""
        e, h = self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))
        x = self.eh_proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))
        return self.mtp_block(x, attention_mask=mask, position_embeddings=rope, position_ids=position_ids,
                              **cache_kwargs(self.mtp_block, cache))

    def carry(self, x: torch.Tensor) -> torch.Tensor:
        """What the next replayed step reads of this step's block output ``x`` (layout.Family.chain_normed)."""
        return self.post_norm(x) if self.family.chain_normed else x

    def export_config(self) -> dict:
        return {"treadle_draft_kind": KIND}


def last_layer_and_norm(target, target_dir: Path | None) -> tuple[dict, torch.Tensor] | None:
    """The target's last decoder layer's tensors (its block's names, experts fused) and its final norm's weight: from
    the live module, or from the checkpoint's files while the target is still on the meta device (a sharding engine
    builds it empty and fills it after the draft exists); None when neither is there."""
    if not target.model.norm.weight.is_meta:
        return target.model.layers[-1].state_dict(), target.model.norm.weight
    if target_dir is None:
        return None
    n = target.config.num_hidden_layers - 1
    tensors = layout.from_checkpoint(read_layer(Path(target_dir), f"model.layers.{n}.", "draft.target"),
                                     layout.DEEPSEEK)
    last = {k[len(layout.BLOCK):]: v for k, v in tensors.items() if k.startswith(layout.BLOCK)}
    return last, read_target_tensor(Path(target_dir), ("model.norm.weight",), "draft.target")


def init_new(draft: MtpDraft, target, target_dir: Path | None = None) -> str:
    """A new MTP module for a target that ships none: the decoder block from the target's last layer where it has
    the same structure (attention and norms always; the MLP when it is a MoE too), ``post_norm`` from the target's
    final norm (the head was trained on its output), ``eh_proj`` = [small random | identity]: at the start the
    module is one more target layer over the hidden state, with the next token mixed in a little. A target built
    empty (FSDP2, ZeRO-3) is read from ``target_dir``'s files instead. Returns what was copied, for the run's log."""
    found = last_layer_and_norm(target, target_dir)
    if found is None:
        return "random (the target is not materialised yet)"
    last, norm = found
    with torch.no_grad():
        mine = draft.mtp_block.state_dict()
        same = {k: v for k, v in last.items() if k in mine and mine[k].shape == v.shape}
        draft.mtp_block.load_state_dict(same, strict=False)
        draft.post_norm.weight.copy_(norm)
        d = draft.config.hidden_size
        std = getattr(target.config, "initializer_range", 0.02)
        w = torch.zeros(d, 2 * d)
        w[:, :d].normal_(0.0, std)
        w[:, d:] = torch.eye(d)
        if draft.hidden_first:
            w = torch.cat((w[:, d:], w[:, :d]), dim=1)
        draft.eh_proj.weight.copy_(w)
    return f"new: {len(same)} of {len(mine)} block tensors from the target's last layer"


class MtpModel(DraftRunModel):
    """What an mtp draft run trains: the frozen target and its MTP module."""

    fsdp_forward_methods = ("chain_guesses", "continue_greedily")
    trunk_reads = ("hidden",)  # the module reads the target's final hidden state: DeepSeek-V3's joint MTP loss path
    chunked_unroll = True  # its steps score through the target's head: model.loss_chunk_tokens applies

    def target_reads(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": self._target_forward(input_ids, position_ids)}

    def _target_forward(self, input_ids, position_ids, reads: dict | None = None) -> torch.Tensor:
        """The target's final hidden states (after its norm: what its head and the MTP module read), no grad."""
        if reads is not None:
            return reads["hidden"]
        self.check_live()
        mask = target_mask(position_ids, self.target)
        with torch.no_grad():
            return self.target.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                     attention_mask=mask).last_hidden_state

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.teacher_logits(self.draft_model.post_norm(x))

    def _unroll(self, input_ids, position_ids, target_hidden, steps: int, doc_position_ids=None) -> list:
        """The block outputs of steps 1..``steps``, each [B, T, d] (module docstring)."""
        from transformers import DynamicCache

        draft = self.draft_model
        B, T = input_ids.shape
        doc_pos = position_ids if doc_position_ids is None else doc_position_ids
        doc = document_ids(doc_pos)
        embed = self.target.get_input_embeddings()
        # Step k's row t reads token t + k; rows past the end read a filler token and are never scored.
        padded = torch.cat((input_ids, input_ids[:, -1:].expand(B, steps)), dim=1)
        cache = DynamicCache(config=draft.config)  # step 1's keys, then each step's: the unroll's key blocks
        hidden, out = target_hidden, []
        for k in range(steps):
            embeds = embed(padded[:, 1 + k: 1 + k + T])
            if k == 0 and draft.zero_first_embedding:
                embeds = embeds.masked_fill((doc_pos == 0)[..., None], 0.0)
            pos = position_ids + k
            mask = as_mask(ttt_mask(doc, k), self.target.config, embeds.dtype)
            x = draft(embeds, hidden, self.rotary(embeds, pos), mask, pos, cache)
            out.append(x)
            hidden = draft.carry(x)
        return out

    def forward(self, input_ids, position_ids, steps: int = 1, doc_position_ids=None, reads: dict | None = None,
                labels: torch.Tensor | None = None):
        target_hidden = self._target_forward(input_ids, position_ids, reads)
        hidden = self._unroll(input_ids, position_ids, target_hidden, steps, doc_position_ids)
        if labels is None or not self.loss_chunk_tokens:
            return UnrollOutput([self.draft_logits(x) for x in hidden], self.teacher_logits(target_hidden),
                                target_hidden)
        # Both sides through the target's head a chunk of rows at a time (here, inside forward: a sharding engine
        # holds the head's weight gathered now).
        scores = chunked_unroll_scores(self.draft_logits, hidden, target_hidden, self.target.get_output_embeddings(),
                                       labels, None, None, 1, self.loss_chunk_tokens, config=self.target.config)
        scores.positions, scores.labels = position_ids if doc_position_ids is None else doc_position_ids, labels
        return UnrollOutput(None, None, target_hidden, scores=scores)

    @torch.no_grad()
    def chain_guesses(self, texts: torch.Tensor, gamma: int) -> list[torch.Tensor]:
        """Per chain step k = 1..gamma, [N, L] target ids: entry i is the draft's guess for token i + 1 when a
        decode's chain that started after token i - k + 1 reaches step k with every earlier step accepted."""
        positions = torch.arange(texts.shape[1], device=texts.device).expand_as(texts)
        hidden = self._unroll(texts, positions, self._target_forward(texts, positions, self.eval_reads(texts)), gamma)
        return guesses_by_step([self.draft_logits(x).argmax(-1) for x in hidden])


# ----------------------------------------------------------------------------- building and loading


def draft_from_dir(model_dir, target, where: str, config=None) -> MtpDraft:
    """The MTP module a directory holds: a stand-alone export (treadle's, or SGLang's NextN layout
    ``model.layers.0.*``) or a checkpoint carrying its layer (``model.layers.{num_hidden_layers}.*`` / ``mtp.*``: a
    stitched export, or a target that ships one), read from its safetensors (transformers drops MTP keys when it
    loads a target); every name checked against the module the target's family builds."""
    draft = MtpDraft(target, config)
    prefix, found = layout.layer_prefix(model_dir)
    if found.get("treadle_draft_kind") == KIND and "target" in found:
        from treadle.drafts.glide.model import checked_export

        checked_export(model_dir, target, KIND, "an mtp")
    from treadle.drafts.mtp import speculators

    if speculators.is_layout(found):  # speculators' MTPDraftModel (treadle's --to speculators or trained there)
        weights = speculators.import_weights(read_layer(Path(model_dir), "", where), f"{where} {model_dir}")
    else:
        tensors = layer_tensors(model_dir, prefix, draft.family, where)
        if not tensors:
            raise UserError(f"{where} {model_dir} holds no MTP layer ({prefix}*); accepted: an mtp export (draft/ or "
                            "draft/stitched/ of a run) or a checkpoint that ships its MTP layer")
        weights = layout.from_checkpoint(tensors, draft.family)
    mine = draft.state_dict()
    layout.check_names(weights, mine, f"{where} {model_dir}")
    wrong = [k for k in mine if weights[k].shape != mine[k].shape]
    if wrong:
        raise UserError(f"{where} {model_dir}: MTP layer tensor {wrong[0]} is {tuple(weights[wrong[0]].shape)}, the "
                        f"target's module needs {tuple(mine[wrong[0]].shape)}; accepted: an MTP layer of this target")
    draft.load_state_dict(weights)
    return draft


def layer_tensors(model_dir, prefix: str, family, key: str | None = None) -> dict:
    """The MTP layer's own tensors under ``prefix`` (names after it), without the copies of the target's; ``key``
    names ``model_dir``'s setting in a refusal."""
    shared = layout.shared_names(family)
    return {k: v for k, v in read_layer(Path(model_dir), prefix, key).items() if k not in shared}


def shipped_layer(target_dir: Path, target) -> dict:
    """The MTP tensors the target checkpoint itself carries (``model.layers.{N}.*`` / ``mtp.*``; empty: none)."""
    family = layout.family_of(target.config.model_type)
    return layer_tensors(target_dir, family.prefix(target.config.num_hidden_layers, alone=False), family,
                         "draft.target")


def build_mtp(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(MtpModel, target dir, target identity): the module from ``draft.init``, else the one the target ships, else a
    new one (``init_new``)."""
    target_dir, target, ident = draft_target(cfg, data_vocab, data_tokenizer_fingerprint, empty)
    config = mtp_config(target, f"draft.target {target_dir or 'self (the model)'}")
    if cfg.init is not None:
        draft, origin = draft_from_dir(init_dir(cfg.init), target, "draft.init", config), f"draft.init {cfg.init}"
    elif target_dir is not None and shipped_layer(target_dir, target):
        draft, origin = draft_from_dir(target_dir, target, "draft.target", config), "the layer the target ships"
    else:
        draft = MtpDraft(target, config)
        origin = init_new(draft, target, target_dir)
    model = MtpModel(target, draft)
    model.origin = f"MTP module: {origin}"
    return model, target_dir, ident


def load_mtp(draft_dir, target) -> MtpModel:
    """An MTP export (either way) attached to ``target``."""
    return MtpModel(target, draft_from_dir(draft_dir, target, "draft")).eval()
