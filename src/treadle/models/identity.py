"""What a draft export (and a LoRA adapter) records of the model it depends on, and how a mismatch reads: the
architecture fingerprint it checks, and the fields a person reads a target by (a draft names its target by what it
is, never by the directory it sat in). Shared by every draft kind (``glide.model.checked_export``,
``targets.target_identity``) and by models/lora.py (a base's identity): it sits in models/ so both may import it."""

from __future__ import annotations

import hashlib
import json

_VOLATILE = ("use_cache", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "architectures",
             "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation_autoset")
# What a person reads a target by, recorded beside the fingerprints (a draft export names its target by these, not by
# the directory it sat in: that path means nothing on another machine)
SUMMARY = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def _architecture(config: dict) -> dict:
    """A target's HF config as a dict without its run-time flags: the fields a draft depends on."""
    return {k: v for k, v in config.items() if k not in _VOLATILE}


def target_config_fingerprint(config) -> str:
    """What a draft depends on in its target: the architecture fields, not run-time flags."""
    text = json.dumps(_architecture(config.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def target_summary(config) -> dict:
    """``SUMMARY`` of a target's config (a multimodal config's sizes: its text model's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"model_type": config.model_type, **{k: getattr(text, k, None) for k in SUMMARY[1:]}}


def describe_target(identity: dict) -> str:
    """'llama, vocab_size 8192, hidden_size 256, num_hidden_layers 4, config fingerprint 1a2b...' from a recorded
    identity (an export written before the summary was recorded: its fingerprint and the path it had)."""
    named = [str(identity[k]) if k == "model_type" else f"{k} {identity[k]}" for k in SUMMARY if k in identity]
    named.append(f"config fingerprint {identity.get('config_fingerprint')}")
    if "path" in identity and "model_type" not in identity:
        named.append(f"at {identity['path']} when it was trained")
    return ", ".join(named)


def target_differences(recorded: dict, stored_config: dict | None, config) -> str:
    """What differs between the target a draft was trained for and ``config`` (this target's), field by field with
    both values: the whole recorded config where the export has it, else the summary; else the fingerprints."""
    if isinstance(stored_config, dict):
        # this target's through JSON too, as the export's went (id2label's int keys come back as strings)
        want, have = _architecture(stored_config), json.loads(json.dumps(_architecture(config.to_dict()), default=str))
        keys = want.keys() | have.keys()
    else:  # only what was recorded is compared (an older export recorded no summary)
        want, have = {k: recorded[k] for k in SUMMARY if k in recorded}, target_summary(config)
        keys = want.keys()
    names = [k for k in sorted(keys) if want.get(k) != have.get(k)]
    if not names:
        return (f"config fingerprint {recorded.get('config_fingerprint')} there, "
                f"{target_config_fingerprint(config)} here")
    shown = [f"{k} {want.get(k)!r} there, {have.get(k)!r} here" for k in names[:3]]
    return "; ".join(shown) + (f"; and {len(names) - 3} more fields" if len(names) > 3 else "")
