"""EAGLE-3: a one-layer draft that reads fused low/mid/high hidden states of the frozen target.

Written from the EAGLE-3 paper and SpecForge's ``llama3_eagle.py`` description:

    f_t = fc([h_low ; h_mid ; h_high]_t)            target features at token t (3d -> d); the layers are
                                                    indices of HF's output_hidden_states (``feature_layers``)
    x   = f_t + Attn(q/k/v over [norm(embed(tok_{t+1})) ; norm(f_t)])     (2d in, d out)
    x   = x + MLP(norm(x))
    logits = lm_head(norm(x))                       its own head, optionally over a reduced vocabulary

Row t of the draft holds the target's feature of token t and the embedding of the next
token, and predicts the token after that (the target's distribution at t + 1).

Training-time test (TTT): step k >= 1 feeds, as the feature of row t, the draft's own
output ``x`` of step k - 1 at row t, with the embedding of the token k further on and the
RoPE position t + k: exactly what the k-th link of a decode chain computes. Its attention
sees step 0's rows <= t (the accepted context, with real target features) and its own
chain (steps 1..k at row t) and nothing else: ``ttt_mask``. Because the draft has one
layer, a decode cache of step-0 rows stays exact forever (it depends only on accepted
tokens and target features), and chain rows are thrown away after each proposal.

Reduced vocabulary (``draft.vocab_size``): the head scores the most frequent training
tokens only. ``d2t[i]`` is the offset from draft id i to its target id (EAGLE-3's format)
and ``t2d[j]`` says whether target id j is in the draft vocabulary; both are buffers of
the draft, in its checkpoints and export, and a reduced draft without them is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN

from treadle.errors import UserError
from treadle.drafts.kind import init_dir
from treadle.drafts.eagle3 import layout as eagle3_layout
from treadle.drafts.eagle3.attention import UnrollKeys
from treadle.drafts.glide.model import (
    WHOLE, GlideShape, RMSNorm, WholeSequences, checked_export,
    document_ids, init_linears, read_draft_config, sdpa, self_attention_inputs, target_mask,
)
from treadle.drafts.masks import ttt_rule
from treadle.drafts.run_model import DraftRunModel, FusedFeatureReads
from treadle.drafts.targets import capture_features, draft_target
from treadle.drafts.ttt_scores import UnrollScores, chunked_unroll_scores

KIND = "eagle3"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high picks 2, N/2 and N - 3, as indices of Hugging Face's ``output_hidden_states``
    (0 = the embedding output, i = decoder layer i's output). A target too shallow for three increasing such picks
    gets 1, N/2 and N - 1. Index N is never a default: Hugging Face normalizes that entry, a hook does not."""
    picks = (2, num_layers // 2, num_layers - 3)
    if picks[0] < picks[1] < picks[2]:
        return picks
    return (1, max(1, num_layers // 2), max(1, num_layers - 1))


# ----------------------------------------------------------------------------- the draft block


def draft_shape(target_config) -> GlideShape:
    """The draft layer's dimensions: the target's attention dimensions, a Llama layer's SiLU MLP and no biases,
    whatever the family (vLLM's and SGLang's Llama draft layer runs SiLU only).

    Its MLP width is the target config's ``intermediate_size``, for MoE targets too, as the engines' reference drafts
    take it: the dense MLP width where the config has one beside the experts' (Qwen3-MoE, DeepSeek-V3's dense
    layers; SpecForge's Qwen3-30B-A3B draft has 6144, not the experts' 768), the one expert's width where it has
    only that (Mixtral, gpt-oss).
    """
    return dataclasses.replace(GlideShape.of(target_config), hidden_act="silu", attention_bias=False)


def draft_rotary(target_config) -> nn.Module:
    """The draft layer's rotary embedding: a Llama rotary over the whole head with the target's rotary parameters
    (theta, scaling), what an engine builds from the export's config.json. Not the target's own module, which for
    some families rotates differently shaped heads (gpt-oss's half-width cos/sin, GLM-4's partial rotary) or holds
    one set per layer type (Gemma 3: the draft takes the full-attention layers')."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    s = draft_shape(target_config)
    rope = eagle3_layout.draft_rope_parameters(target_config)  # what the export writes: one source for both
    config = LlamaConfig(hidden_size=s.hidden_size, num_attention_heads=s.num_attention_heads, head_dim=s.head_dim,
                         max_position_embeddings=target_config.max_position_embeddings, rope_parameters=rope)
    return LlamaRotaryEmbedding(config=config)


class Eagle3Draft(nn.Module):
    """The trainable draft: fc, one decoder layer on [embedding ; feature], its own norm and LM head.

    It owns no embedding (the target's is shared, frozen).
    """

    def __init__(self, target_config, feature_layers: tuple[int, ...], vocab_size: int | None = None):
        super().__init__()
        s = self.shape = draft_shape(target_config)
        d = s.hidden_size
        self.feature_layers = tuple(feature_layers)
        self.target_vocab_size = target_config.vocab_size
        self.vocab_size = vocab_size or self.target_vocab_size
        q_out, kv_out = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        self.fc = nn.Linear(len(self.feature_layers) * d, d, bias=False)
        self.embed_norm = RMSNorm(d, eps=s.rms_norm_eps)
        self.feature_norm = RMSNorm(d, eps=s.rms_norm_eps)
        # Bias-free whatever the target has (as SpecForge builds it): SGLang's layer has no q/k/v bias and skips a
        # checkpoint's without a word, vLLM would want an o_proj bias with it.
        self.q_proj = nn.Linear(2 * d, q_out, bias=False)
        self.k_proj = nn.Linear(2 * d, kv_out, bias=False)
        self.v_proj = nn.Linear(2 * d, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, d, bias=False)
        self.mlp_norm = RMSNorm(d, eps=s.rms_norm_eps)
        self.gate_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, d, bias=False)
        self.act = ACT2FN[s.hidden_act]
        self.final_norm = RMSNorm(d, eps=s.rms_norm_eps)
        self.lm_head = nn.Linear(d, self.vocab_size, bias=False)
        init_linears(self, target_config)
        if self.reduced:  # filled by set_vocabulary (a run) or load_state_dict (a checkpoint, an export)
            self.register_buffer("d2t", torch.zeros(self.vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.target_vocab_size, dtype=torch.bool))

    @property
    def reduced(self) -> bool:
        return self.vocab_size < self.target_vocab_size

    # torch.utils.checkpoint's keyword arguments when activation checkpointing is on (models/checkpointing.py).
    checkpoint_kwargs: dict | None = None

    def set_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """The draft vocabulary: [vocab_size] target ids, in draft-id order."""
        ids = draft_to_target.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self) -> torch.Tensor | None:
        """[vocab_size] target id of each draft id (None: the draft scores the target's whole vocabulary)."""
        if not self.reduced:
            return None
        return self.d2t + torch.arange(self.vocab_size, device=self.d2t.device)

    def target_to_draft(self) -> torch.Tensor | None:
        """[target vocab] draft id of each target id, -1 outside the draft vocabulary (None: not reduced)."""
        if not self.reduced:
            return None
        index = torch.full((self.target_vocab_size,), -1, dtype=torch.long, device=self.t2d.device)
        index[self.draft_to_target()] = torch.arange(self.vocab_size, device=self.t2d.device)
        return index

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if not self.reduced else draft_ids + self.d2t[draft_ids]

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], -1, self.shape.head_dim).transpose(1, 2)  # [B, H, T, D]

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor, past_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The layer's output (before the final norm: the next TTT step's feature) and this call's K/V.

        ``feature`` is ``fc``'s output (step 0) or an earlier step's output; ``past_kv`` holds keys and values
        the rows may also attend to, in ``mask``'s key order before this call's own. ``mask`` may instead be a
        training unroll's ``UnrollKeys`` (no ``past_kv``): the K/V returned are then what its next step keeps.
        """
        if self.checkpoint_kwargs is not None and self.training and torch.is_grad_enabled():
            return checkpoint(self._block, embeds, feature, rope, mask, past_kv, **self.checkpoint_kwargs)
        return self._block(embeds, feature, rope, mask, past_kv)

    def _block(self, embeds, feature, rope, mask, past_kv):
        cos, sin = rope
        h = torch.cat((self.embed_norm(embeds), self.feature_norm(feature)), dim=-1)
        q, k, v, new_kv = self_attention_inputs(self, h, cos, sin, past_kv)
        if isinstance(mask, UnrollKeys):  # a training unroll's keys, without a dense mask (drafts/eagle3/attention.py)
            attn, new_kv = mask.attend(q, k, v)
        else:  # a dense mask (decoding, the reference unroll) or a mask rule (drafts/masks.py: flex on CUDA)
            attn = sdpa(q, k, v, mask)
        x = feature + self.o_proj(attn.transpose(1, 2).flatten(2))
        h = self.mlp_norm(x)
        return x + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h)), new_kv

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of a layer output."""
        return self.lm_head(self.final_norm(x))

    def export_config(self) -> dict:
        """treadle's own key in config.json; the rest of it is the EAGLE layout's (``eagle3_layout.config_of``)."""
        return {"treadle_draft_kind": KIND}


# ----------------------------------------------------------------------------- draft and target together


@dataclass
class Eagle3Output:
    logits: list[torch.Tensor] | None  # per TTT step, the draft's [B, T, draft vocab] (row t: step k's guess of token t+k+2)
    target_logits: torch.Tensor | None  # the frozen target's [B, T, V] on the same input
    # With a chunked loss (loss_chunk_tokens, labels given) neither exists whole: per-row scores instead.
    scores: UnrollScores | None = None


class Eagle3Model(FusedFeatureReads, DraftRunModel):
    """What an eagle3 draft run trains: a frozen target and a trainable ``draft_model`` on its fused features.
    ``loss_chunk_tokens`` > 0: ``forward(labels=...)`` returns per-row scores computed chunk by chunk
    (drafts/ttt_scores.py) instead of whole logits."""

    # True: the unroll's attention through dense masks over every step's keys (O(K^2 T^2)), the reference the
    # masked-free attention (drafts/eagle3/attention.py) is tested and benchmarked against.
    dense_attention = False

    def __init__(self, target, draft_model: Eagle3Draft):
        super().__init__(target, draft_model)
        self.rotary = draft_rotary(target.config)  # buffers only, not saved
        # Whole sequences, or (context parallelism) a slice of each: engine/context_parallel.py swaps it in.
        self.sequences = WHOLE

    # Methods evaluations call directly: a sharding engine gathers parameters around them (see GlideModel).
    fsdp_forward_methods = ("chain_guesses", "continue_greedily")

    def chain_guesses(self, texts: torch.Tensor, gamma: int) -> list[torch.Tensor]:
        """Per chain step k = 1..gamma, [N, L] target ids: entry i is the draft's guess for token i + 1 when a
        decode's chain that started after token i - k + 1 reaches step k with every earlier step accepted."""
        positions = torch.arange(texts.shape[1], device=texts.device).expand_as(texts)
        _, features = self._target_forward(texts, positions, hidden=True, reads=self.eval_reads(texts))
        hidden = self._unroll(texts, positions, features, gamma)
        draft = self.draft_model
        guesses = []
        for k, x in enumerate(hidden, start=1):  # step k - 1's row t guesses token t + k + 1: move it to index t + k
            ids = draft.to_target_ids(draft.logits(x).argmax(-1))
            guesses.append(torch.cat((ids.new_full((ids.shape[0], k), -1), ids[:, : ids.shape[1] - k]), dim=1))
        return guesses

    def _target_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden: bool = False,
                        seq: WholeSequences = WHOLE, reads: dict | None = None):
        """The target's logits (or, ``hidden``, the final hidden states its head reads) and its features
        ([B, T, len(feature_layers) * d]) for packed rows, without grad (``seq``: ``input_ids`` is this rank's
        slice; the mask is the whole sequence's); from ``reads`` (a store's, drafts/run_model.py) when given."""
        if reads is not None:
            return self.from_reads(reads, hidden)
        self.check_live()
        run = self.target.model if hidden else self.target
        mask = target_mask(seq.gather(position_ids, 1), self.target)  # the whole sequence's, on every rank
        with (torch.no_grad(), capture_features(self.target, self.draft_model.feature_layers) as tap,
              seq.attention(self.target)):
            out = run(input_ids=input_ids, position_ids=position_ids, use_cache=False, attention_mask=mask)
            return out.last_hidden_state if hidden else out.logits, tap.take()

    def _unroll(self, input_ids: torch.Tensor, position_ids: torch.Tensor, features: torch.Tensor, steps: int,
                doc_position_ids: torch.Tensor | None = None, seq: WholeSequences = WHOLE) -> list[torch.Tensor]:
        """The draft's layer outputs of TTT steps 0..steps-1, each [B, T, d] (see the module docstring); ``seq``:
        the rows are this rank's slice of the sequence (documents, tokens and step 0's keys are gathered)."""
        B, T = input_ids.shape
        doc = document_ids(seq.gather(position_ids if doc_position_ids is None else doc_position_ids, 1))
        embed = self.target.get_input_embeddings()
        # Step k's row t reads token t + 1 + k; rows past the end read a filler token and are never scored.
        whole = seq.gather(input_ids, 1)
        padded = torch.cat((whole, whole[:, -1:].expand(B, steps)), dim=1)
        first = seq.start(T)
        feature = self.draft_model.fc(features.to(self.draft_model.fc.weight.dtype))
        keys: tuple[torch.Tensor, torch.Tensor] | None = None
        unroll = UnrollKeys(doc, first, gather=None if seq is WHOLE else seq.gather)
        out = []
        for k in range(steps):
            embeds = embed(padded[:, first + 1 + k : first + 1 + k + T])
            rope = self.rotary(embeds, position_ids + k)
            if self.dense_attention or self.flex_masks:  # every step's keys, under the unroll's mask rule
                mask = ttt_rule(doc, k, flex=self.flex_masks)
                feature, (nk, nv) = self.draft_model(embeds, feature, rope, mask, past_kv=keys)
                keys = (nk, nv) if keys is None else (torch.cat((keys[0], nk), 2), torch.cat((keys[1], nv), 2))
            else:
                feature, kv = self.draft_model(embeds, feature, rope, unroll)
                unroll = unroll.after(kv)
            out.append(feature)
        return out

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, steps: int = 1,
                doc_position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                reads: dict | None = None) -> Eagle3Output:
        """``reads``: the target's reads of these rows from a store (drafts/run_model.py); None: the target runs."""
        seq = self.sequences
        if labels is None or not self.loss_chunk_tokens:
            if seq is not WHOLE:  # whole logits of a slice cannot be scored ahead across the cut
                raise RuntimeError("an eagle3 draft on sequence slices scores chunk by chunk: pass labels and set "
                                   "loss_chunk_tokens")
            target_logits, features = self._target_forward(input_ids, position_ids, reads=reads)
            hidden = self._unroll(input_ids, position_ids, features, steps, doc_position_ids)
            return Eagle3Output([self.draft_model.logits(x) for x in hidden], target_logits)
        # Both heads a chunk of rows at a time (here, inside forward: a sharding engine holds their weights now).
        target_hidden, features = self._target_forward(input_ids, position_ids, hidden=True, seq=seq, reads=reads)
        hidden = self._unroll(input_ids, position_ids, features, steps, doc_position_ids, seq)
        draft = self.draft_model
        scores = chunked_unroll_scores(draft.logits, hidden, seq.gather(target_hidden, 1),
                                       self.target.get_output_embeddings(), labels, draft.target_to_draft(),
                                       draft.draft_to_target(), 1, self.loss_chunk_tokens,
                                       whole_labels=seq.gather(labels, 1), start=seq.start(input_ids.shape[1]),
                                       gather=seq.gather, config=self.target.config)
        scores.positions = seq.gather(position_ids if doc_position_ids is None else doc_position_ids, 1)
        scores.labels, scores.start = seq.gather(labels, 1), seq.start(input_ids.shape[1])
        return Eagle3Output(None, None, scores)


# ----------------------------------------------------------------------------- building and loading


def frequent_tokens(counts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ``vocab_size`` most frequent token ids (ties: the lower id), in increasing id order."""
    order = torch.argsort(-counts.double(), stable=True)[:vocab_size]
    return order.sort().values


def check_feature_layers(layers: tuple[int, ...], num_layers: int, key: str) -> None:
    """Refused when the run is configured, not discovered at export: what the engines cannot serve."""
    eagle3_layout.check_feature_layers(layers, num_layers, key)


def build_eagle3(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(Eagle3Model, target dir, target identity) for a ``DraftConfig``; a reduced vocabulary's maps are left to
    the caller (``Eagle3Draft.set_vocabulary``: a run counts its data, a checkpoint or export holds them), except
    for a draft started from ``draft.init``, whose weights, feature layers and map are the directory's."""
    target_dir, target, ident = draft_target(cfg, data_vocab, data_tokenizer_fingerprint, empty)
    if cfg.init is not None:
        draft = _draft_from_layout(init_dir(cfg.init), target, "draft.init")
        for key, want, have in (("feature_layers", cfg.feature_layers, list(draft.feature_layers)),
                                ("vocab_size", cfg.vocab_size, draft.vocab_size)):
            if want is not None and want != have:
                raise UserError(f"draft.{key} = {want} but draft.init {cfg.init} has {have}; accepted: draft.{key} "
                                "unset (the initial draft's) or equal to it")
        return Eagle3Model(target, draft), target_dir, ident
    num_layers = target.config.num_hidden_layers
    layers = tuple(cfg.feature_layers) if cfg.feature_layers else default_feature_layers(num_layers)
    check_feature_layers(layers, num_layers, "draft.feature_layers")
    vocab = cfg.vocab_size
    if vocab is not None and vocab > target.config.vocab_size:
        raise UserError(f"draft.vocab_size = {vocab} exceeds the target's vocabulary ({target.config.vocab_size}); "
                        "accepted: 1..the target's vocab_size, or unset for the whole vocabulary")
    return Eagle3Model(target, Eagle3Draft(target.config, layers, vocab)), target_dir, ident



def _draft_from_layout(draft_dir, target, where: str) -> Eagle3Draft:
    """The Eagle3Draft an EAGLE-layout directory holds, checked against ``target`` (a treadle export also by its
    target's config fingerprint, one trained elsewhere by its dimensions)."""
    from safetensors.torch import load_file

    from treadle.models.finite import check_tensors

    config = read_draft_config(draft_dir)
    if config is None or not eagle3_layout.is_layout(config):
        raise UserError(f"{where} {draft_dir} is not an EAGLE-3 draft in the EAGLE layout (config.json with "
                        f"architectures = [{eagle3_layout.ARCHITECTURE!r}]); a treadle export written before that "
                        "layout: export its run's checkpoint again (treadle export RUN OUT)")
    if "target" in config:
        checked_export(draft_dir, target, KIND, "an eagle3")
    eagle3_layout.check_fits(config, target.config, draft_dir)
    layers = eagle3_layout.feature_layers(config, target.config.num_hidden_layers, draft_dir)
    draft = Eagle3Draft(target.config, layers, config.get("draft_vocab_size") or target.config.vocab_size)
    if draft.vocab_size > draft.target_vocab_size:
        raise UserError(f"{where} {draft_dir}: draft_vocab_size {draft.vocab_size} exceeds the target's vocabulary "
                        f"({draft.target_vocab_size})")
    file = Path(draft_dir) / "model.safetensors"
    tensors = check_tensors(load_file(str(file)), file, where)
    draft.load_state_dict(eagle3_layout.import_weights(tensors, draft, draft_dir))
    return draft


def load_eagle3(draft_dir, target) -> Eagle3Model:
    """An EAGLE-3 draft in the EAGLE layout (treadle's export, or one trained elsewhere for this target) attached to
    ``target``. A treadle export is also checked against its target's config fingerprint."""
    return Eagle3Model(target, _draft_from_layout(draft_dir, target, "draft")).eval()
