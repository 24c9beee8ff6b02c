"""Which targets each draft kind can read, decided from what the target's config and modules say.

EAGLE-3 reads hidden states: any Hugging Face decoder with a ``model.layers`` stack, a rotary embedding
(``model.rotary_emb``: the draft's Llama-style layer rotates with its parameters over the whole head, Gemma 3's
full-attention set, as the export's config says) and the usual attention dimensions qualifies, dense or MoE (Llama,
Qwen2/3, Qwen3-MoE, Mistral, Mixtral, gpt-oss, DeepSeek-V3, OLMo-2, Gemma 2/3, Phi-3, Granite, GLM-4, SmolLM3 are
tested: tests/test_families.py).

GLIDE reads the target's last-layer K/V cache: that layer must project per-head keys and values (``k_proj`` /
``v_proj`` or a fused ``qkv_proj``, equal key and value head dims, not DeepSeek's MLA latents), rotate its keys with
rotary embeddings over the whole head (no partial rotary, no RoPE-less layer) and keep every position in its cache
(no sliding window shorter than the context). Anything else is refused in one line that names the reason and EAGLE-3
as the alternative. What each family gets (tests/test_families.py, tests/test_glide_targets.py):

- Llama, Qwen2/3, Qwen3-MoE, Mistral, Mixtral: K/V as the projections and rotary compute them (Qwen3's per-head k_norm
  read at its output).
- OLMo-2: K read at the output of its k_norm over all heads (before the split into heads).
- Phi-3: K/V cut from the fused ``qkv_proj`` output as its attention cuts it.
- gpt-oss: half-wide cos/sin (one angle per pair i, i + D/2: rotate-half with the angles repeated); its eager attention
  (sinks) gets an additive mask, its sliding layers their window.
- Gemma 2: the draft's MLP takes ``hidden_activation`` (GELU tanh), the embedding module scales by sqrt(d), the draft's
  logits through the shared head are soft-capped as the target's (plain and chunked); a sliding last layer (an odd
  layer count) is refused. Granite: its ``logits_scaling`` likewise (its embedding multiplier sits in its forward,
  outside the shared embedding; the draft's norms are blind to a constant scale).
- Refused: DeepSeek-V3 (MLA), Gemma 3 (a sliding last layer in most sizes of its 5-of-6 pattern; a config that ends
  on a full one keeps a rotary per layer type, which the draft does not pick), GLM-4 (partial, interleaved rotary: the
  draft's cross-attention queries would need that rotation too), SmolLM3 (a RoPE-less last layer in its 4-layer
  pattern: the draft's queries would have to stay unrotated), and any target whose forward transforms its logits in
  a way ``chunked_ce`` does not apply.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from treadle.errors import UserError
from treadle.models.identity import target_config_fingerprint, target_summary
from treadle.model_dirs import model_fingerprint, resolve_model_dir
from treadle.models.hf import decoder_layers, load_causal_lm
from treadle.tokenizer import tokenizer_fingerprint

KINDS = ("glide", "eagle3")


def _last_layer_type(config) -> str | None:
    types = getattr(config, "layer_types", None)
    return types[-1] if types else None


def glide_obstacle(config) -> str | None:
    """Why a GLIDE draft cannot read this target's last-layer K/V cache (None: it can), from the config alone."""
    if getattr(config, "kv_lora_rank", None) or getattr(config, "v_head_dim", None) and (
            getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0) != config.v_head_dim):
        return "its attention is multi-head latent attention (MLA): the cache holds a compressed latent and keys and " \
               "values of different head dims, no per-head K/V a draft can cross-attend to"
    layer_type = _last_layer_type(config)
    window = getattr(config, "sliding_window", None)
    if layer_type is not None:
        if layer_type != "full_attention":
            return f"its last layer is a {layer_type!r} layer (window {window}): its cache does not keep every position"
    elif window and window < config.max_position_embeddings and getattr(config, "use_sliding_window", True):
        return f"its layers attend through a {window}-token sliding window: the cache does not keep every position"
    rope = getattr(config, "rope_parameters", None) or {}
    partial = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0
    if float(partial) != 1.0:
        return (f"its keys are rotated over a part of each head (partial_rotary_factor = {partial}): GLIDE's "
                "queries rotate the whole head")
    from treadle.models.chunked_ce import unhandled_logit_transforms

    unhandled = unhandled_logit_transforms(config)  # GLIDE's draft scores through the shared head as the target does
    if unhandled:
        return (f"its forward transforms its logits ({', '.join(unhandled)}) in a way treadle does not apply to the "
                "draft's logits through the shared head")
    no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 0 marks a layer without RoPE
    if no_rope and not no_rope[config.num_hidden_layers - 1]:
        return "its last layer uses no rotary embedding (no_rope_layers): GLIDE's cross-attention rotates its queries"
    return None


def glide_module_obstacle(target) -> str | None:
    """What the last layer's modules show that the config does not (projections GLIDE's capture hooks need)."""
    from treadle.models.hf import decoder_layers

    attn = getattr(decoder_layers(target)[-1], "self_attn", None)
    if attn is None or not (all(hasattr(attn, n) for n in ("k_proj", "v_proj")) or hasattr(attn, "qkv_proj")):
        return "its last layer has no k_proj / v_proj (nor a fused qkv_proj, as Phi-3's) to read per-head K/V from"
    head_dim = getattr(attn, "head_dim", None)
    import inspect

    if "layer_type" in inspect.signature(target.model.rotary_emb.forward).parameters:  # Gemma 3, a full last layer
        return ("its rotary embedding keeps one rotation per layer type (layer_type), where GLIDE's draft takes the "
                "one rotation the target's rotary hands")
    import torch

    # GLIDE rotates in the rotate-half convention, with cos/sin as wide as a head, or half as wide: gpt-oss's one angle
    # per pair (i, i + D/2) is the same rotation (glide.rotate widens them; a partial rotary is refused from the
    # config). Only the shape is read, so the call runs where the rotary's buffer lives: on the meta device for a
    # target built empty (sharded loading).
    device = next(target.model.rotary_emb.buffers(), torch.zeros(0)).device
    with torch.no_grad():
        cos, _ = target.model.rotary_emb(torch.zeros(1, 1, 1, device=device),
                                         torch.zeros(1, 1, dtype=torch.long, device=device))
    if cos.is_complex() or cos.shape[-1] not in (head_dim, head_dim // 2):
        return (f"its rotary embedding hands {cos.shape[-1]}-wide {cos.dtype} cos/sin for {head_dim}-wide heads "
                "(another rotation convention than the rotate-half one GLIDE's K/V capture applies)")
    return None


def eagle3_obstacle(target) -> str | None:
    """Why EAGLE-3 cannot read this target (None: it can)."""
    inner = getattr(target, "model", None)
    if inner is None or getattr(inner, "rotary_emb", None) is None:
        return "it has no model.rotary_emb (a rotary-embedding decoder's) for the draft layer's positions"
    from torch import nn

    if not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return "it has no model.layers stack of decoder layers to read hidden states from"
    for field in ("hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps"):
        if getattr(target.config, field, None) is None:
            return f"its config has no {field}"
    return None


def refuse_for(kind: str, target_path, key: str, target=None) -> None:
    """Refuse, in one line, a ``kind`` draft for the target at ``target_path``: from its config.json alone (before
    its weights load), or, given the loaded ``target``, also from its modules."""
    from pathlib import Path

    from treadle.model_dirs import resolve_model_dir

    if kind != "glide":
        return
    path = resolve_model_dir(Path(target_path), key)
    if target is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, KeyError):
            return  # load_causal_lm refuses it in its own line
        if not (getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)):
            return  # no rotary decoder: no draft kind reads it (check_target says so once it is loaded)
        why, model_type = glide_obstacle(config), config.model_type
    else:
        why, model_type = glide_module_obstacle(target), target.config.model_type
    if why is not None:
        raise UserError(f"{key} {path} is a {model_type!r} model GLIDE cannot draft for: {why}; "
                        "use draft.kind = 'eagle3' (it reads the target's hidden states) instead")


def check_target(target, key: str, path) -> None:
    """Refuse, in one line, a target that no draft kind can read (what each kind adds: ``refuse_for``)."""
    model_type = target.config.model_type
    why = eagle3_obstacle(target)
    if why is not None:
        raise UserError(f"{key} {path} is a {model_type!r} model that no draft kind can read: {why}; accepted: "
                        "decoders with rotary embeddings and a model.layers stack (Llama, Qwen, Mixtral, Gemma ...)")


# ----------------------------------------------------------------------------- a draft run's target


def load_target(path: Path, key: str = "draft.target", empty: bool = False):
    """The target in fp32 and eval mode (``empty``: see ``load_causal_lm``); ``GlideModel`` freezes it."""
    target = load_causal_lm(path, key, empty)
    check_target(target, key, path)  # what every draft kind needs; each kind's own: drafts.build_draft
    target.config.use_cache = False  # training packs documents: no cache (PLATFORM.md)
    return target


def target_identity(target_dir: Path, target) -> dict:
    """What a draft records about its target, and what a resume must find unchanged: what the target is (its
    summary, the fingerprints of its architecture, tokenizer and files), never where it sat (a draft export is read
    on other machines; spec-eval checks the target it is given against this)."""
    tok = target_dir / "tokenizer.json"
    return {
        **target_summary(target.config),
        "config_fingerprint": target_config_fingerprint(target.config),
        "tokenizer_fingerprint": tokenizer_fingerprint(target_dir) if tok.is_file() else None,
        "content_fingerprint": model_fingerprint(target_dir),
    }


def checked_target(target_dir: Path, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(target, identity) of a draft run's ``draft.target``, checked against the data's vocabulary and tokenizer."""
    target = load_target(target_dir, empty=empty)
    ident = target_identity(target_dir, target)
    if target.config.vocab_size < data_vocab:
        raise UserError(f"draft.target {target_dir} has vocab_size {target.config.vocab_size}, smaller than the "
                        f"data's {data_vocab}; accepted: data tokenized with the target's tokenizer")
    theirs = ident["tokenizer_fingerprint"]
    if theirs and data_tokenizer_fingerprint and theirs != data_tokenizer_fingerprint:
        raise UserError(f"data.train was tokenized with tokenizer {data_tokenizer_fingerprint}, draft.target "
                        f"{target_dir} uses {theirs}; accepted: shards made with the target's tokenizer")
    return target, ident


# The target a kind's build attaches its draft to when the draft trains beside it (``beside``): the run's own model,
# already built, instead of ``draft.target`` loaded from disk. Set only for the duration of one build.
_BESIDE: list = []


def head_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the (frozen) target's output head, ``[..., d]``: a copy, so a kind scores a few candidates
    without the whole-vocabulary product. Under ZeRO-3 the head is partitioned outside its own forward: it is
    gathered for the read (every rank reads, as every rank runs the draft), the copy outliving the gather."""
    weight = target.get_output_embeddings().weight
    if not hasattr(weight, "ds_id"):  # DeepSpeed's mark of a ZeRO-3 parameter
        return torch.nn.functional.embedding(ids, weight)
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if weight.ds_status == ZeroParamStatus.AVAILABLE:  # whole already (a module using it is running, or persistent):
        return torch.nn.functional.embedding(ids, weight)  # a gather's exit would free it under that module
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
        return torch.nn.functional.embedding(ids, weight)


@contextlib.contextmanager
def beside(target) -> Iterator[None]:
    """Kinds built inside the block take ``target`` (a model being trained) as their target: ``draft_target`` hands it
    out in place of loading ``draft.target``. Its parameters' ``requires_grad`` and its train mode, which a draft run
    model sets for a frozen target, are restored on the way out: it keeps training."""
    flags, mode = [p.requires_grad for p in target.parameters()], target.training
    _BESIDE.append(target)
    try:
        yield
    finally:
        _BESIDE.pop()
        for p, flag in zip(target.parameters(), flags):
            p.requires_grad_(flag)
        target.train(mode)


def building_beside() -> bool:
    """Whether a kind's build runs inside ``beside`` (its target is the run's own model, not a directory)."""
    return bool(_BESIDE)


def draft_target(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(target dir, target, identity) a kind's build starts from: ``draft.target`` loaded and checked
    (``checked_target``), or, inside ``beside``, the run's own model (no directory yet: its export names it at the
    end; the identity is its config's)."""
    if _BESIDE:
        target = _BESIDE[-1]
        check_target(target, "draft.target = 'self': the model", "model.path")
        return None, target, {**target_summary(target.config), "config_fingerprint":
                              target_config_fingerprint(target.config)}
    target_dir = resolve_model_dir(Path(cfg.target), "draft.target")
    return (target_dir, *checked_target(target_dir, data_vocab, data_tokenizer_fingerprint, empty))


@contextlib.contextmanager
def capture_features(target, layers: tuple[int, ...]) -> Iterator["FeatureTap"]:
    """Record, during every target forward inside the block, the outputs of decoder ``layers`` (see ``FeatureTap``)."""
    tap = FeatureTap(target, layers)
    try:
        yield tap
    finally:
        tap.close()


class FeatureTap:
    """Forward hooks where the chosen ``output_hidden_states`` entries are made (the embedding for 0, decoder layer
    i - 1 for i); ``take()`` is the latest forward's features, [B, T, len * d], without asking the model for all."""

    def __init__(self, target, layers: tuple[int, ...]):
        stack = [target.get_input_embeddings(), *decoder_layers(target)]
        self._got: dict[int, torch.Tensor] = {}

        def hook(index):
            def record(_module, _inputs, out):
                self._got[index] = out[0] if isinstance(out, tuple) else out
            return record

        self.layers = tuple(layers)
        self._handles = [stack[i].register_forward_hook(hook(i)) for i in sorted(set(layers))]

    def take(self) -> torch.Tensor:
        return torch.cat([self._got[i] for i in self.layers], dim=-1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
