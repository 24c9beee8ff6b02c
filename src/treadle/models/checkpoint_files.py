"""Named tensors of a Hugging Face safetensors checkpoint, read without building its model: what a draft kind needs
of its target's files (a layer transformers drops on load, tensors to copy while the target is still on the meta
device) and what stitching a layer back into a copy of the checkpoint needs (which file holds which name). What is
read is checked finite (models/finite.py): a refusal names the file and the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from treadle.errors import UserError
from treadle.models.finite import check_tensors

INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> dict[str, list[str]]:
    """file name -> tensor names of a checkpoint directory (single file or sharded with an index)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        files = sorted(set(json.loads((model_dir / INDEX).read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return {}
    out = {}
    for f in files:
        with safe_open(str(model_dir / f), framework="pt") as h:
            out[f] = list(h.keys())
    return out


def read_layer(model_dir: Path, prefix: str, key: str | None = None) -> dict:
    """Every tensor of ``model_dir`` whose name starts with ``prefix``, by the name after it (transformers drops them
    when it loads the target: ``_keys_to_ignore_on_load_unexpected``, so they are read here). ``key``: the setting
    that named ``model_dir`` (draft.target, draft.init), for a refusal of weights that are not finite."""
    from safetensors import safe_open

    out = {}
    for f, names in safetensors_files(model_dir).items():
        mine = [n for n in names if n.startswith(prefix)]
        if mine:
            with safe_open(str(Path(model_dir) / f), framework="pt") as h:
                tensors = check_tensors({n: h.get_tensor(n) for n in mine}, Path(model_dir) / f, key)
            out.update({n[len(prefix):]: t for n, t in tensors.items()})
    return out


def read_target_tensor(model_dir: Path, names: tuple[str, ...], key: str | None = None) -> torch.Tensor:
    """The first of ``names`` the checkpoint holds, as stored (bytes unchanged); ``key`` as for ``read_layer``."""
    from safetensors import safe_open

    for f, held in safetensors_files(model_dir).items():
        for n in names:
            if n in held:
                with safe_open(str(Path(model_dir) / f), framework="pt") as h:
                    return check_tensors({n: h.get_tensor(n)}, Path(model_dir) / f, key)[n]
    raise UserError(f"{model_dir} holds none of {list(names)}; accepted: the target's own checkpoint")
