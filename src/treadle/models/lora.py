"""LoRA adapters on a frozen base model, built by PEFT (``[lora]``, docs/lora.md).

PEFT's ``get_peft_model`` injects its LoRA layers into the Hugging Face model in place; the run trains that same
model object (``Adapters.model``), so every treadle transform, engine and loss sees a plain ``PreTrainedModel``
whose only trainable parameters are the adapters (``...lora_A.default.weight``, ``...lora_B.default.weight``) and
the copies PEFT makes of ``modules_to_save``. The ``PeftModel`` around it is kept for what PEFT owns: the adapter's
config, the names an adapter file uses, merging.

Layer 0 for the rest of treadle: the engines checkpoint only trainable tensors (engine/local.trainable_state), so a
LoRA checkpoint holds the adapters, their optimizer state and the run's state, never the frozen base. What the base
is travels in the checkpoint's meta (``base_fingerprint``) and in every adapter export (``IDENTITY_FILE``): a
resume or an export against another base is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from treadle.errors import UserError

ADAPTER = "default"  # PEFT's adapter name: its parameters are named ...lora_A.default.weight
PEFT_PREFIX = "base_model.model."  # how a PeftModel names the base model's tensors (and adapter files name theirs)
IDENTITY_FILE = "treadle_adapter.json"  # beside adapter_config.json: the base an adapter was trained on
# Module classes PEFT's LoRA adapts or trains in full (what a name in target_modules / modules_to_save may be).
_ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)

# bitsandbytes 0.50 on an AVX512-BF16 CPU looks for the optional `kernels` package when it is imported and warns
# without it. A run without 4-bit weights never imports it (quiet_peft); a QLoRA run does, and never runs that kernel
# (quantize_base turns the AVX512-BF16 path off), so the line tells its user nothing to act on.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


@dataclass
class Adapters:
    """A base model with PEFT's LoRA layers injected, and what identifies the base."""

    peft: nn.Module  # peft.PeftModel: its base model is ``model``
    base: dict  # base_identity(...) (a draft's: draft_base_identity(...))
    # Where ``model`` sits in the module a run trains: "" for a model run, "draft_model." for a draft run (the
    # adapted draft inside its DraftRunModel, beside the frozen target): an engine's state dict names it so.
    prefix: str = ""

    @property
    def model(self) -> nn.Module:
        """The Hugging Face model with the adapters in it: what the run trains and the engines wrap."""
        return self.peft.get_base_model()

    @property
    def fingerprint(self) -> str:
        return self.base["fingerprint"]

    @property
    def peft_config(self):
        return self.peft.peft_config[ADAPTER]


def base_identity(model_cfg, hf_config, seed: int) -> dict:
    """What the frozen base is: its architecture (summary and config fingerprint, as a draft names its target) and
    its weights: the files' fingerprint for ``model.path``, else the seed the run's random init used (a preset or a
    config.json without weights is rebuilt from it: the same seed gives the same base). ``fingerprint`` hashes it
    all; it is what a checkpoint records and a resume compares."""
    from treadle.models.identity import target_config_fingerprint, target_summary
    from treadle.model_dirs import model_fingerprint, resolve_model_dir
    from treadle.models.hf import has_weights

    identity = {**target_summary(hf_config), "config_fingerprint": target_config_fingerprint(hf_config)}
    directory = resolve_model_dir(Path(model_cfg.path), "model.path") if model_cfg.path is not None else None
    if directory is not None and has_weights(directory):
        identity["weights_fingerprint"] = model_fingerprint(directory)
    else:
        identity["random_init_seed"] = seed
    identity["fingerprint"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return identity


def draft_base_identity(kind: str, draft_dir: Path, target_config) -> dict:
    """What the base draft of a draft LoRA run is (``draft.init``; spec-eval's ``--draft``): its kind, its files'
    fingerprint and the target it drafts for (summary and config fingerprint, as a draft export names its target).
    ``fingerprint`` hashes it all, as ``base_identity``'s does."""
    from treadle.models.identity import target_config_fingerprint, target_summary
    from treadle.model_dirs import model_fingerprint

    identity = {"draft_kind": kind, **target_summary(target_config),
                "config_fingerprint": target_config_fingerprint(target_config),
                "weights_fingerprint": model_fingerprint(Path(draft_dir))}
    identity["fingerprint"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return identity


def describe_base(identity: dict) -> str:
    """'llama, hidden_size 32, ..., fingerprint 1a2b...' for a refusal (a base draft: 'the eagle3 draft for ...')."""
    from treadle.models.identity import describe_target

    how = (f"weights {identity['weights_fingerprint']}" if "weights_fingerprint" in identity
           else f"random init seed {identity.get('random_init_seed')}")
    draft = f"the {identity['draft_kind']} draft for " if "draft_kind" in identity else ""
    return f"{draft}{describe_target(identity)}, {how}"


def module_names(model: nn.Module) -> dict[str, str]:
    """The last part of each adaptable module's name -> its class, over the whole model (a target's or a
    modules_to_save name is one of these: PEFT matches a plain name against the end of the module path)."""
    return {name.rsplit(".", 1)[-1]: type(m).__name__ for name, m in model.named_modules()
            if name and isinstance(m, _ADAPTABLE)}


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face model (PEFT's CAUSAL_LM task), not a draft's own module (PEFT's custom-model path)."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def decoder_linear_names(model: nn.Module) -> list[str]:
    """``all-linear``: the names of every nn.Linear inside the decoder layers (never the LM head, as PEFT's own
    all-linear leaves the output layer out). A draft's module (not a Hugging Face model): every nn.Linear but its
    ``lm_head`` and the other output heads it lists in ``lora_heads`` (DSpark's 1-output confidence head and its
    Markov head), what vLLM RFC #52038 adapts (all drafter layers but lm_head and embed_tokens); a head named in
    lora.target_modules still gets adapters."""
    from treadle.models.hf import decoder_layers

    if not is_hf_model(model):
        heads = {"lm_head", *getattr(model, "lora_heads", ())}
        return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                       if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in heads})
    return sorted({name.rsplit(".", 1)[-1] for name, m in decoder_layers(model).named_modules()
                   if isinstance(m, nn.Linear)})


def resolve_targets(model: nn.Module, lora) -> tuple[list[str], list[str]]:
    """``lora.target_modules`` and ``lora.modules_to_save`` as module names this model has; a name it lacks is one
    line naming the modules it has."""
    have = module_names(model)
    kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    accepted = ", ".join(sorted(have))
    targets = decoder_linear_names(model) if lora.target_modules == "all-linear" else list(lora.target_modules)
    if not targets:
        raise UserError(f"lora.target_modules = 'all-linear': this {kind} model has no nn.Linear in its decoder "
                        f"layers; accepted: module names among {accepted}")
    for key, names in (("target_modules", targets), ("modules_to_save", list(lora.modules_to_save))):
        unknown = [n for n in names if n not in have]
        if unknown:
            raise UserError(f"lora.{key}: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                            f"a module of this {kind} model; accepted: 'all-linear' or names among {accepted}"
                            if key == "target_modules" else
                            f"lora.{key}: {', '.join(map(repr, unknown))} not a module of this {kind} model; "
                            f"accepted: names among {accepted}")
    both = sorted(set(targets) & set(lora.modules_to_save))
    if both:
        raise UserError(f"lora: {both[0]!r} is in both lora.target_modules and lora.modules_to_save; accepted: a "
                        "module gets adapters or is trained in full, not both")
    return targets, list(lora.modules_to_save)


def bitsandbytes_backend(device: torch.device) -> str | None:
    """Why QLoRA cannot hold a base in 4-bit on ``device`` here (None: bitsandbytes is installed and has a backend
    for it: CUDA, or its CPU backend from 0.45 on)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return "bitsandbytes is not installed (pip install 'treadle[qlora]': bitsandbytes 0.50, an optional extra)"
    except Exception as exc:  # a broken install (a CUDA library it cannot load) says so on import
        return f"bitsandbytes does not import here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if device.type not in ("cuda", "cpu"):
        return f"bitsandbytes has no backend for {device.type} in treadle"
    return None


def quantize_base(model: nn.Module) -> int:
    """QLoRA's frozen base: every nn.Linear of the decoder layers replaced, in place, by bitsandbytes' ``Linear4bit``
    holding its weight in NF4 (the LM head and embeddings stay as they are, as transformers' BitsAndBytesConfig
    leaves them); the matmuls compute in the weight's former dtype. Call before ``apply_lora``: PEFT then wraps each
    in its 4-bit LoRA layer. Returns how many layers were quantized."""
    import bitsandbytes as bnb

    from treadle.models.hf import decoder_layers

    quantized = 0
    for layer in decoder_layers(model):
        for name, old in list(layer.named_modules()):
            if type(old) is not nn.Linear:
                continue
            new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                                    compute_dtype=old.weight.dtype, quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(old.weight.detach().clone(), requires_grad=False, quant_type="nf4")
            if old.bias is not None:
                new.bias = nn.Parameter(old.bias.detach().clone(), requires_grad=False)
            # bitsandbytes' CPU inference path (no grad, AVX512-BF16) repacks the weight with bf16 block scales on
            # the first eval forward: evals would score another base than training (and layers narrower than a
            # 64-value block fail there). One format, train and eval alike.
            new.support_avx512bf16_for_cpu = False
            parent, _, leaf = name.rpartition(".")
            # Params4bit quantizes when it is moved to its device: the layer's, where the model was built
            setattr(layer.get_submodule(parent) if parent else layer, leaf, new.to(old.weight.device))
            quantized += 1
    return quantized


def quantized_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """The dtype QLoRA's 4-bit layers dequantize to and multiply in: the run's autocast dtype (bf16), as QLoRA's
    recipe computes. ``quantize_base`` leaves the weights' former dtype (fp32 master weights under autocast), whose
    fp32 matmuls ran a 1.1B QLoRA step at 57 TFLOP/s on an H200 against LoRA's 101."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.compute_dtype = dtype


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Around PEFT's imports and calls (main thread: catch_warnings swaps the process's filters).

    bitsandbytes stays unimported unless something imported it before (QLoRA's quantize_base, or the user): PEFT
    imports it whenever it is installed (peft/helpers.py, and LoRA's layer dispatchers on every injection), which
    costs a run without 4-bit weights its import time and, on an AVX512-BF16 CPU, its warning about the optional
    `kernels` package. A ``None`` in ``sys.modules`` is Python's "not installed": ``import`` raises ImportError and
    ``find_spec`` (PEFT's is_bnb_available) answers None. PEFT caches is_bnb_4bit_available: cleared on the way out, so
    a later QLoRA run in the same process sees bitsandbytes again.

    The warnings filtered are PEFT's business, not the user's: PEFT 0.21 itself reads transformers' deprecated
    ``is_gradient_checkpointing`` (5.23+; peft_model.py, PeftModel.__init__), which treadle never calls (it enables
    checkpointing through ``activation_checkpointing_enable``, models/checkpointing.py)."""
    hide = "bitsandbytes" not in sys.modules
    if hide:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # PEFT's own rewrite of an MoE's expert names (DeepSeek-V3) leaves patterns for a layout the model lacks
            warnings.filterwarnings("ignore", message=".*_pattern keys did not match any targeted module.*",
                                    category=RuntimeWarning)
            yield
    finally:
        if hide and "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]
            cached = getattr(sys.modules.get("peft.import_utils"), "is_bnb_4bit_available", None)
            if cached is not None and hasattr(cached, "cache_clear"):
                cached.cache_clear()


def apply_lora(model: nn.Module, lora, identity: dict, prefix: str = "") -> Adapters:
    """PEFT's LoRA layers injected into ``model`` (in place) per ``lora`` (a ``LoraConfig`` section with a rank);
    every base parameter frozen. PEFT's default init: A Kaiming-uniform, B zero, so the adapted model starts as the
    base. ``model``: a Hugging Face model, or a draft's module (``prefix`` "draft_model.": where it sits in the run's
    model), which PEFT adapts as a custom model (no task type)."""
    if lora.rank is None or lora.rank < 1:
        raise UserError(f"lora.rank = {lora.rank!r}; accepted: an integer >= 1")
    targets, to_save = resolve_targets(model, lora)
    with quiet_peft():
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                target_modules=targets, modules_to_save=to_save or None, bias="none",
                                task_type="CAUSAL_LM" if is_hf_model(model) else None)
        peft = get_peft_model(model, config, adapter_name=ADAPTER)
    return Adapters(peft, identity, prefix)


def adapter_state(adapters: Adapters, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names an adapter file uses (PEFT's: ``base_model.model.<module>.lora_A.weight``,
    no adapter name), picked from ``state_dict``: the trained model's full weights as an engine exports them (the
    Hugging Face model's own names; a draft run's: its DraftRunModel's, the draft's under ``adapters.prefix``)."""
    p = adapters.prefix
    named = {PEFT_PREFIX + k[len(p):]: v for k, v in state_dict.items() if k.startswith(p)}
    with quiet_peft():
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(adapters.peft, state_dict=named, adapter_name=ADAPTER,
                                         save_embedding_layers=False)


def merged_model(adapters: Adapters) -> nn.Module:
    """The base with the adapters folded into its weights (W + alpha/r B A) and PEFT's layers removed: a plain
    Hugging Face model. Changes ``adapters``' model in place (an export's last use of it)."""
    with quiet_peft():
        return adapters.peft.merge_and_unload(safe_merge=True)


def trainable_names(model: nn.Module) -> list[str]:
    """The state-dict names of what a LoRA run trains (adapters and modules_to_save copies)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def read_identity(adapter_dir: Path) -> dict | None:
    """The base identity an adapter export records (None: an adapter written elsewhere, which records none)."""
    path = Path(adapter_dir) / IDENTITY_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["base"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"adapter {adapter_dir}: {IDENTITY_FILE} is unreadable ({exc}); accepted: the file treadle "
                        "export wrote, or none") from None


def _base_kind(identity: dict) -> str:
    return f"the {identity['draft_kind']} draft" if "draft_kind" in identity else "a model"


def refuse_model_adapter(recorded: dict, what: str, expected: str) -> None:
    """One line when an adapter of a model (a [model] LoRA run's) is given where an adapter of a draft is expected
    (spec-eval's --adapter): what it adapts and what was expected, before any fingerprint is compared."""
    if "draft_kind" not in recorded:
        raise UserError(f"{what} is an adapter of a model ({describe_base(recorded)}), not of a draft; accepted: an "
                        f"adapter of {expected} (the adapter/ of a draft LoRA run whose draft.init it is)")


def base_differences(recorded: dict, identity: dict) -> str:
    """The fields that differ between two base identities, each with both values ('weights_fingerprint 1a2b then,
    3c4d now'): only those, the fields both sides share left out."""
    keys = [k for k in [*recorded, *(k for k in identity if k not in recorded)] if k != "fingerprint"]
    differ = [k for k in keys if recorded.get(k) != identity.get(k)]
    return "; ".join(f"{k} {recorded.get(k, 'unset')} then, {identity.get(k, 'unset')} now" for k in differ)


def check_same_base(recorded: dict | None, identity: dict, what: str) -> None:
    """One line when an adapter (or a checkpoint's adapters) was trained on another base than ``identity``: an
    adapter of a model where a draft's is wanted (or the reverse) says so; else the fields that differ."""
    if recorded is None or recorded.get("fingerprint") == identity.get("fingerprint"):
        return
    if ("draft_kind" in recorded) != ("draft_kind" in identity):
        raise UserError(f"{what} is an adapter of {_base_kind(recorded)} ({describe_base(recorded)}), not of "
                        f"{_base_kind(identity)}; accepted: an adapter trained on {_base_kind(identity)} "
                        f"({describe_base(identity)})")
    differ = base_differences(recorded, identity) or f"fingerprint {recorded.get('fingerprint')} then, " \
                                                      f"{identity.get('fingerprint')} now"
    base = recorded.get("model_type", "a model")
    base = f"the {recorded['draft_kind']} draft for {base}" if "draft_kind" in recorded else base
    raise UserError(f"{what} was trained on another base model ({base}: {differ}); accepted: the base it was "
                    "trained on")


def load_adapter(base: nn.Module, adapter_dir: Path, identity: dict | None = None):
    """A ``PeftModel``: ``base`` with the adapter of ``adapter_dir`` (a treadle export or any PEFT LoRA directory)
    loaded; with ``identity`` (the base's, ``base_identity``), an adapter trained on another base is refused."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(f"adapter {adapter_dir} has no adapter_config.json; accepted: a PEFT adapter directory "
                        "(treadle export of a LoRA run)")
    if identity is not None:
        check_same_base(read_identity(adapter_dir), identity, f"adapter {adapter_dir}")
    with quiet_peft():
        from peft import PeftModel

        return PeftModel.from_pretrained(base, adapter_dir)
