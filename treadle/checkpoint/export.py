"""Export weights as a Hugging Face model directory (safetensors, config, tokenizer)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from treadle.errors import UserError
from treadle.fsutil import replace_dir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_hf(model: PreTrainedModel, state_dict: dict, tokenizer_dir: Path | None, out: Path,
              dtype: str = "fp32", enabled: bool = True) -> Path:
    """Write ``out`` atomically: a reader sees the old directory or the new one, never half of one."""
    out = Path(out)
    if not enabled:
        return out
    if dtype not in DTYPES:
        raise UserError(f"export dtype {dtype!r} is unknown; accepted: {', '.join(DTYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    state_dict = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in state_dict.items()}
    hf_logging.disable_progress_bar()  # one shard of a small model: a bar is noise in the run's output
    try:
        # Training disables the KV cache for packed sequences; an exported model is for inference.
        saved = model.config.use_cache, model.config.dtype
        model.config.use_cache, model.config.dtype = True, DTYPES[dtype]
        try:
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        finally:
            model.config.use_cache, model.config.dtype = saved
        if tokenizer_dir is not None:
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_checkpoint(source: Path, out: Path, dtype: str = "fp32") -> Path:
    """``treadle export``: rebuild the model a checkpoint was trained as, load its weights, export."""
    import json

    from treadle.checkpoint.manager import find_checkpoint
    from treadle.checkpoint.safety import safe_dcp_load
    from treadle.config import load_config
    from treadle.models.hf import build_model

    ckpt = find_checkpoint(source, str(source))  # read-only: a live run's temporaries are not ours to touch
    cfg = load_config(ckpt / "config.toml")
    meta = json.loads((ckpt / "train_state.json").read_text())["meta"]
    model = build_model(cfg.model, meta["vocab_size"], bos_id=meta["eos_id"], eos_id=meta["eos_id"])
    state = {"model": model.state_dict()}
    safe_dcp_load(state, ckpt / "state", ckpt)  # only the model's entries: optimizer state stays on disk
    model.load_state_dict(state["model"])
    tokenizer = Path(meta["tokenizer_dir"]) if meta.get("tokenizer_dir") else None
    return export_hf(model, model.state_dict(), tokenizer if tokenizer and tokenizer.is_dir() else None, out, dtype=dtype)
