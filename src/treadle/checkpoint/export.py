"""Export weights as a Hugging Face model directory (safetensors, config, tokenizer)."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import AutoTokenizer, PreTrainedModel

from treadle.errors import UserError
from treadle.fsutil import claim_output, default_modes, marked_whole, replace_dir, write_marker
from treadle.quiet import hf_quiet

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KIND = "export"  # the marker's kind: hf and draft exports may replace each other, nothing else


def _torch_dtype(name: str) -> torch.dtype:
    """An export's ``--dtype``; a name not in DTYPES is one line."""
    if name not in DTYPES:
        raise UserError(f"export dtype {name!r} is unknown; accepted: {', '.join(DTYPES)}")
    return DTYPES[name]


# What an export held before exports carried a marker (treadle 0.1.0's own runs): recognized by its file names.
_EXPORT_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                 "draft_model_weights.pth", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja")


def unmarked_export(path: Path) -> bool:
    """An export written before exports carried a marker: a directory of export files only, config.json among them."""
    names = [p.name for p in path.iterdir()] if path.is_dir() else []
    return ("config.json" in names and all(any(fnmatch.fnmatchcase(n, pattern) for pattern in _EXPORT_FILES)
                                           for n in names))


def claim_export(out: Path, flag: str = "OUT") -> None:
    """Refuse an ``out`` holding anything but treadle's own earlier export (see ``claim_output``)."""
    claim_output(Path(out), flag, KIND, ours=unmarked_export)


def export_complete(out: Path, step: int) -> bool:
    """Whether ``out`` holds treadle's whole export of the training step ``step`` (its marker names the step and every
    file at its size). A kill after a run's final checkpoint, before its export was renamed into place, leaves none,
    or an earlier one (a run extended by a larger max_steps): a finished run run again writes it then."""
    marker = marked_whole(Path(out), KIND)
    return marker is not None and marker.get("step") == step


def remove_leftovers(out: Path) -> list[Path]:
    """Remove what a kill inside ``atomic_directory`` left beside ``out``: its temporary directory (half written, or
    whole but not renamed) and the earlier export renamed aside (``replace_dir``), by the names only they write,
    ``.tmp-<name>-<8 hex>`` and ``.old-<name>-<8 hex>``. Call it once ``out`` is whole again, with no other writer."""
    out = Path(out)
    named = re.compile(rf"^\.(tmp|old)-{re.escape(out.name)}-[0-9a-f]{{8}}$")
    left = [p for p in out.parent.iterdir() if named.match(p.name) and p.is_dir() and not p.is_symlink()]
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return left


@contextlib.contextmanager
def atomic_directory(out: Path, command: str, step: int | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; it replaces ``out`` only if the block succeeds.

    A reader sees the old directory or the new one, never half of one; ``out`` is replaced only when it
    holds treadle's own earlier export, and the new one gets the marker that says so (with the training ``step``
    it holds, where known: what ``export_complete`` reads).
    """
    claim_export(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        default_modes(tmp)
        write_marker(tmp, KIND, command, step=step)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def state_tokenizer_ids(directory: Path, tokenizer_dir: Path) -> None:
    """An export's Hugging Face ``config.json`` (one with a ``model_type``) and ``generation_config.json`` state the
    bos / eos / pad ids of the tokenizer in ``tokenizer_dir`` (``tokenizer.stated_ids``): the tokenizer an export
    carries and the ids its model stops and pads on never disagree, whatever config the model (or a draft's target)
    came with. Only ``directory``'s own files: a copy of the target inside it (an MTP export's ``stitched/``) keeps
    the target's config, which is the identity (config fingerprint) its draft is checked against."""
    from treadle.tokenizer import special_ids, stated_ids

    ids = special_ids(tokenizer_dir)
    for name, generation in (("config.json", False), ("generation_config.json", True)):
        path = Path(directory) / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        if not generation and "model_type" not in config:  # treadle's own draft config: no model to stop
            continue
        path.write_text(json.dumps({**config, **stated_ids(config, ids, generation)}, indent=2, sort_keys=generation)
                        + "\n")


def export_hf(model: PreTrainedModel, state_dict: dict, tokenizer_dir: Path | None, out: Path,
              dtype: str = "fp32", enabled: bool = True, command: str = "train", chat_template: str | None = None,
              into: Callable[[Path, torch.dtype], None] | None = None, step: int | None = None) -> Path:
    """``chat_template`` (Jinja): what an SFT run rendered conversations with; the exported tokenizer gets it
    (transformers writes chat_template.jinja), so ``apply_chat_template`` gives the ids training saw. ``into``: what
    adds weights the model's checkpoint carries beside its module's (a draft beside it: ``DraftKind.into_model``),
    called on the directory before it replaces ``out``. ``step``: the training step the weights are, for the marker."""
    out = Path(out)
    if not enabled:
        return out
    torch_dtype = _torch_dtype(dtype)
    state_dict = {k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in state_dict.items()}
    with atomic_directory(out, command, step) as tmp, hf_quiet():
        # Training disables the KV cache for packed sequences; an exported model is for inference.
        saved = model.config.use_cache, model.config.dtype
        model.config.use_cache = True
        try:
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            # save_pretrained records the dtype of the model's parameters, not of the state dict it wrote;
            # from_pretrained loads in the recorded one (transformers 5: "dtype" in config.json).
            model.config.dtype = torch_dtype
            model.config.save_pretrained(tmp)
        finally:
            model.config.use_cache, model.config.dtype = saved
        if tokenizer_dir is not None:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            if chat_template is not None:  # treadle's built-in template, or the tokenizer's own again
                tokenizer.chat_template = chat_template
            tokenizer.save_pretrained(tmp)
            state_tokenizer_ids(tmp, tokenizer_dir)
        if into is not None:
            into(tmp, torch_dtype)
    return out


def export_draft(model, state_dict: dict, out: Path, target_dir: Path, identity: dict, cfg, step: int | None = None,
                 command: str = "train", dtype: str = "fp32", extra: bool = True, to: str = "draft") -> Path:
    """The draft alone, with what identifies its target; ``treadle.drafts.registry.load_draft`` loads it.

    The files are its kind's (``DraftKind.export`` / ``write_extra``, drafts/<kind>/kind.py): the layout its
    consumers load, with treadle's metadata (what the target is, by summary and fingerprints, not where it sat; the
    run's config and step) as extra config keys. ``dtype``: the weights' dtype on disk (loading casts them to the model's own); integer and
    boolean tensors (a vocabulary map) keep theirs.
    A weight the layout has no name for, or one it needs and the draft lacks, is refused before anything is written.
    ``extra=False``: without the kind's extra files (an mtp draft beside its model: its ``stitched/`` would be a
    second copy of the model export, which carries the layer itself). ``to="speculators"``: the speculators format
    instead (drafts/speculators_format.py), for the kinds that have one.
    """
    from safetensors.torch import save_file

    from treadle.drafts import registry

    draft = model.draft_model
    prefix = "draft_model."  # ``state_dict``: the whole draft model's full weights, as an engine exports them
    torch_dtype = _torch_dtype(dtype)
    weights = {k[len(prefix):]: v.detach().to("cpu", torch_dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in state_dict.items() if k.startswith(prefix)}
    meta = {
        "target": identity,
        "target_config": model.target.config.to_dict(),
        "training": {**cfg.model_dump(mode="json"), "step": step},
    }
    kind = registry.kind(draft.export_config()["treadle_draft_kind"])
    if to == "speculators":
        from treadle.drafts import speculators_format

        weights, config = speculators_format.export(registry.speculators_table(kind), draft, weights, model.target,
                                                    torch_dtype, meta)
    else:
        weights, config = kind.export(draft, weights, model.target.config, torch_dtype, dtype, meta)
    out = Path(out)
    with atomic_directory(out, command, step) as tmp:
        tmp.mkdir()
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if extra and to != "speculators":  # the kind's extra files are its engine layout's (dflash.py, stitched/)
            kind.write_extra(tmp, weights, config, Path(target_dir))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        if (Path(target_dir) / "tokenizer.json").is_file():  # the draft decodes with its target's tokenizer
            AutoTokenizer.from_pretrained(target_dir).save_pretrained(tmp)
            state_tokenizer_ids(tmp, target_dir)
    return out


def export_adapter(adapters, state_dict: dict, out: Path, step: int | None = None, command: str = "train",
                   dtype: str = "fp32", base_name: str | None = None) -> Path:
    """A LoRA run's adapters as a PEFT adapter directory: ``adapter_config.json`` (PEFT's LoraConfig, inference
    mode) and ``adapter_model.safetensors`` (PEFT's names), which ``PeftModel.from_pretrained`` and vLLM's
    ``--enable-lora`` load; ``treadle_adapter.json`` beside them names the base it was trained on.
    ``state_dict``: the trained model's full weights, as an engine exports them (the adapters are picked out).
    ``base_name`` (lora.base_name, ``--base-name``): what ``base_model_name_or_path`` says, e.g. a hub id; unset, a
    local base is named by its absolute path (PEFT records the path the base was loaded from, relative when the run's
    was: AutoPeftModelForCausalLM would look for it under whatever directory it runs in)."""
    import copy

    from safetensors.torch import save_file

    from treadle.models.lora import IDENTITY_FILE, adapter_state

    torch_dtype = _torch_dtype(dtype)
    weights = {k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in adapter_state(adapters, state_dict).items()}
    if not weights:
        raise UserError(f"{out}: the model holds no LoRA tensors to export (no adapters were trained)")
    config = copy.deepcopy(adapters.peft_config)
    config.inference_mode = True  # as PEFT's own save_pretrained writes it
    config.base_model_name_or_path = base_name or absolute_base(config.base_model_name_or_path)
    out = Path(out)
    with atomic_directory(out, command, step) as tmp:
        tmp.mkdir()
        config.save_pretrained(str(tmp))
        save_file(weights, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / IDENTITY_FILE).write_text(json.dumps({"base": adapters.base, "step": step}, indent=2) + "\n")
    return out


def absolute_base(name: str | None) -> str | None:
    """A base named by a local path, as an absolute path (resolved against the current directory, the one it was
    loaded from); anything else (a hub id, None) unchanged."""
    if name and Path(name).exists():
        return str(Path(name).resolve())
    return name


def export_checkpoint(source: str | Path, out: Path, dtype: str = "fp32", to: str = "auto", merge: bool = False,
                      base_name: str | None = None) -> Path:
    """``treadle export``: rebuild what a checkpoint was trained as, load its weights, export.

    ``to="hf"`` for a model run; ``to="draft"`` for a draft run (the draft alone, as at the end of the run),
    ``to="speculators"`` the same draft in the speculators format;
    ``"auto"``: whichever the checkpoint's config says it is. A LoRA run (``[lora]``): its adapter directory, or
    with ``merge`` the base with the adapters merged in, as a Hugging Face model (a draft LoRA run: the base draft
    of draft.init with them merged in, as a draft in its kind's layout, which engines serve today). ``base_name``:
    the adapter's recorded base (``--base-name``; else the run's lora.base_name, else the base's absolute path).
    """
    from treadle.checkpoint.discovery import checkpoint_at
    from treadle.checkpoint.remote import as_path
    from treadle.checkpoint.validate import COMPANIONS, checkpoint_format, run_state
    from treadle.checkpoint.safety import loading, safe_dcp_load
    from treadle.config import load_config
    from treadle.models.hf import build_model
    from treadle.tokenizer import RunTokenizer

    _torch_dtype(dtype)  # a bad dtype is refused before the checkpoint is read
    claim_export(out)  # before the checkpoint is read: a refusal costs nothing
    # Read-only (a live run's temporaries are not ours to touch); it inspects the checkpoint it returns, which
    # vets every pickle of a DeepSpeed checkpoint before checkpoint_weights hands the directory to DeepSpeed.
    ckpt = checkpoint_at(as_path(source), f"treadle export SOURCE {str(source)!r}")  # a URL: a checkpoint.dir
    cfg = load_config(ckpt / "config.toml")
    drafted = to in ("draft", "speculators")
    if drafted and cfg.draft.beside:
        raise UserError(f"checkpoint {ckpt} is a model run with a draft beside it (draft.target = 'self'): its export "
                        "is the model's; the run writes the draft at its end (draft/, naming hf/); accepted: --to hf "
                        "or --to auto (the default)")
    if to != "auto" and cfg.draft.frozen_target != drafted:
        kind = "a draft run" if cfg.draft.frozen_target else "a model run"
        accepted = "draft, --to speculators" if cfg.draft.frozen_target else "hf"
        raise UserError(f"checkpoint {ckpt} is {kind}; accepted: --to {accepted} or --to auto (the default)")
    if to == "speculators":
        from treadle.drafts import registry

        registry.speculators_table(registry.kind(cfg.draft.kind))  # refused before the checkpoint is read
    if merge and cfg.lora.rank is None:
        raise UserError(f"treadle export --merge: checkpoint {ckpt} is a full run, without LoRA adapters to merge; "
                        "accepted: a checkpoint of a run with lora.rank set, or no --merge")
    if base_name is not None and (merge or cfg.lora.rank is None):
        what = "--merge writes the whole model" if merge else f"checkpoint {ckpt} is a full run, without adapters"
        raise UserError(f"treadle export --base-name names the base an adapter export records, but {what}; "
                        "accepted: --base-name on a LoRA run's checkpoint without --merge")
    train_state = run_state(ckpt)
    meta = train_state["meta"]
    adapters = None
    if cfg.draft.frozen_target:  # a draft beside its model (draft.target = 'self') exports the model
        from treadle.drafts.registry import build_draft

        model, target_dir, identity = build_draft(cfg.draft, meta["vocab_size"], meta["tokenizer_fingerprint"])
        module, prefix = model.draft_model, "draft_model."
        if cfg.lora.rank is not None:  # adapters on the base draft of draft.init: that draft, and no other
            from treadle.drafts.kind import init_dir
            from treadle.models.lora import apply_lora, check_same_base, draft_base_identity

            base = draft_base_identity(cfg.draft.kind, init_dir(cfg.draft.init), model.target.config)
            check_same_base(meta.get("base"), base, f"checkpoint {ckpt}")  # draft.init now holds another draft
            adapters = apply_lora(module, cfg.lora, base, prefix=prefix)
    else:
        torch.manual_seed(cfg.train.seed)  # a LoRA run's base from a preset is the run's seeded random init
        model = build_model(cfg.model, meta["vocab_size"], tokenizer=RunTokenizer.from_meta(meta))
        if cfg.lora.rank is not None:
            from treadle.models.lora import apply_lora, base_identity, check_same_base

            identity = base_identity(cfg.model, model.config, cfg.train.seed)
            check_same_base(meta.get("base"), identity, f"checkpoint {ckpt}")  # model.path now holds another model
            adapters = apply_lora(model, cfg.lora, identity)
            model = adapters.model
        module, prefix = model, ""
    draft, into = beside_draft(cfg, model, meta["vocab_size"])
    # Only the trained module's entries: optimizer state and frozen tensors stay on disk (or were never there): a
    # frozen part of the trained module (a lilicorr run's frozen backbone, an adapter run's base) was never saved.
    params = dict(module.named_parameters())

    def saved(key: str) -> bool:  # a trained parameter; a buffer too, unless the run trained adapters (the base's)
        return params[key].requires_grad if key in params else adapters is None

    state = {"model": {prefix + k: v for k, v in module.state_dict().items() if saved(k)}}
    if draft is not None:  # the companion's weights (train/cotrain.py ``DraftBeside.state_dict``)
        state["draft"] = {"model": draft.state_dict()}
    if checkpoint_format(ckpt) == "deepspeed":
        from treadle.engine.deepspeed import checkpoint_weights

        with loading(ckpt):
            saved = checkpoint_weights(ckpt / "deepspeed")
        missing = sorted(state["model"].keys() - saved.keys())
        if missing:
            raise UserError(f"checkpoint {ckpt}: deepspeed/ lacks {missing[0]} (and {len(missing) - 1} more)")
        state["model"] = {k: saved[k] for k in state["model"]}
        if draft is not None:  # DeepSpeed's files hold its engine's state: the companion is beside them (manager.py)
            safe_dcp_load({"draft": state["draft"]}, ckpt / COMPANIONS, ckpt)
    else:
        safe_dcp_load(state, ckpt / "state", ckpt)
    module.load_state_dict({k.removeprefix(prefix): v for k, v in state["model"].items()}, strict=all(p.requires_grad for p in params.values()))
    if draft is not None:
        draft.load_state_dict(state["draft"]["model"])
    if adapters is not None and not merge:
        return export_adapter(adapters, model.state_dict(), out, step=train_state["train"]["step"], command="export",
                              dtype=dtype, base_name=base_name or cfg.lora.base_name)
    if adapters is not None:
        from treadle.models.lora import merged_model

        merged = merged_model(adapters)  # in place: a draft run's draft_model is the merged draft now
        model = model if cfg.draft.frozen_target else merged
    if cfg.draft.frozen_target:
        return export_draft(model, model.state_dict(), out, target_dir, identity, cfg.draft,
                            step=train_state["train"]["step"], command="export", dtype=dtype,
                            to="speculators" if to == "speculators" else "draft")
    tokenizer = Path(meta["tokenizer_dir"]) if meta.get("tokenizer_dir") else None
    return export_hf(model, model.state_dict(), tokenizer if tokenizer and tokenizer.is_dir() else None, out,
                     dtype=dtype, command="export", chat_template=meta.get("chat_template"),
                     into=into, step=train_state["train"]["step"])


def beside_draft(cfg, model, vocab_size: int) -> tuple:
    """(the draft module, what puts it into the model's export) of a run with a draft beside ``model`` whose weights
    its model's export carries (mtp): built around it for the checkpoint's weights to load into; (None, None) for
    any other run."""
    from treadle.drafts import registry
    from treadle.drafts.targets import beside

    if not (cfg.draft.beside and registry.kind(cfg.draft.kind).carried_by_model):
        return None, None
    with beside(model):  # draft.init is where the run started, not what it trained: the checkpoint holds that
        built, _, _ = registry.kind(cfg.draft.kind).build(cfg.draft.model_copy(update={"init": None}), vocab_size,
                                                          None)
    return built.draft_model, registry.kind(cfg.draft.kind).into_model(built.draft_model)