"""DSpark stages a target checkpoint ships: found, checked against what their consumers load, and stitched back.

DeepSeek-V4 / V4.1 (``model_type = "deepseek_v4"``; transformers 5.24 drops them on load:
``DeepseekV4PreTrainedModel._keys_to_ignore_on_load_unexpected = [r"(^|\\.)mtp\\..*"]``) carry a DSpark draft of
``S`` stages under ``mtp.{s}.*`` (``model.mtp.{s}.*`` read too), contiguous from 0. What a stage holds, as the
consumers' loaders require it (lightseekorg/tokenspeed ``python/tokenspeed/runtime/models/deepseek_v4_dspark.py``
@07ad1c91672fa4134594f005fae2f38bc09a0054, ``_STAGE_ZERO_CORE`` / ``_STAGE_COMMON_CORE`` / ``_LAST_STAGE_CORE`` /
``_ATTENTION_TENSORS`` and ``load_weights``; ``deepseek_v41_dspark.py`` @326a64f8572aa52544bf45c1a44d488338c26b44 for
V4.1's head names and the optional ``model.`` prefix; a vLLM-derived ``DeepSeekV4DSparkLayer`` seen in a public fork,
path not pinned, reads the same stage names):

    every stage   one DeepSeek-V4 decoder layer in the checkpoint's own names: attn.{wq_a, q_norm, wq_b, wkv, kv_norm,
                  wo_a, wo_b, attn_sink}, attn_norm, ffn_norm, hc_attn_{fn,base,scale}, hc_ffn_{fn,base,scale},
                  ffn.gate.{weight,bias}, ffn.shared_experts.w{1,2,3}, ffn.experts.{e}.w{1,2,3} (e < the stage
                  expert count: ``dspark_n_routed_experts``, V4.1, else ``n_routed_experts``); an FP8 / FP4 weight
                  has its ``.scale`` beside it
    stage 0       main_proj [d, len(dspark_target_layer_ids) * d], main_norm [d]: the captured target states' fusion
    stage S - 1   norm [d], hc_head_{fn [hc, hc * d], base [hc], scale [1]}, the Markov head (V4:
                  markov_head.markov_w1 / markov_w2, V4.1: markov_head.embed / head; each [V, r]) and
                  confidence_head.proj [1, d + r] (no bias)

and the config keys ``dspark_block_size``, ``dspark_target_layer_ids``, ``dspark_noise_token_id``,
``dspark_markov_rank`` (``dspark_num_stages``, when given, equals S: V4.1 also requires it to equal
``num_nextn_predict_layers``). Served as vLLM ``--speculative-config '{"method": "dspark", ...}'`` from the target
checkpoint itself (``"mtp"`` raises on these checkpoints: they carry no ``enorm`` / ``hnorm`` / ``eh_proj``).

Mistral Large 4 (``mistral_large4``): transformers 5.24 ignores ``mtp_dspark.*`` on load
(``MistralLarge4PreTrainedModel._keys_to_ignore_on_load_unexpected``, commented "a multi-token-prediction draft head
that this model does not implement yet"), and no public loader names those tensors (searched: vLLM, SGLang,
tokenspeed, llama.cpp and every public repository indexed for the string ``mtp_dspark.``; none reads them): its stage
layout is not public, so a checkpoint carrying them is refused in one line rather than guessed at.

``stitch`` writes a copy of the checkpoint with some stage tensors replaced where they are (same name, file, shape and
dtype), every other tensor's bytes and the config untouched.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from treadle.errors import UserError
from treadle.models.checkpoint_files import safetensors_files

STAGE = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
CONFIG_KEYS = ("dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id", "dspark_markov_rank")
ATTENTION = ("attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.kv_norm.weight",
             "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink")
COMMON = ATTENTION + ("attn_norm.weight", "ffn_norm.weight", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
                      "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "ffn.gate.weight", "ffn.gate.bias",
                      "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")
FIRST = ("main_proj.weight", "main_norm.weight")
LAST_BASE = ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "confidence_head.proj.weight")
# The Markov head's (embedding, projection) names: DeepSeek-V4's, then V4.1's.
MARKOV = (("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"),
          ("markov_head.embed.weight", "markov_head.head.weight"))
QUANTIZED = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8")  # FP8 codes / FP4 packed in bytes: a .scale goes beside


@dataclass(frozen=True)
class Tensor:
    file: str
    shape: tuple
    dtype: str  # safetensors' name (F32, BF16, F8_E4M3 ...)


@dataclass(frozen=True)
class Stages:
    """The stages a checkpoint ships: ``tensors[s][suffix]`` and each tensor's full name."""

    tensors: tuple  # per stage: {suffix: Tensor}
    names: dict  # full name -> (stage, suffix)
    markov: tuple  # the Markov head's (embedding, projection) suffixes in this checkpoint

    @property
    def count(self) -> int:
        return len(self.tensors)


def _index(target_dir: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    out = {}
    for f, names in safetensors_files(target_dir).items():
        with safe_open(str(target_dir / f), framework="pt") as h:
            for n in names:
                s = h.get_slice(n)
                out[n] = Tensor(f, tuple(s.get_shape()), s.get_dtype())
    return out


def _config(target_dir: Path) -> dict:
    try:
        return json.loads((target_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{target_dir} has no readable config.json; accepted: a Hugging Face checkpoint") from None


def find(target_dir, where: str = "draft.target") -> Stages | None:
    """The DSpark stages ``target_dir`` ships, checked (names, shapes, config keys) against what their consumers
    load; None when it ships none. A Mistral Large 4 checkpoint with ``mtp_dspark.*`` tensors is refused."""
    target_dir = Path(target_dir)
    config = _config(target_dir)
    index = _index(target_dir)
    if any(n.startswith("mtp_dspark.") for n in index):
        raise UserError(f"{where} {target_dir} ships mtp_dspark.* tensors (Mistral Large 4's DSpark stages), whose "
                        "layout no public loader reads yet (transformers 5.24 drops them unimplemented); accepted: "
                        "a DeepSeek-V4 checkpoint with mtp.{s}.* DSpark stages, or a target without stages")
    found = {}
    for name, t in index.items():
        m = STAGE.match(name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = (name, t)
    if not found:
        return None
    if sorted(found) != list(range(len(found))):
        raise UserError(f"{where} {target_dir}: DSpark stages mtp.{{s}}.* are {sorted(found)}; accepted: stages "
                        "contiguous from 0 (what vLLM and tokenspeed count)")
    if config.get("model_type") != "deepseek_v4":
        raise UserError(f"{where} {target_dir} is a {config.get('model_type')!r} model with mtp.{{s}}.* stages; "
                        "accepted: DSpark stages in a deepseek_v4 checkpoint (DeepSeek-V4 / V4.1)")
    stages = tuple({suffix: t for suffix, (_, t) in found[s].items()} for s in range(len(found)))
    names = {name: (s, suffix) for s in found for suffix, (name, _) in found[s].items()}
    markov = _check(stages, config, f"{where} {target_dir}")
    return Stages(stages, names, markov)


def _need(stage: dict, suffixes, s: int, what: str) -> None:
    missing = [x for x in suffixes if x not in stage]
    if missing:
        raise UserError(f"{what}: stage mtp.{s} lacks {missing[:4]}; accepted: the tensors vLLM's and tokenspeed's "
                        "DSpark loaders require (drafts/dspark/stages.py)")


def _check(stages: tuple, config: dict, what: str) -> tuple:
    """Refuse, in one line, stages their consumers would not load; return the Markov head's suffixes."""
    missing = [k for k in CONFIG_KEYS if config.get(k) is None]
    if missing:
        raise UserError(f"{what}/config.json ships DSpark stages but lacks {missing}; accepted: a config with "
                        f"{', '.join(CONFIG_KEYS)}")
    count = config.get("dspark_num_stages")
    if count is not None and count != len(stages):
        raise UserError(f"{what}/config.json dspark_num_stages = {count} but the checkpoint has {len(stages)} "
                        "stages mtp.{s}.*; accepted: equal")
    d, vocab, rank = config["hidden_size"], config["vocab_size"], config["dspark_markov_rank"]
    hc, taps = config.get("hc_mult", 4), config["dspark_target_layer_ids"]
    experts = config.get("dspark_n_routed_experts") or config.get("n_routed_experts")
    last = len(stages) - 1
    for s, stage in enumerate(stages):
        _need(stage, COMMON + tuple(f"ffn.experts.{e}.w{i}.weight" for e in range(experts) for i in (1, 2, 3)),
              s, what)
        for suffix, t in stage.items():
            if suffix.endswith(".weight") and t.dtype in QUANTIZED:
                _need(stage, (suffix[: -len("weight")] + "scale",), s, what)
    _need(stages[0], FIRST, 0, what)
    markov = next((pair for pair in MARKOV if all(x in stages[last] for x in pair)), None)
    if markov is None:
        raise UserError(f"{what}: stage mtp.{last} has no Markov head ({' + '.join(MARKOV[0])} or "
                        f"{' + '.join(MARKOV[1])}); accepted: a DSpark last stage")
    _need(stages[last], LAST_BASE, last, what)
    shapes = [(0, "main_proj.weight", (d, len(taps) * d)), (0, "main_norm.weight", (d,)), (last, "norm.weight", (d,)),
              (last, markov[0], (vocab, rank)), (last, markov[1], (vocab, rank)),
              (last, "confidence_head.proj.weight", (1, d + rank)), (last, "hc_head_fn", (hc, hc * d)),
              (last, "hc_head_base", (hc,)), (last, "hc_head_scale", (1,))]
    for s, suffix, want in shapes:
        t = stages[s][suffix]
        if t.dtype not in QUANTIZED and t.shape != want:
            raise UserError(f"{what}: mtp.{s}.{suffix} is {t.shape}, the config (hidden_size {d}, vocab_size "
                            f"{vocab}, dspark_markov_rank {rank}, {len(taps)} dspark_target_layer_ids, hc_mult {hc}) "
                            f"makes it {want}; accepted: stages of this config")
    return markov


def stitch(target_dir, out, replaced: dict, stages: Stages | None = None) -> None:
    """A copy of ``target_dir`` in ``out`` (created) with the stage tensors ``replaced`` (full name -> tensor) put
    where they are: same name, file, shape and dtype. A file holding none of them is copied byte for byte; one that
    does is written again with its other tensors as stored (their bytes unchanged) and its metadata; the index,
    config.json and every other file are copied as they are. Refused before anything is written: a name that is not
    a stage tensor, a shape or dtype that differs, a quantized tensor (FP8 / FP4: treadle does not re-quantize)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target_dir, out = Path(target_dir), Path(out)
    stages = stages if stages is not None else find(target_dir)
    if stages is None:
        raise UserError(f"{target_dir} ships no DSpark stages (mtp.{{s}}.*); nothing to stitch")
    dtypes = {"F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16", "F64": "torch.float64"}
    for name, t in replaced.items():
        if name not in stages.names:
            raise UserError(f"stitch: {name!r} is not a DSpark stage tensor of {target_dir}; nothing was written")
        s, suffix = stages.names[name]
        have = stages.tensors[s][suffix]
        if have.dtype in QUANTIZED or suffix.endswith(".scale"):
            raise UserError(f"stitch: {name} is stored quantized ({have.dtype}); treadle writes back float stage "
                            "tensors only; nothing was written")
        if tuple(t.shape) != have.shape or str(t.dtype) != dtypes.get(have.dtype):
            raise UserError(f"stitch: {name} would become {tuple(t.shape)} {t.dtype}, the checkpoint stores "
                            f"{have.shape} {have.dtype}; nothing was written")
    by_file: dict[str, list[str]] = {}
    for name in replaced:
        s, suffix = stages.names[name]
        by_file.setdefault(stages.tensors[s][suffix].file, []).append(name)
    out.mkdir(parents=True)
    for f, names in safetensors_files(target_dir).items():
        if f not in by_file:
            shutil.copyfile(target_dir / f, out / f)
            continue
        with safe_open(str(target_dir / f), framework="pt") as h:
            tensors = {n: h.get_tensor(n) for n in names}
            meta = h.metadata()
        tensors.update({n: replaced[n].detach().contiguous().cpu() for n in by_file[f]})
        save_file(tensors, str(out / f), metadata=meta)
    for p in target_dir.iterdir():  # config.json, the index, tokenizer ...: as they are
        if p.is_file() and not p.name.endswith(".safetensors"):
            shutil.copyfile(p, out / p.name)
