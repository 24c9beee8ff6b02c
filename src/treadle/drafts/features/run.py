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
    model then takes its acceptance texts and their reads from the store too."""
    store = Store(cfg.draft.features)
    store.check(fingerprints(cfg, model, target_dir, identity, train_ds, val_ds))
    model.stored = store.stored_eval()
    if model.stored is None:
        raise UserError(f"draft.features {store.path} holds no acceptance texts (eval.safetensors); write it again "
                        "with `treadle features`")
    return store.samples("train", train_ds), store.samples("val", val_ds) if val_ds is not None else None
