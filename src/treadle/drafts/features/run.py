"""What a draft run does with a feature store (``draft.features``): a target without decoder layers, the store
checked against the run, and the store's windows as the run's datasets."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from treadle.drafts.features.store import Store, dataset_fingerprint
from treadle.errors import UserError


def fingerprints(cfg, model, target_dir: Path, identity: dict, train_ds, val_ds) -> dict:
    """What a store's reads depend on, as a run sees it: the target (architecture and weights), the tokenizer, the
    data's windows, the draft's reads (kind, EAGLE-3's layers) and the acceptance prompts' settings."""
    from treadle.model_dirs import model_fingerprint

    d = cfg.draft
    return {
        "target": {"config": identity["config_fingerprint"], "weights": model_fingerprint(target_dir)},
        "tokenizer": train_ds.tokenizer_fingerprint,
        "data": {"train": dataset_fingerprint(train_ds), "val": dataset_fingerprint(val_ds)},
        "draft": {"kind": d.kind, **model.reads_signature()},
        "eval": {"prompts": d.eval_prompts, "prompt_len": d.eval_prompt_len, "new_tokens": d.eval_new_tokens},
    }


# The data settings that cut a store's windows, by config key (the tokenizer has a fingerprint of its own). The
# windows themselves are compared by a hash (``dataset_fingerprint``); where it differs, these name the setting.
WINDOW_SETTINGS = ("seq_len", "train", "val", "val_fraction", "sources", "mask_cross_doc", "chat_template",
                   "overlong", "bad_rows")


def data_settings(cfg) -> dict:
    """This run's ``WINDOW_SETTINGS`` as ``{"data.seq_len": 256, ...}`` (JSON values, as a manifest holds them)."""
    data = cfg.data.model_dump(mode="json")
    return {f"data.{k}": data[k] for k in WINDOW_SETTINGS}


def refuse_unstorable(cfg, key: str) -> None:
    """What a store cannot serve, refused in one line before anything is built."""
    d = cfg.draft
    if d.max_position_offset:
        raise UserError(f"{key} with draft.max_position_offset = {d.max_position_offset}: the target's reads depend "
                        "on the positions it ran at, and a store holds them at the data's own; accepted: "
                        "draft.max_position_offset = 0 (or train with the live target)")
    if cfg.data.sources and len(cfg.data.sources) > 1:
        raise UserError(f"{key} with {len(cfg.data.sources)} data.sources: a store holds one training source's "
                        "windows; accepted: one source (data.train)")
    if cfg.distributed.context_parallel > 1:
        raise UserError(f"{key} with distributed.context_parallel = {cfg.distributed.context_parallel}: a store's "
                        "reads are not sliced across ranks yet; accepted: context_parallel = 1")


def without_decoder_layers(model, target_dir: Path) -> None:
    """Drop the target's decoder layers (built on the meta device, never read): what remains is what the draft
    shares, the embedding, final norm, head and rotary, read from the files when the engine materializes it."""
    from treadle.models.hf import decoder_layers, has_weights

    if not has_weights(target_dir):
        raise UserError(f"draft.target {target_dir} holds no weights files: a store's reads came from trained "
                        "weights, which a target built from its config.json alone does not have; accepted: a "
                        "target directory with its safetensors weights")
    layers = decoder_layers(model.target)
    owner = model.target.model
    if getattr(owner, "layers", None) is not layers:
        raise UserError(f"draft.target {target_dir}: its decoder layers are not at model.layers; a store-backed run "
                        "cannot drop them")
    owner.layers = nn.ModuleList()
    model.live = False


def attach_store(cfg, model, target_dir: Path, identity: dict, train_ds, val_ds):
    """(train, val) datasets of the store ``draft.features``, after checking it was written for this run; the
    model then takes its acceptance texts and their reads from the store too. Speculators' data is the run's
    training data already (``speculators_samples``), with no validation set and no acceptance texts."""
    from treadle.drafts.features.speculators import SpeculatorsSamples

    if isinstance(train_ds, SpeculatorsSamples):
        return train_ds, None
    store = Store(cfg.draft.features)
    store.check(fingerprints(cfg, model, target_dir, identity, train_ds, val_ds), data_settings(cfg))
    model.stored = store.stored_eval()
    if model.stored is None:
        raise UserError(f"draft.features {store.path} holds no acceptance texts (eval.safetensors); write it again "
                        "with `treadle features`")
    return store.samples("train", train_ds), store.samples("val", val_ds) if val_ds is not None else None


# ----------------------------------------------------------------------------- speculators' data as a store


def is_speculators_store(cfg) -> bool:
    from treadle.drafts.features.speculators import is_speculators_dir

    return bool(cfg.draft.features) and is_speculators_dir(cfg.draft.features)


def speculators_samples(cfg):
    """The training windows of speculators' offline data (vLLM ``extract_hidden_states``) at ``draft.features``, with
    what a run asks of its training data taken from ``draft.target`` (the files record no tokenizer)."""
    from treadle.drafts.features.speculators import SpeculatorsSamples
    from treadle.model_dirs import resolve_model_dir
    from treadle.tokenizer import tokenizer_fingerprint

    d = cfg.draft
    if d.kind != "eagle3":
        raise UserError(f"draft.features {d.features} is speculators' offline data, which holds what an EAGLE-3 "
                        f"draft reads; accepted: draft.kind = 'eagle3' (not {d.kind!r})")
    if not d.feature_layers:
        raise UserError(f"draft.features {d.features} is speculators' offline data, whose files do not say which "
                        "target layers they hold; accepted: draft.feature_layers set to the layer ids vLLM was given "
                        "(launch_vllm.py's, without the last one it appends)")
    target_dir = resolve_model_dir(Path(d.target), "draft.target")
    norm, config = _final_norm(target_dir)
    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    samples = SpeculatorsSamples(Path(d.features), cfg.data.seq_len, tuple(d.feature_layers), norm,
                                 config.vocab_size, pad_id=pad if isinstance(pad, int) else pad[0])
    # What the run reads of a training dataset besides its samples (data/packed.py's names).
    samples.tokenizer_dir = target_dir if (target_dir / "tokenizer.json").is_file() else None
    samples.tokenizer_fingerprint = tokenizer_fingerprint(target_dir) if samples.tokenizer_dir else None
    samples.meta = {"eos_id": config.eos_token_id if isinstance(config.eos_token_id, int) else None}
    samples.shards, samples.num_tokens = [], len(samples) * cfg.data.seq_len
    samples.where = f"speculators' data {d.features}"
    return samples


def _final_norm(target_dir: Path):
    """(the target's final norm with its weights, its config), the decoder layers never built or read."""
    from safetensors import safe_open

    from treadle.models.hf import load_causal_lm

    target = load_causal_lm(target_dir, "draft.target", empty=True)
    norm = target.model.norm
    if any(p.is_meta for p in norm.parameters()):
        norm = norm.to_empty(device="cpu")
        want = {f"model.norm.{k}": k for k in norm.state_dict()}
        state = {}
        for file in sorted(target_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                state.update({want[k]: f.get_tensor(k) for k in f.keys() if k in want})
        norm.load_state_dict(state)
    return norm, target.config
