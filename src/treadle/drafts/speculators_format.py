"""The speculators format (vllm-project/speculators, vLLM's draft library): what ``treadle export --to speculators``
writes and ``draft.init`` reads, for the kinds that carry a ``speculators`` table (``DraftKind.speculators``:
drafts/eagle3/speculators.py; the DFlash family's ``BlockTable`` below, one per kind in drafts/<kind>/speculators.py).

Read for this: the speculators 0.9.0 wheel (PyPI, built 2026-10-15): ``speculators/config.py``
(``SpeculatorModelConfig``: ``speculators_model_type`` picks the model class, ``speculators_version``,
``speculators_config`` = algorithm, proposal methods, default proposal method, verifier) and ``speculators/model.py``
(``SpeculatorModel.from_pretrained``: config.json + model.safetensors, the verifier's embedding and head filled in
later when missing). A kind's table maps its consumer layout to this one; this module holds what every kind shares.
"""

from __future__ import annotations

from treadle.errors import UserError

VERSION = "0.9.0"  # the speculators release read; written as speculators_version


def speculators_config(algorithm: str, speculative_tokens: int, target_config, training: dict) -> dict:
    """``speculators_config``: one greedy proposal of ``speculative_tokens`` drafts; the verifier as the run named
    it (``draft.target``, a hub id or a path) with its architectures: speculators' ``from_pretrained`` loads the
    verifier's embedding from there, and vLLM serves the draft against it unless told another target."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": training.get("target"),
                         "architectures": list(target_config.architectures or [])}}


def check_names(tensors: dict, expected: set, what: str) -> None:
    """Refuse an export whose tensor names are not exactly the ones speculators' model declares (``expected``):
    from_pretrained would leave a missing one at its initial value, or drop an unknown one, without a word."""
    unknown, missing = sorted(tensors.keys() - expected), sorted(expected - tensors.keys())
    if unknown or missing:
        raise UserError(f"{what} export to speculators: the draft's weights do not match speculators' names "
                        f"(no name for {unknown}, missing {missing}); nothing was written")


def export(table, draft, weights: dict, target, torch_dtype, meta: dict) -> tuple[dict, dict]:
    """(tensors, config.json) of ``draft`` (drafting for ``target``, the model) in the speculators format, through its
    kind's ``table`` (drafts/registry.py ``speculators_table``); treadle's metadata rides along as extra keys, which
    speculators' config keeps and ignores."""
    return table.export(draft, weights, target, torch_dtype, {**draft.export_config(), **meta})


def embedding(target, dtype) -> dict:
    """The target's input embedding as ``embed_tokens.weight``: speculators' models hold it, and its
    ``from_pretrained`` leaves it uninitialized (not NaN, so not filled from the verifier) when the file lacks it."""
    return {"embed_tokens.weight": target.get_input_embeddings().weight.detach().to("cpu", dtype).contiguous()}


def is_format(config: dict) -> bool:
    """A config.json of a draft in the speculators format (any of its kinds)."""
    return isinstance(config.get("speculators_model_type"), str) and "speculators_config" in config


def with_metadata(config: dict, extra: dict, what: str) -> dict:
    """``config`` with treadle's metadata keys (``extra``) added, refused if one would overwrite the format's."""
    clash = sorted(config.keys() & extra.keys())
    if clash:
        raise UserError(f"{what} export to speculators: treadle's metadata keys {clash} would overwrite the format's")
    return {**config, **extra}


# ----------------------------------------------------------------------------- the DFlash family's table
# speculators 0.9.0 ``models/dflash/config.py`` (DFlashSpeculatorConfig; DFlash2SpeculatorConfig and
# DSparkSpeculatorConfig extend it): the draft layers' Qwen3 config in ``transformer_layer_config`` (its ``vocab_size``
# the verifier's), ``draft_vocab_size``, ``block_size``, ``aux_hidden_state_layer_ids`` (output_hidden_states
# indices: z-lab's decoder-layer id + 1, as its own ``convert/dflash/converter.py`` converts them, i.e. treadle's
# ``feature_layers``), ``mask_token_id``, ``sliding_window_non_causal``, ``sample_from_anchor`` (False: slot 0 is the
# anchor and slot k guesses anchor + k; True: slot k guesses anchor + k + 1) and ``target_hidden_size``. Its
# ``models/dflash/core.py`` (DFlashDraftModel) holds ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm`` under z-lab's
# names, drops ``embed_tokens`` (and, for the full vocabulary, ``lm_head``) on save and fills both from the verifier
# in ``from_pretrained``: the tensors are the kind's engine layout's, unchanged.

# The keys of a DFlash-family engine config (drafts/dflash/layout.py) that are not the draft layers' own (speculators'
# converter's ``_NON_TRANSFORMER_KEYS``) plus the dtype, which SpeculatorModelConfig states at the top.
LAYOUT_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")
TOP_KEYS = ("dtype", "torch_dtype")
SPECULATORS_KEYS = ("speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
                    "draft_vocab_size", "block_size", "aux_hidden_state_layer_ids", "mask_token_id",
                    "sliding_window_non_causal", "sample_from_anchor", "target_hidden_size", "architectures")


def full_layer_config(layer: dict) -> dict:
    """``transformer_layer_config`` with the keys speculators leaves out filled in: it saves the config's difference
    from its class's defaults (``to_diff_dict``), so a missing key is that default (a 28-layer Qwen3 draft states no
    ``num_hidden_layers``); built as speculators builds it, the class of its ``model_type`` (Qwen3Config without one)."""
    from transformers import AutoConfig

    try:
        kwargs = {k: v for k, v in layer.items() if k != "model_type"}
        return AutoConfig.for_model(layer.get("model_type", "qwen3"), **kwargs).to_dict()
    except (ValueError, TypeError):
        return dict(layer)  # a model_type transformers does not know: the layout's checks name what is missing


def logit_transform_refusal(draft, target_config) -> str | None:
    """Why a block draft for ``target_config`` has no speculators form: speculators' DFlash family scores the
    verifier's head as it is, and treadle's drafts apply the target's logit transform (soft-cap, scale) to it."""
    from treadle.models.chunked_ce import _logit_transform

    transform = sorted(k for k in _logit_transform(target_config) if k != "neutral")
    if transform:
        return (f"the target transforms its logits ({', '.join(transform)}), which the draft's scores apply and "
                "speculators' DFlash-family models have no key for")
    return None


class BlockTable:
    """The speculators table of a kind on DFlash's backbone (``DraftKind.speculators``): its engine layout (the kind's
    layout module: ``export``, ``ARCHITECTURE``) regrouped into the speculators config, and back.

    ``own``: the kind's keys speculators holds at the top level (DFlash2's convolution and selector shape, DSpark's
    heads), read from the engine config's top level or its ``dflash_config``; ``dropped``: the engine config's other
    keys that are the layout's, not the layer's; ``sample_from_anchor`` and ``non_causal``: what speculators' class
    defaults to for the kind (treadle trains no sliding-window draft layers, so ``non_causal`` changes nothing)."""

    def __init__(self, model_type: str, architecture: str, layout, sample_from_anchor: bool, non_causal: bool = False,
                 own: tuple = (), dropped: tuple = (), refuse=None):
        self.model_type, self.architecture, self.layout = model_type, architecture, layout
        self.sample_from_anchor, self.non_causal = sample_from_anchor, non_causal
        self.own, self.dropped = own, dropped
        self.refuse = refuse  # (draft, target_config) -> a reason the draft has no speculators form, or None

    def export(self, draft, weights: dict, target, dtype, extra: dict) -> tuple[dict, dict]:
        reason = self.refuse and self.refuse(draft, target.config)
        if reason:
            raise UserError(f"{self.model_type} export to speculators: {reason}; nothing was written (accepted: "
                            "--to draft, the engines' own layout)")
        tensors, engine = self.layout.export(draft, weights, target.config, dtype, {})
        layer = {k: v for k, v in engine.items() if k not in LAYOUT_KEYS + TOP_KEYS + self.own + self.dropped}
        nested = engine.get("dflash_config") or {}
        block = draft.block_size
        training = extra.get("training") or {}
        drafts = block if self.sample_from_anchor else block - 1  # what one proposal holds (speculators' rule)
        config = {
            "architectures": [self.architecture],
            "speculators_model_type": self.model_type,
            "speculators_version": VERSION,
            "transformer_layer_config": layer,
            "draft_vocab_size": layer["vocab_size"],  # the target's: treadle's block drafts share its head
            "block_size": block,
            "aux_hidden_state_layer_ids": [int(i) for i in draft.feature_layers],
            "mask_token_id": draft.mask_token_id,
            "sliding_window_non_causal": self.non_causal,
            "sample_from_anchor": self.sample_from_anchor,
            "target_hidden_size": target.config.hidden_size,
            **{k: engine[k] for k in TOP_KEYS},
            **{k: engine.get(k, nested.get(k)) for k in self.own},
            "speculators_config": speculators_config(self.model_type, drafts, target.config, training),
        }
        return tensors, with_metadata(config, extra, self.model_type)

    def is_layout(self, config: dict) -> bool:
        return is_format(config) and config["speculators_model_type"] == self.model_type

    def as_layout(self, config: dict, where) -> dict:
        """The engine-layout config.json (the kind's layout module reads it) a speculators-format one states; its
        tensors read as they are. A variant treadle's draft does not compute is refused in one line."""
        layer = full_layer_config(config.get("transformer_layer_config") or {})
        anchor = config.get("sample_from_anchor", self.sample_from_anchor)
        if anchor != self.sample_from_anchor:
            raise UserError(f"draft {where}: config.json sample_from_anchor = {anchor!r}; accepted: "
                            f"{self.sample_from_anchor} (treadle's {self.model_type}: slot k guesses anchor + "
                            f"{'k + 1' if self.sample_from_anchor else 'k'})")
        vocab, draft_vocab = layer.get("vocab_size"), config.get("draft_vocab_size", 32000)  # speculators' default
        if draft_vocab != vocab:
            raise UserError(f"draft {where}: config.json draft_vocab_size = {draft_vocab} but "
                            f"transformer_layer_config.vocab_size = {vocab}; accepted: a draft over the verifier's "
                            "whole vocabulary (treadle's block drafts share the target's head)")
        ids = config.get("aux_hidden_state_layer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise UserError(f"draft {where}: config.json aux_hidden_state_layer_ids = {ids!r}; accepted: the "
                            "non-empty list of output_hidden_states indices the draft reads")
        own = {k: config[k] for k in self.own if k in config}
        rest = {k: v for k, v in config.items() if k not in SPECULATORS_KEYS + self.own}
        nested = {"mask_token_id": config.get("mask_token_id"), "target_layer_ids": [i - 1 for i in ids],
                  "block_size": config.get("block_size", 8), **own}  # z-lab's ids: one less
        return {**layer, "num_target_layers": None, **rest, **own, "architectures": [self.layout.ARCHITECTURE],
                "block_size": nested["block_size"], "dflash_config": nested}
