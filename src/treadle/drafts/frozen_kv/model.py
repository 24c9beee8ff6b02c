"""Gemma 4's assistant as a draft: transformers' own ``Gemma4AssistantForCausalLM``, trained against its frozen target.

What serving computes (transformers' ``SinglePositionMultiTokenCandidateGenerator``, vLLM's ``gemma4_mtp``): once the
target has processed tokens 0..t and picked token t + 1, the assistant runs K steps, all at position t + 1:

    x_1     = cat[target.embed(token t + 1), h_t]   the target's scaled embedding; h_t its final hidden state, after
                                                    the final norm (generate's ``hidden_states[-1]`` is tied to it)
    y_k     = assistant.model(pre_projection(x_k))  Q-only layers: each attends to the target's stored K/V of its own
                                                    type (the last full and the last sliding target layer's) over
                                                    tokens 0..t, a sliding layer to the last sliding_window + 1 of them
                                                    (transformers' window: a bidirectional one, flipped)
    logits_k = lm_head(y_k)                         (or the centroid-masked head); token_k = its argmax
    x_{k+1} = cat[target.embed(token_k), post_projection(y_k)]

Training (``draft.ttt_steps`` = K) computes those steps for every row t of packed documents at once: row t of step k
reads the data's token t + k (teacher forced, as the mtp kind) and step k - 1's ``post_projection`` output (with
gradient), attends to the target K/V of its own document's tokens <= t, and guesses token t + k + 1. The masks are
handed to the assistant's decoder as a dict per layer type, so transformers' mask builders are bypassed; they are the
same for every step (a round stays at one position). The forward is the assistant's own, split where the masks go in
(``FrozenKvDraft.step``): ``pre_projection``, ``model``, ``post_projection``, ``lm_head``.

What is shared with GLIDE, and what is not: both read the frozen target's K/V (``_target_forward`` returns the hidden
state and the K/V, ``target_reads`` token-major, the same shape of interface as GLIDE's) and both use
``glide.model``'s document masks (``attention_mask``, ``causal_document_mask``). The computations differ: GLIDE's
block has its own self-attention K/V over the draft's tokens and one cross-attention over the target's *last* layer,
at each token's own position; the assistant has no K/V of its own, Q-only layers over *both* the last sliding and
the last full target layer, one constant position per round and a recurrent hidden input. A GLIDE draft for a Gemma 4
target therefore cannot be exported in this layout (nor the reverse): there is no weight mapping between the two.

The centroid-masked head (``use_ordered_embeddings``, the shipped assistants): serving scores only the tokens of the
top-k centroids (``masked_embedding.centroids`` over the decoder output; ``token_ordering`` lists each centroid's
tokens). Training scores the dense logits (``lm_head``) and adds, per step, the CE of the centroid logits against
the guessed token's centroid (``aux_logits``), so the centroids keep pointing at the tokens the trained head now
prefers; ``token_ordering`` is a buffer, exported exactly as loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from treadle.drafts.glide.model import as_mask, attention_mask, checked_export, document_ids, target_mask
from treadle.drafts.kind import init_dir
from treadle.drafts.recurrent import UnrollOutput, guesses_by_step
from treadle.drafts.ttt_scores import chunked_unroll_scores
from treadle.drafts.run_model import DraftRunModel
from treadle.drafts.targets import checked_target
from treadle import compat
from treadle.errors import UserError
from treadle.model_dirs import resolve_model_dir

KIND = "frozen_kv"
TARGET_TYPE = "gemma4_text"  # Gemma4ForCausalLM: the target class generate pairs with the assistant
ASSISTANT_TYPE = "gemma4_assistant"
ACCEPTED_TARGET = "accepted: a text-only Gemma 4 (config model_type 'gemma4_text', Gemma4ForCausalLM)"


def refuse_non_gemma4(model_type, where: str) -> None:
    compat.require(compat.gemma4_kv_sharing(), "draft.kind = 'frozen_kv' (Gemma 4's assistant)", "transformers >= 5.23",
                   "a transformers release from 5.23 (pip install 'transformers>=5.23'), or another draft.kind")
    if model_type != TARGET_TYPE:
        raise UserError(f"{where} is a {model_type!r} model; draft.kind = 'frozen_kv' trains Gemma 4's assistant, "
                        f"which reads a Gemma 4 target's K/V; {ACCEPTED_TARGET}")


def store_layers(target_config) -> dict[str, int]:
    """layer type -> the target layer whose K/V the assistant reads (``kv_sharing_modes`` "store": the last
    non-shared layer of each type, what ``return_shared_kv_states`` returns)."""
    return {target_config.layer_types[i]: i for i, mode in enumerate(target_config.kv_sharing_modes) if mode == "store"}


# ----------------------------------------------------------------------------- the module


def centroid_of(masked) -> torch.Tensor:
    """[V]: the centroid of each token id (``token_ordering`` lists centroid c's tokens at c * V / C ..)."""
    ordering = masked.token_ordering.long()
    out = torch.empty_like(ordering)
    out[ordering] = torch.arange(ordering.numel(), device=ordering.device) // masked.vocab_size_per_centroid
    return out


class FrozenKvDraft(nn.Module):
    """The trainable assistant (``assistant``: a ``Gemma4AssistantForCausalLM``; its names are the export's after
    ``assistant.``)."""

    def __init__(self, assistant):
        super().__init__()
        self.assistant = assistant

    def export_config(self) -> dict:
        return {"treadle_draft_kind": KIND}

    def step(self, embeds, hidden, position_ids, shared_kv, masks) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for every row: (the decoder's output [B, T, d] the head reads, ``post_projection`` of it: what
        the next step reads as its hidden input)."""
        a = self.assistant
        dtype = a.pre_projection.weight.dtype
        x = a.pre_projection(torch.cat((embeds, hidden), dim=-1).to(dtype))
        kv = {t: (k.to(dtype), v.to(dtype)) for t, (k, v) in shared_kv.items()}
        # logits_to_keep=None: every row is kept (transformers 5.24 slices the rows of kv-shared layers to an int
        # logits_to_keep, and indexes per-layer inputs the assistant does not have while doing so)
        y = a.model(inputs_embeds=x, attention_mask=masks, position_ids=position_ids, shared_kv_states=kv,
                    use_cache=False, logits_to_keep=None).last_hidden_state
        return y, a.post_projection(y)


class FrozenKvModel(DraftRunModel):
    """What a frozen_kv draft run trains: the frozen Gemma 4 target and its assistant."""

    fsdp_forward_methods = ("chain_guesses", "continue_greedily")
    chunked_unroll = True  # model.loss_chunk_tokens applies: the assistant's head and the target's, chunk by chunk

    def target_reads(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, kv = self._target_forward(input_ids, position_ids)
        return {"hidden": hidden, **{f"{n}.{t}": x.transpose(1, 2) for t, pair in kv.items() for n, x in
                                     zip("kv", pair)}}  # K/V token-major: [B, T, Hkv, D]

    def _target_forward(self, input_ids, position_ids, reads: dict | None = None):
        """(the target's final hidden states [B, T, d], its stored K/V per layer type [B, Hkv, T, D]), no grad;
        from ``reads`` (``target_reads``' names) when given."""
        if reads is not None:
            kv = {t: (reads[f"k.{t}"].transpose(1, 2), reads[f"v.{t}"].transpose(1, 2)) for t in
                  store_layers(self.target.config)}
            return reads["hidden"], kv
        self.check_live()
        mask = target_mask(position_ids, self.target)  # a dict per layer type: the target's window kept
        with torch.no_grad():
            out = self.target.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                    use_cache=False, return_shared_kv_states=True)
        return out.last_hidden_state, dict(out.shared_kv_states)

    def masks(self, doc_position_ids: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Row t (a query at position t + 1) reads the K/V of its document's tokens <= t; a sliding layer the last
        sliding_window + 1 of them, as transformers' assistant masks its sliding layers (checked against it in
        tests/test_frozen_kv.py)."""
        doc = document_ids(doc_position_ids)
        idx = torch.arange(doc.shape[1], device=doc.device).expand_as(doc)
        config = self.draft_model.assistant.config.get_text_config()
        windows = {"full_attention": 0, "sliding_attention": config.sliding_window + 1}
        return {t: as_mask(attention_mask(idx, idx, window=w, q_doc=doc, k_doc=doc), config, dtype)
                for t, w in windows.items()}

    def draft_logits(self, y: torch.Tensor) -> torch.Tensor:
        """The dense logits (what training scores; serving's masked head, if any, keeps their argmax or not)."""
        return self.draft_model.assistant.lm_head(y)

    def _unroll(self, input_ids, position_ids, target_hidden, kv, steps: int, doc_position_ids=None) -> list:
        """The decoder outputs of steps 1..``steps``, each [B, T, d] (module docstring)."""
        B, T = input_ids.shape
        masks = self.masks(position_ids if doc_position_ids is None else doc_position_ids,
                           self.draft_model.assistant.pre_projection.weight.dtype)
        embed = self.target.get_input_embeddings()
        # Step k's row t reads token t + k; rows past the end read a filler token and are never scored.
        padded = torch.cat((input_ids, input_ids[:, -1:].expand(B, steps)), dim=1)
        hidden, out = target_hidden, []
        for k in range(steps):
            y, hidden = self.draft_model.step(embed(padded[:, 1 + k: 1 + k + T]), hidden, position_ids + 1, kv, masks)
            out.append(y)
        return out

    def forward(self, input_ids, position_ids, steps: int = 1, doc_position_ids=None, reads: dict | None = None,
                labels: torch.Tensor | None = None):
        target_hidden, kv = self._target_forward(input_ids, position_ids, reads)
        ys = self._unroll(input_ids, position_ids, target_hidden, kv, steps, doc_position_ids)
        if labels is None or not self.loss_chunk_tokens:
            out = UnrollOutput([self.draft_logits(y) for y in ys], self.teacher_logits(target_hidden), target_hidden)
        else:  # the assistant's head and the target's a chunk of rows at a time (Gemma 4: a 262k vocabulary)
            scores = chunked_unroll_scores(self.draft_logits, ys, target_hidden, self.target.get_output_embeddings(),
                                           labels, None, None, 1, self.loss_chunk_tokens, config=self.target.config)
            scores.positions, scores.labels = position_ids if doc_position_ids is None else doc_position_ids, labels
            out = UnrollOutput(None, None, target_hidden, scores=scores)
        masked = self.draft_model.assistant.masked_embedding
        if masked is not None:  # the centroid head's own loss (module docstring)
            out.aux_logits, out.aux_classes = [masked.centroids(y) for y in ys], centroid_of(masked)
        return out

    @torch.no_grad()
    def chain_guesses(self, texts: torch.Tensor, gamma: int) -> list[torch.Tensor]:
        """As ``MtpModel.chain_guesses``: per chain step k, entry i is the guess for token i + 1 at step k."""
        positions = torch.arange(texts.shape[1], device=texts.device).expand_as(texts)
        hidden, kv = self._target_forward(texts, positions, self.eval_reads(texts))
        ys = self._unroll(texts, positions, hidden, kv, gamma)
        return guesses_by_step([self.draft_logits(y).argmax(-1) for y in ys])


# ----------------------------------------------------------------------------- building and loading


def new_config(target_config, num_layers: int):
    """A new assistant for ``target_config``: its widths, heads and windows, ``num_layers`` layers (sliding ones
    then one full, as Gemma 4's pattern ends), every layer kv-shared, the dense head."""
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig

    types = target_config.layer_types
    sliding = "sliding_attention" if "sliding_attention" in types else "full_attention"
    mine = [sliding] * (num_layers - 1) + ["full_attention"]
    text = target_config.to_dict()
    full = (text.get("per_layer_config") or {}).get(str(store_layers(target_config)["full_attention"]), {})
    for volatile in ("architectures", "_name_or_path", "transformers_version", "dtype"):
        text.pop(volatile, None)
    text.update(num_hidden_layers=num_layers, layer_types=mine, num_kv_shared_layers=num_layers,
                per_layer_config={i: full for i, t in enumerate(mine) if t == "full_attention"},
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False,
                use_double_wide_mlp=False)
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target_config.hidden_size,
                                 use_ordered_embeddings=False)


def check_fits(config, target_config, where: str) -> None:
    """Refuse, in one line, an assistant built for another target."""
    text = config.get_text_config()
    if config.backbone_hidden_size != target_config.hidden_size or text.vocab_size != target_config.vocab_size:
        raise UserError(f"{where} is an assistant for a target of hidden size {config.backbone_hidden_size} and "
                        f"vocabulary {text.vocab_size}; draft.target has {target_config.hidden_size} and "
                        f"{target_config.vocab_size}; accepted: this target's assistant")
    missing = set(text.layer_types) - set(store_layers(target_config))
    if missing:
        raise UserError(f"{where} has {sorted(missing)} layers; draft.target stores no K/V of that type; accepted: "
                        "this target's assistant")


def head_and_layers(target, target_dir: Path | None, indices) -> tuple[torch.Tensor, dict] | None:
    """The target's head weight and the state of its decoder layers ``indices``: from the live module, or from the
    checkpoint's files while the target is still on the meta device (a sharding engine builds it empty and fills it
    after the draft exists); None when neither is there."""
    head = target.get_output_embeddings().weight
    if not head.is_meta:
        return head, {i: target.model.layers[i].state_dict() for i in indices}
    if target_dir is None:
        return None
    from treadle.models.checkpoint_files import read_layer, read_target_tensor

    head = read_target_tensor(Path(target_dir), ("lm_head.weight", "model.embed_tokens.weight"),  # Gemma ties them
                              "draft.target")
    return head, {i: read_layer(Path(target_dir), f"model.layers.{i}.", "draft.target") for i in indices}


def new_assistant(target, num_layers: int, target_dir: Path | None = None):
    """A new assistant (``new_config``): its head from the target's (the logits start as the target's on the
    assistant's output), each layer's query, output, MLP and norms from the target's storing layer of its type
    (at the start a layer is that target layer re-reading the stored K/V), ``pre_projection`` random. A target
    built empty (FSDP2, ZeRO-3) is read from ``target_dir``'s files instead."""
    from transformers import Gemma4AssistantForCausalLM

    assistant = Gemma4AssistantForCausalLM(new_config(target.config, num_layers))
    stores = store_layers(target.config)
    found = head_and_layers(target, target_dir, sorted(set(stores.values())))
    if found is None:
        return assistant
    head, layers = found
    with torch.no_grad():
        assistant.lm_head.weight.copy_(head)  # tied to its embed_tokens, as the shipped assistants
        for layer in assistant.model.layers:
            theirs = layers[stores[layer.self_attn.layer_type]]
            mine = layer.state_dict()
            layer.load_state_dict({k: v for k, v in theirs.items() if k in mine and v.shape == mine[k].shape},
                                  strict=False)
    return assistant


def assistant_from_dir(model_dir, target, where: str):
    """The assistant a directory holds (``Gemma4AssistantForCausalLM.from_pretrained``: a frozen_kv export or a
    shipped ``*-it-assistant``), every weight present, finite, and none left over, checked to fit ``target``."""
    from transformers import Gemma4AssistantForCausalLM

    from treadle.models.finite import check_module

    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("model_type") != ASSISTANT_TYPE:
        raise UserError(f"{where} {model_dir} is not a Gemma 4 assistant (config.json model_type "
                        f"{config.get('model_type')!r}); accepted: a directory Gemma4AssistantForCausalLM loads (a "
                        "frozen_kv export or a shipped *-it-assistant checkpoint)")
    if config.get("treadle_draft_kind") == KIND and "target" in config:
        checked_export(model_dir, target, KIND, "a frozen_kv")
    assistant, info = Gemma4AssistantForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    wrong = info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]
    if wrong:
        raise UserError(f"{where} {model_dir}: weights missing {sorted(info['missing_keys'])[:4]}, unexpected "
                        f"{sorted(info['unexpected_keys'])[:4]}, mismatched {list(info['mismatched_keys'])[:2]}; "
                        "accepted: a complete Gemma 4 assistant checkpoint")
    check_fits(assistant.config, target.config, f"{where} {model_dir}")
    check_module(assistant, model_dir, where)
    return assistant.float()


def load_gemma4_target(cfg_target, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool):
    target_dir = resolve_model_dir(Path(cfg_target), "draft.target")
    try:  # refused from its config before a weight is read
        model_type = json.loads((target_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    refuse_non_gemma4(model_type, f"draft.target {target_dir}")
    target, ident = checked_target(target_dir, data_vocab, data_tokenizer_fingerprint, empty)
    refuse_non_gemma4(target.config.model_type, f"draft.target {target_dir}")
    return target, target_dir, ident


def build_frozen_kv(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(FrozenKvModel, target dir, target identity): the assistant from ``draft.init``, else a new one."""
    from treadle.drafts.frozen_kv.settings import num_layers

    target, target_dir, ident = load_gemma4_target(cfg.target, data_vocab, data_tokenizer_fingerprint, empty)
    if cfg.init is not None:
        assistant, origin = assistant_from_dir(init_dir(cfg.init), target, "draft.init"), f"draft.init {cfg.init}"
    else:
        assistant, origin = new_assistant(target, num_layers(cfg), target_dir), f"new, {num_layers(cfg)} layers"
    model = FrozenKvModel(target, FrozenKvDraft(assistant))
    model.origin = f"assistant: {origin}"
    return model, target_dir, ident


def load_frozen_kv(draft_dir, target) -> FrozenKvModel:
    """A frozen_kv export (or a shipped assistant) attached to ``target``."""
    refuse_non_gemma4(target.config.model_type, "the target")
    return FrozenKvModel(target, FrozenKvDraft(assistant_from_dir(draft_dir, target, "draft"))).eval()
