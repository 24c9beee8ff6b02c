"""The DSpark draft on disk: the ``Qwen3DSparkModel`` layout DeepSpec saves and vLLM and SGLang load.

Consumers, read for this file (their loaders are what the contract tests in tests/test_dspark.py are written from):
- vLLM ``vllm/model_executor/models/qwen3_dspark.py`` @0302ff40 (``Qwen3DSparkForCausalLM.load_weights``: names
  without a ``model.`` prefix, ``markov_head.markov_w{1,2}.weight``, ``confidence_head.proj.{weight,bias}``;
  ``embed_tokens`` / ``lm_head`` optional, shared from the target when absent; ``d2t`` needed only when
  ``draft_vocab_size`` < the target's vocabulary), the registry entry ``"Qwen3DSparkModel"``, and
  ``v1/worker/gpu/spec_decode/dspark/speculator.py`` @6534e066 (``dspark_bonus_anchor``: False = every slot drafts);
- SGLang ``python/sglang/srt/models/dspark.py`` and ``speculative/dspark_components/dspark_config.py`` @01f47623
  (``dflash_config`` for layer ids and block size, ``markov_rank`` > 0, ``markov_head_type``,
  ``confidence_head_with_markov``, ``mask_token_id``; ``speculators_model_type = "dspark"`` refused);
- DeepSpec ``deepspec/modeling/dspark/qwen3/{config,modeling}.py`` @afdfa7c (``Qwen3DSparkModel.__init__`` asserts
  top-level ``target_layer_ids``, ``mask_token_id``, ``num_anchors``, ``enable_confidence_head``, ``markov_rank``, then
  ``markov_head_type`` (rank > 0) and ``confidence_head_with_markov`` (head on); it reads ``block_size`` too). Its
  class also holds ``embed_tokens`` / ``lm_head`` and its evaluator uses the draft's own: a treadle export loads there
  with those two missing (the target's, copied in by its ``initialize_embeddings_and_head``).

What treadle writes: the DFlash backbone's config and names (dflash/layout.py: a Qwen3 config, ``dflash_config``,
z-lab layer ids = treadle's output_hidden_states index - 1) under ``architectures = ["Qwen3DSparkModel"]``, the
DSpark keys both engines read, and no embedding, head or ``d2t``: the draft's vocabulary is the target's config
``vocab_size`` (``draft_vocab_size`` written equal to it), the case in which vLLM needs no ``d2t`` (vLLM PR #55133:
a draft vocabulary padded past the target's was refused for lacking one).

Traps handled when reading: a speculators-format config nests the model fields in ``transformer_layer_config``
and names the layers ``aux_hidden_state_layer_ids`` (what sglang PR #40630 lifts): lifted here too; a draft in
the other slot convention (``dspark_bonus_anchor`` true or ``sample_from_anchor`` false: slot j guesses anchor
+ j, slot 0 untrained) is refused, as is a reduced vocabulary (a non-identity ``d2t``), a Markov head other
than DeepSpec's vanilla one, or a draft without its confidence head.
"""

from __future__ import annotations

from types import ModuleType

import re

import torch

from treadle.drafts.dflash import layout as dflash_layout
from treadle.drafts.kind import layout_config
from treadle.errors import UserError

ARCHITECTURE = "Qwen3DSparkModel"
# treadle's name -> the layout's, beside the backbone's (dflash_layout.names).
HEAD_NAMES = {
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "confidence.weight": "confidence_head.proj.weight",
    "confidence.bias": "confidence_head.proj.bias",
}
SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, when a draft ships copies (DeepSpec does)
# DeepSpec's num_anchors (blocks sampled per training row) when no run's record says what treadle trained with: its
# released recipes' value (config/dspark/dspark_qwen3_*.py @afdfa7c). Only its training reads it.
DEEPSPEC_ANCHORS = 512


def trained_anchors(extra: dict, block_size: int) -> int:
    """The blocks per row a run trained with (draft.anchors, else its default data.seq_len // block_size, as
    dflash/objective.py resolves it), from the run's record in ``extra``; DeepSpec's recipe value without one."""
    training = extra.get("training") or {}
    anchors = (training.get("draft") or {}).get("anchors")
    seq_len = (training.get("data") or {}).get("seq_len")
    if anchors:
        return int(anchors)
    return max(1, int(seq_len) // block_size) if seq_len else DEEPSPEC_ANCHORS


def names(num_layers: int) -> dict[str, str]:
    """Every treadle name of a ``num_layers`` DSpark draft -> its name in the layout."""
    return {**dflash_layout.names(num_layers), **HEAD_NAMES}


def is_layout(config: dict) -> bool:
    """A DSpark draft's config, or a DeepSeek-V4 checkpoint's that carries DSpark stages (its ``dspark_*`` keys:
    the target itself, or a stages run's stitched copy; dspark/v4.py loads those)."""
    stages = config.get("model_type") == "deepseek_v4" and config.get("dspark_block_size") is not None
    return (ARCHITECTURE in (config.get("architectures") or ()) or config.get("speculators_model_type") == "dspark"
            or stages)


def read_config(draft_dir, speculators: ModuleType | None = None) -> dict | None:
    """config.json of a DSpark draft (``treadle_draft_kind`` added to one written elsewhere), or None."""
    # ``speculators``: the kind's speculators table (its speculators.py, which reads this module: passed in,
    # not imported), so a speculators-format draft is read as this layout too.
    return layout_config(draft_dir, is_layout, "dspark", speculators)


def export(draft, weights: dict, target_config, dtype: torch.dtype, extra: dict) -> tuple[dict, dict]:
    """(tensors, config) of ``draft`` in the layout, from its state dict in treadle's names (export dtype)."""
    table = names(draft.num_layers)
    unknown, missing = sorted(weights.keys() - table.keys()), sorted(table.keys() - weights.keys())
    if unknown or missing:
        raise UserError(f"dspark export: the draft's weights do not match the Qwen3DSparkModel layout (no name for "
                        f"{unknown}, missing {missing}); nothing was written")
    tensors = {table[k]: v.contiguous() for k, v in weights.items()}
    config = dflash_layout.config_of(draft, target_config, dtype, {})
    config.pop("auto_map")  # no remote code: transformers has no DSpark class, the engines read the directory
    ids = config["dflash_config"]["target_layer_ids"]
    config.update({
        "architectures": [ARCHITECTURE],
        "target_layer_ids": ids,  # DeepSpec's place; both engines also read dflash_config's
        "mask_token_id": draft.mask_token_id,
        "num_anchors": trained_anchors(extra, draft.block_size),  # DeepSpec's constructor requires it
        "draft_vocab_size": draft.target_vocab_size,  # = vocab_size: neither reduced (d2t) nor padded
        "markov_rank": draft.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,  # every slot drafts: older vLLM reads this key,
        "dspark_bonus_anchor": False,  # newer vLLM this one
    })
    clash = sorted(config.keys() & extra.keys())
    if clash:
        raise UserError(f"dspark export: treadle's metadata keys {clash} would overwrite the layout's")
    return tensors, {**config, **extra}


def flattened(config: dict) -> dict:
    """A speculators-format config with its nested model fields lifted (sglang PR #40630): the top level wins. Its
    ``aux_hidden_state_layer_ids`` are output_hidden_states indices (speculators' DFlash converter adds 1 to z-lab's
    ids; vllm-project/speculators #753 takes 1 off for SGLang): z-lab's ``target_layer_ids`` are one less."""
    nested = config.get("transformer_layer_config")
    out = {**nested, **config} if isinstance(nested, dict) else dict(config)
    ids = out.get("aux_hidden_state_layer_ids")
    if "target_layer_ids" not in out and isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        out["target_layer_ids"] = [i - 1 for i in ids]
    return out


def block_size(config: dict) -> int:
    """The block of a DSpark config: every slot drafts, so also the most drafts one forward proposes (stages a
    DeepSeek-V4 checkpoint carries: its ``dspark_block_size``)."""
    if config.get("dspark_block_size") is not None:
        return int(config["dspark_block_size"])
    c = flattened(config)
    return int((c.get("dflash_config") or {}).get("block_size", c.get("block_size") or 7))


def read_spec(config: dict, target_config, where) -> dict:
    """What a DSpark config says treadle must build (feature layers, layers, block size, mask token, Markov rank),
    after checking it is a draft treadle can run against this target."""
    c = flattened(config)
    if c.get("dspark_bonus_anchor") is True or c.get("sample_from_anchor") is False:
        raise UserError(f"draft {where}: config.json has dspark_bonus_anchor = true / sample_from_anchor = false (slot "
                        "j guesses anchor + j, slot 0 untrained); accepted: a DSpark draft whose every slot drafts "
                        "(slot k guesses anchor + k + 1, DeepSpec's and treadle's)")
    if c.get("markov_head_type", "vanilla") != "vanilla":
        raise UserError(f"draft {where}: config.json markov_head_type = {c['markov_head_type']!r}; accepted: "
                        "'vanilla' (W2 W1[previous token])")
    rank = c.get("markov_rank")
    if not isinstance(rank, int) or rank < 1:
        raise UserError(f"draft {where}: config.json markov_rank = {rank!r}; accepted: a positive integer")
    if c.get("enable_confidence_head") is False or c.get("confidence_head_with_markov") is False:
        raise UserError(f"draft {where}: config.json has no confidence head reading the Markov embedding "
                        "(enable_confidence_head / confidence_head_with_markov false); accepted: both true")
    vocab = target_config.vocab_size
    for key in ("vocab_size", "draft_vocab_size"):
        if c.get(key) is not None and c[key] != vocab:
            raise UserError(f"draft {where}: config.json {key} = {c[key]} but the target's vocabulary is {vocab}; "
                            "accepted: a DSpark draft over the target's whole vocabulary (no reduced or padded one)")
    ids = c.get("target_layer_ids", (c.get("dflash_config") or {}).get("target_layer_ids"))
    dflash_layout.check_fits({k: v for k, v in c.items() if k != "vocab_size"}, target_config, where)
    block = block_size(config)
    return {"feature_layers": dflash_layout.feature_layers({**c, "dflash_config": {"target_layer_ids": ids}},
                                                           target_config.num_hidden_layers, where),
            "num_layers": c["num_hidden_layers"], "block_size": block,
            "mask_token_id": dflash_layout.mask_token_id({"mask_token_id": c.get("mask_token_id",
                                                          (c.get("dflash_config") or {}).get("mask_token_id"))},
                                                         where),
            "markov_rank": rank}


def import_weights(tensors: dict, draft, where) -> dict:
    """The state dict of ``draft`` from the layout's tensors; a leftover or missing name is refused. A ``model.``
    prefix is dropped, shipped copies of the target's embedding and head too, and an identity ``d2t`` / ``t2d``."""
    tensors = {re.sub(r"^model\.", "", k): v for k, v in tensors.items()}
    for shared in SHARED:
        tensors.pop(shared, None)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if (d2t is not None and bool(d2t.ne(0).any())) or (t2d is not None and not bool(t2d.all())):
        raise UserError(f"draft {where}: model.safetensors maps a reduced draft vocabulary (d2t / t2d not the "
                        "identity); accepted: a DSpark draft over the target's whole vocabulary")
    internal = {v: k for k, v in names(draft.num_layers).items()}
    unknown, missing = sorted(tensors.keys() - internal.keys()), sorted(internal.keys() - tensors.keys())
    if unknown or missing:
        raise UserError(f"draft {where}: model.safetensors does not match the Qwen3DSparkModel layout for "
                        f"{draft.num_layers} layers (unknown {unknown[:6]}, missing {missing[:6]})")
    return {internal[k]: v for k, v in tensors.items()}
