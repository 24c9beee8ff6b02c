"""The MTP layer on disk, one name table per family: the one place where treadle's names meet the consumers'.

treadle's own names are those of transformers' ``MtpLayer`` for every family (``enorm``, ``hnorm``, ``eh_proj``,
``mtp_block.*`` with fused experts, ``post_norm``); a ``Family`` says what each is called in the family's checkpoint,
where the layer sits there, and how its serving engines run it (vllm-project/vllm
``vllm/model_executor/models/deepseek_mtp.py`` @03356f8, ``qwen3_next_mtp.py`` @055e47c, ``gemma4_mtp.py`` @03b6016;
vllm-project/speculators ``src/speculators/convert/mtp/converter.py``).

DeepSeek-V3 / GLM-4-MoE (``DEEPSEEK``; any transformers family with ``num_mtp_layers`` takes this layout): module
``N = num_hidden_layers`` of the target checkpoint is the MTP layer (what vLLM ``method: "mtp"``, SGLang ``NEXTN`` and
transformers ``generate(use_mtp=True)`` load):

    model.layers.{N}.enorm / hnorm / eh_proj           eh_proj(cat[enorm(emb), hnorm(h)])
    model.layers.{N}.<decoder block of the family>      self_attn.*, mlp.* (experts stored one by one), norms
    model.layers.{N}.shared_head.norm                   the norm before the head
    model.layers.{N}.shared_head.head, .embed_tokens    copies of the target's lm_head / embed_tokens: vLLM's
                                                        DeepSeekMTP loads both from here (not from the target)

Qwen3-Next and Qwen3.5 text models (``QWEN3_NEXT``, ``QWEN3_5``; vLLM ``qwen3_next_mtp.py``, speculators' converter):

    mtp.pre_fc_norm_embedding / pre_fc_norm_hidden / fc   fc(cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)])
    mtp.layers.0.<decoder block of the family>            forced to full attention; experts stored one by one
                                                          (``mlp.experts.{E}.gate_proj`` ...), the shared expert and
                                                          the gates as the target stores them
    mtp.norm                                              then the target's own lm_head (no copy is written)

Flat, as the engines read it: ``mtp.layers.0.*``, never ``mtp.model.layers.0.*`` (SGLang maps ``mtp.`` to ``model.``,
and a nested name silently fails to load: trap 4). The count key says one module is stored: ``num_nextn_predict_layers``
(DeepSeek, GLM, Qwen3-Next), ``mtp_num_hidden_layers`` (Qwen3.5).

MiMo (``model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}``, hidden state first in
the concat) is not supported: transformers has no MiMo-7B class to build its block from (only ``mimo_v2_flash``).

Two exports: ``stitch`` writes a copy of the target checkpoint with the layer put back (the target's tensors
byte-identical, its shard files copied untouched unless one held old MTP tensors), ``alone`` the layer by itself:
DeepSeek's as SGLang's ``export_deepseek_nextn.py`` lays it out (``model.layers.0.*``, no embedding or head, the
target's config with ``num_hidden_layers = 1`` and architecture ``<target>NextN``); Qwen's as the ``mtp.*`` tensors
alone beside the target's config (no consumer is known to load that directory itself: speculators and vLLM read the
layer from a full checkpoint, so the stitched copy is the one to serve). Every conversion is checked both ways: a name
left over or missing is refused before anything is written (a converter that saves random weights on a key mismatch
is the most common silent failure: speculators #1131).
"""

from __future__ import annotations

from types import ModuleType

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from treadle.drafts.kind import layout_config
from treadle.errors import UserError
from treadle.models.checkpoint_files import INDEX, read_target_tensor, safetensors_files

BLOCK = "mtp_block."  # treadle's prefix of the decoder block
# Fused expert tensors (transformers' ``mlp.experts.gate_up_proj`` [E, 2I, d] = cat(gate, up) on dim 1, ``down_proj``
# [E, d, I]) are stored one expert at a time in every family's checkpoints (transformers' "qwen2_moe" conversion).
FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
MTP_SHARD = "model-mtp.safetensors"


@dataclass(frozen=True)
class Family:
    """One family's MTP layout and serving behaviour: data, so the module, the unroll and the drafter have no branch."""

    top: dict  # treadle's names outside the block -> the checkpoint's, relative to the layer's prefix
    block: str  # the decoder block's prefix inside the layer ("": flat beside the fusion weights)
    stitched: str  # the layer's prefix in the target checkpoint; {N} = num_hidden_layers
    alone: str  # its prefix in the stand-alone export
    nextn_alone: bool  # the stand-alone config is SGLang's NextN one (one hidden layer, ``<arch>NextN``)
    count_keys: tuple  # config keys counting the stored modules (the export sets each to 1)
    # The target's tensors a stitched layer carries a copy of: name in the layer -> target names, first found wins.
    shared: tuple = ()
    hidden_first: bool = False  # fusion order cat[h, e] (MiMo, Inkling); the config's mtp_hidden_states_first too
    zero_first: bool = True  # the embedding is zeroed at a document's position 0 (trap 1)
    chain_normed: bool = False  # a replayed step reads the previous step's normed output, not the block's
    # The block's attention type in a hybrid family (its decoder layer built from the target's config with this one
    # layer type); None: transformers' ``get_mtp_config`` makes the block's config (``num_mtp_layers`` families).
    layer_type: str | None = None

    def prefix(self, num_hidden_layers: int, alone: bool) -> str:
        return self.alone if alone else self.stitched.format(N=num_hidden_layers)


DEEPSEEK = Family(
    top={"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
         "post_norm.weight": "shared_head.norm.weight"},
    block="", stitched="model.layers.{N}.", alone="model.layers.0.", nextn_alone=True,
    count_keys=("num_nextn_predict_layers",),
    shared=(("embed_tokens.weight", ("model.embed_tokens.weight",)),
            ("shared_head.head.weight", ("lm_head.weight", "model.embed_tokens.weight"))),  # tied: the embedding
    # vLLM's DeepSeek/GLM layers zero the position-0 embedding; its proposer hands the block output (before
    # shared_head.norm, which compute_logits applies) back to the next step.
    zero_first=True, chain_normed=False)

# Qwen3-Next: vLLM's Qwen3NextMultiTokenPredictor.forward ends in ``mtp.norm`` and returns the normed state, which its
# proposer feeds back (compute_logits is the bare lm_head): a replayed step reads the normed output. It has no
# position-0 masking line, unlike vLLM's DeepSeek/GLM/MiMo layers: zero_first off (both read in vLLM's
# qwen3_next_mtp.py @ 055e47c).
QWEN3_NEXT = Family(
    top={"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
         "eh_proj.weight": "fc.weight", "post_norm.weight": "norm.weight"},
    block="layers.0.", stitched="mtp.", alone="mtp.", nextn_alone=False,
    count_keys=("num_nextn_predict_layers",), zero_first=False, chain_normed=True, layer_type="full_attention")
QWEN3_5 = replace(QWEN3_NEXT, count_keys=("mtp_num_hidden_layers",))

FAMILIES = {"qwen3_next": QWEN3_NEXT, "qwen3_5_text": QWEN3_5, "qwen3_5_moe_text": QWEN3_5}


def family_of(model_type: str | None) -> Family:
    """The layout of a target family (by ``model_type``); the DeepSeek one for every other MTP family."""
    return FAMILIES.get(model_type, DEEPSEEK)


def family_of_config(config: dict) -> Family:
    return family_of(config.get("model_type"))


# ----------------------------------------------------------------------------- names


def to_checkpoint(weights: dict, family: Family = DEEPSEEK) -> dict:
    """treadle's weights of one MTP layer -> the checkpoint's names relative to the layer's prefix."""
    out = {}
    for name, t in weights.items():
        if name in family.top:
            out[family.top[name]] = t
        elif name.startswith(BLOCK):
            inner, to = name[len(BLOCK):], family.block
            if inner == FUSED_GATE_UP:
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{to}mlp.experts.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                    out[f"{to}mlp.experts.{e}.up_proj.weight"] = t[e, half:].contiguous()
            elif inner == FUSED_DOWN:
                for e in range(t.shape[0]):
                    out[f"{to}mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
            elif inner.startswith("mlp.experts.") and t.dim() == 3:
                raise UserError(f"mtp export: fused expert tensor {name} has no per-expert name in the checkpoint "
                                "layout treadle writes; nothing was written")
            else:
                out[to + inner] = t
        else:
            raise UserError(f"mtp export: the draft's weight {name!r} has no name in the checkpoint layout (accepted: "
                            f"{', '.join(family.top)} and {BLOCK}*); nothing was written")
    return out


_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def from_checkpoint(tensors: dict, family: Family = DEEPSEEK) -> dict:
    """The checkpoint's tensors of one MTP layer (names relative to the layer's prefix, shared copies dropped) ->
    treadle's names, experts fused as transformers' block holds them. A name outside the layout keeps its own name,
    for ``check_names`` to refuse."""
    back = {v: k for k, v in family.top.items()}
    out, experts = {}, {}
    for name, t in tensors.items():
        inner = name[len(family.block):] if name.startswith(family.block) else None
        m = _EXPERT.match(inner) if inner is not None else None
        if name in back:
            out[back[name]] = t
        elif m:
            experts.setdefault(m.group(2), {})[int(m.group(1))] = t
        else:
            out[BLOCK + inner if inner is not None else name] = t
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


def shared_names(family: Family) -> set:
    return {name for name, _ in family.shared}


def check_names(have, want, what: str) -> None:
    """Refuse, in one line, a set of weight names that is not exactly the one the consumer loads."""
    unknown, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    if unknown or missing:
        raise UserError(f"{what}: the weight names do not match the MTP layer's (unknown {unknown[:6]}, missing "
                        f"{missing[:6]}); nothing was written or loaded")


# ----------------------------------------------------------------------------- writing


def count_keys(config: dict) -> dict:
    """The config keys that say one MTP module is stored (the family's: vLLM reads them; transformers maps its
    num_mtp_layers onto num_nextn_predict_layers, so it is set too where the config has it)."""
    keys = dict.fromkeys(family_of_config(config).count_keys, 1)
    if "num_mtp_layers" in config:
        keys["num_mtp_layers"] = 1
    return keys


def stitched_layer(target_dir: Path, layer: dict, family: Family) -> dict:
    """``layer`` (checkpoint names relative to the layer's prefix) with the copies of the target's tensors its
    family's consumers load from the layer (DeepSeek: embedding and head; Qwen: none), bytes as stored."""
    return {**layer, **{name: read_target_tensor(target_dir, sources) for name, sources in family.shared}}


def stitch(target_dir: Path, out: Path, layer: dict, prefix: str) -> None:
    """A copy of ``target_dir`` in ``out`` (created) with ``layer`` (checkpoint names relative to the layer, shared
    copies included) under ``prefix`` in a shard of its own, the config's MTP count set. The target's other tensors
    are not rewritten: files without MTP tensors are copied byte for byte; a file that held an older MTP layer is
    written again without it. ``out`` = ``target_dir``: the same, in place (a model export being written, which
    carries its own layer): its files stay where they are, a lone model.safetensors renamed beside the index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target_dir, out = Path(target_dir), Path(out)
    files = safetensors_files(target_dir)
    if not files:
        raise UserError(f"{target_dir} has no model.safetensors or {INDEX}; accepted: a safetensors checkpoint")
    single = not (target_dir / INDEX).is_file()
    in_place = out.exists() and out.resolve() == target_dir.resolve()
    if not in_place:
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
            save_file(kept, str(out / f".{dest}.part"), metadata=meta)  # in place: f may be the file read
            (out / f".{dest}.part").replace(out / dest)
            if in_place and dest != f:
                (target_dir / f).unlink()
        elif in_place:
            (target_dir / f).replace(out / dest)
        else:
            shutil.copyfile(target_dir / f, out / dest)
        weight_map.update({n: dest for n in names if not n.startswith(prefix)})
    save_file({prefix + k: v.contiguous() for k, v in layer.items()}, str(out / MTP_SHARD), metadata={"format": "pt"})
    weight_map.update({prefix + k: MTP_SHARD for k in layer})
    index_json = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
    for p in [] if in_place else target_dir.iterdir():  # tokenizer, generation config ...: as they are
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, "config.json"):
            shutil.copyfile(p, out / p.name)
    config = json.loads((target_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **count_keys(config)}, indent=2) + "\n")


def carry(model_dir: Path, weights: dict, family: Family) -> None:
    """A model export (``model_dir``, being written) made to carry its trained MTP layer (``weights``: treadle's
    names) where the family's checkpoints do (DeepSeek: ``model.layers.{N}.*``, the target's embedding and head
    copied beside it; Qwen: ``mtp.*``), in place: what transformers' ``generate(use_mtp=True)``, vLLM and the mtp
    kind's loader read from the model's own checkpoint."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layer = stitched_layer(model_dir, to_checkpoint(weights, family), family)
    stitch(model_dir, model_dir, layer, family.prefix(config["num_hidden_layers"], alone=False))


def alone_config(target_config: dict, extra: dict) -> dict:
    """The stand-alone export's config: SGLang's NextN one for DeepSeek's layout (the target's, one hidden layer,
    architecture ``<target>NextN``), else the target's own with the count key set."""
    config = {**target_config, **count_keys(target_config)}
    if family_of_config(target_config).nextn_alone:
        arch = (target_config.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
        config.update(num_hidden_layers=1, architectures=[arch + "NextN"])
    clash = sorted(config.keys() & extra.keys() - {"dtype", "torch_dtype"})  # the export's dtype is the weights'

    if clash:
        raise UserError(f"mtp export: treadle's metadata keys {clash} would overwrite the layout's")
    return {**config, **extra}


def is_alone(config: dict) -> bool:
    """A stand-alone MTP layer (treadle's export or SGLang's NextN export): the layer is at the family's ``alone``
    prefix."""
    return config.get("treadle_draft_kind") == "mtp" or any(
        a.endswith("NextN") for a in config.get("architectures") or ())


def read_config(draft_dir, speculators: ModuleType | None = None) -> dict | None:
    """The config.json of a stand-alone MTP export (``treadle_draft_kind`` added to SGLang's or speculators'), or
    None."""
    # ``speculators``: mtp/speculators.py (which reads this module: passed in, not imported)
    return layout_config(draft_dir, lambda c: is_alone(c) or bool(speculators and speculators.is_layout(c)), "mtp")


def layer_prefix(model_dir: Path) -> tuple[str, dict]:
    """(the name prefix of the MTP layer, config.json) of a stand-alone export or a checkpoint that carries one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{model_dir} has no readable config.json; accepted: an MTP export or a checkpoint with MTP "
                        "layers") from None
    return family_of_config(config).prefix(config.get("num_hidden_layers"), is_alone(config)), config
