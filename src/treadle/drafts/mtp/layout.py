"""The MTP layer on disk: the DeepSeek-V3 / GLM-4-MoE layout, the one place where treadle's names meet the consumers'.

Inside a target checkpoint (what vLLM ``method: "mtp"``, SGLang ``NEXTN`` and transformers ``generate(use_mtp=True)``
load; ../shared/research/frontier-2026-11.md §1.2), module ``N = num_hidden_layers`` is the MTP layer:

    model.layers.{N}.enorm / hnorm / eh_proj           eh_proj(cat[enorm(emb), hnorm(h)])
    model.layers.{N}.<decoder block of the family>      self_attn.*, mlp.* (experts stored one by one), norms
    model.layers.{N}.shared_head.norm                   the norm before the head
    model.layers.{N}.shared_head.head, .embed_tokens    copies of the target's lm_head / embed_tokens: vLLM's
                                                        DeepSeekMTP loads both from here (not from the target)

and ``num_nextn_predict_layers`` counts such modules. treadle's own names are those of transformers' ``MtpLayer``
(``enorm``, ``hnorm``, ``eh_proj``, ``mtp_block.*`` with fused experts, ``post_norm``): converted here only.

Two exports: ``stitch`` writes a copy of the target checkpoint with the layer put back (the target's tensors
byte-identical, its shard files copied untouched unless one held old MTP tensors), ``alone`` the layer by itself
as SGLang's ``export_deepseek_nextn.py`` lays it out (``model.layers.0.*``, no embedding or head, the target's config
with ``num_hidden_layers = 1`` and architecture ``<target>NextN``). Every conversion is checked both ways: a name
left over or missing is refused before anything is written (a converter that saves random weights on a key
mismatch is the most common silent failure: speculators #1131).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from treadle.errors import UserError

SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's, copied into a stitched checkpoint only
TOP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "post_norm.weight": "shared_head.norm.weight"}  # treadle (transformers' MtpLayer) -> checkpoint
BLOCK = "mtp_block."
# Fused expert tensors (transformers' ``mlp.experts.gate_up_proj`` [E, 2I, d] = cat(gate, up) on dim 1, ``down_proj``
# [E, d, I]) are stored one expert at a time in the checkpoints (transformers' "qwen2_moe" conversion).
FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
INDEX = "model.safetensors.index.json"
MTP_SHARD = "model-mtp.safetensors"


# ----------------------------------------------------------------------------- names


def to_checkpoint(weights: dict) -> dict:
    """treadle's weights of one MTP layer -> the checkpoint's names relative to ``model.layers.{N}.``."""
    out = {}
    for name, t in weights.items():
        if name in TOP:
            out[TOP[name]] = t
        elif name.startswith(BLOCK):
            inner = name[len(BLOCK):]
            if inner == FUSED_GATE_UP:
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"mlp.experts.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                    out[f"mlp.experts.{e}.up_proj.weight"] = t[e, half:].contiguous()
            elif inner == FUSED_DOWN:
                for e in range(t.shape[0]):
                    out[f"mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
            elif inner.startswith("mlp.experts.") and t.dim() == 3:
                raise UserError(f"mtp export: fused expert tensor {name} has no per-expert name in the checkpoint "
                                "layout treadle writes; nothing was written")
            else:
                out[inner] = t
        else:
            raise UserError(f"mtp export: the draft's weight {name!r} has no name in the checkpoint layout (accepted: "
                            f"{', '.join(TOP)} and {BLOCK}*); nothing was written")
    return out


_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def from_checkpoint(tensors: dict) -> dict:
    """The checkpoint's tensors of one MTP layer (names relative to ``model.layers.{N}.``, shared copies dropped) ->
    treadle's names, experts fused as transformers' block holds them."""
    back = {v: k for k, v in TOP.items()}
    out, experts = {}, {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if name in back:
            out[back[name]] = t
        elif m:
            experts.setdefault(m.group(2), {})[int(m.group(1))] = t
        else:
            out[BLOCK + name] = t
    if experts:
        n = max(max(d) for d in experts.values()) + 1
        for kind in ("gate_proj", "up_proj", "down_proj"):
            if sorted(experts.get(kind, {})) != list(range(n)):
                raise UserError(f"MTP layer: experts' {kind} tensors are not 0..{n - 1} (found "
                                f"{sorted(experts.get(kind, {}))[:8]})")
        gate = torch.stack([experts["gate_proj"][e] for e in range(n)])
        up = torch.stack([experts["up_proj"][e] for e in range(n)])
        out[BLOCK + FUSED_GATE_UP] = torch.cat((gate, up), dim=1)
        out[BLOCK + FUSED_DOWN] = torch.stack([experts["down_proj"][e] for e in range(n)])
    return out


def check_names(have, want, what: str) -> None:
    """Refuse, in one line, a set of weight names that is not exactly the one the consumer loads."""
    unknown, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    if unknown or missing:
        raise UserError(f"{what}: the weight names do not match the MTP layer's (unknown {unknown[:6]}, missing "
                        f"{missing[:6]}); nothing was written or loaded")


# ----------------------------------------------------------------------------- reading checkpoints


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


def read_layer(model_dir: Path, prefix: str) -> dict:
    """Every tensor of ``model_dir`` whose name starts with ``prefix``, by the name after it (transformers drops them
    when it loads the target: ``_keys_to_ignore_on_load_unexpected``, so they are read here)."""
    from safetensors import safe_open

    out = {}
    for f, names in safetensors_files(model_dir).items():
        mine = [n for n in names if n.startswith(prefix)]
        if mine:
            with safe_open(str(Path(model_dir) / f), framework="pt") as h:
                out.update({n[len(prefix):]: h.get_tensor(n) for n in mine})
    return out


def read_target_tensor(model_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    """The first of ``names`` the checkpoint holds, as stored (bytes unchanged)."""
    from safetensors import safe_open

    for f, held in safetensors_files(model_dir).items():
        for n in names:
            if n in held:
                with safe_open(str(Path(model_dir) / f), framework="pt") as h:
                    return h.get_tensor(n)
    raise UserError(f"{model_dir} holds none of {list(names)}; accepted: the target's own checkpoint")


# ----------------------------------------------------------------------------- writing


def count_keys(config: dict) -> dict:
    """The config keys that say one MTP module is stored (vLLM reads num_nextn_predict_layers; transformers maps its
    num_mtp_layers onto it)."""
    keys = {"num_nextn_predict_layers": 1}
    if "num_mtp_layers" in config:
        keys["num_mtp_layers"] = 1
    return keys


def stitch(target_dir: Path, out: Path, layer: dict, index: int) -> None:
    """A copy of ``target_dir`` in ``out`` (created) with ``layer`` (checkpoint names relative to the layer, shared
    copies included) as ``model.layers.{index}.*`` in a shard of its own, the config's MTP count set. The target's
    other tensors are not rewritten: files without MTP tensors are copied byte for byte; a file that held an older MTP
    layer is written again without it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target_dir, out = Path(target_dir), Path(out)
    prefix = f"model.layers.{index}."
    files = safetensors_files(target_dir)
    if not files:
        raise UserError(f"{target_dir} has no model.safetensors or {INDEX}; accepted: a safetensors checkpoint")
    single = not (target_dir / INDEX).is_file()
    out.mkdir(parents=True)
    weight_map, metadata = {}, {}
    if not single:
        metadata = json.loads((target_dir / INDEX).read_text()).get("metadata", {})
    for f, names in files.items():
        dest = "model-main.safetensors" if single else f  # a lone model.safetensors would hide the index
        old = [n for n in names if n.startswith(prefix)]
        if old:  # the target shipped an MTP layer here: keep every other tensor as it is
            with safe_open(str(target_dir / f), framework="pt") as h:
                kept = {n: h.get_tensor(n) for n in names if not n.startswith(prefix)}
                meta = h.metadata() or {"format": "pt"}
            save_file(kept, str(out / dest), metadata=meta)
        else:
            shutil.copyfile(target_dir / f, out / dest)
        weight_map.update({n: dest for n in names if not n.startswith(prefix)})
    save_file({prefix + k: v.contiguous() for k, v in layer.items()}, str(out / MTP_SHARD), metadata={"format": "pt"})
    weight_map.update({prefix + k: MTP_SHARD for k in layer})
    index_json = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
    for p in target_dir.iterdir():  # tokenizer, generation config ...: as they are
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, "config.json"):
            shutil.copyfile(p, out / p.name)
    config = json.loads((target_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **count_keys(config)}, indent=2) + "\n")


def alone_config(target_config: dict, extra: dict) -> dict:
    """SGLang's stand-alone NextN draft config: the target's, one hidden layer, architecture ``<target>NextN``."""
    arch = (target_config.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
    config = {**target_config, "num_hidden_layers": 1, "architectures": [arch + "NextN"],
              **count_keys(target_config)}
    clash = sorted(config.keys() & extra.keys() - {"dtype", "torch_dtype"})  # the export's dtype is the weights'

    if clash:
        raise UserError(f"mtp export: treadle's metadata keys {clash} would overwrite the layout's")
    return {**config, **extra}


def is_alone(config: dict) -> bool:
    """A stand-alone MTP layer (treadle's export or SGLang's NextN export): the layer is ``model.layers.0``."""
    return config.get("treadle_draft_kind") == "mtp" or any(
        a.endswith("NextN") for a in config.get("architectures") or ())


def read_config(draft_dir) -> dict | None:
    """The config.json of a stand-alone MTP export (``treadle_draft_kind`` added to SGLang's), or None."""
    try:
        config = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not is_alone(config):
        return None
    config.setdefault("treadle_draft_kind", "mtp")
    return config


def layer_prefix(model_dir: Path) -> tuple[str, dict]:
    """(the name prefix of the MTP layer, config.json) of a stand-alone export or a checkpoint that carries one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{model_dir} has no readable config.json; accepted: an MTP export or a checkpoint with MTP "
                        "layers") from None
    if is_alone(config):
        return "model.layers.0.", config
    return f"model.layers.{config.get('num_hidden_layers')}.", config
