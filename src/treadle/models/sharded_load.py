"""Meta-device init and sharded loading: a model from disk that no process ever holds whole.

``from_pretrained`` gives every rank the whole model before an engine can shard it: at 8B
fp32 that is 32 GB per rank, whatever the world size. Under FSDP2 treadle instead builds
the architecture on the meta device (``empty_causal_lm``: shapes only, nothing allocated,
nothing read but ``config.json``), lets the engine shard it, and only then allocates each
rank's shards and reads them (``materialize``): torch's DCP ``HuggingFaceStorageReader``
reads just the rows of each safetensors tensor the rank keeps (``get_slice``), converting
bf16 files to the fp32 master weights on the way. Under ZeRO-3 (``materialize_by_module``) the model is
allocated, filled and partitioned one module at a time: a rank holds its partitions plus one module whole.

Traps met on the way (docs/architecture.md):

* ``to_empty`` leaves every tensor uninitialized, the ones that were already real too (a
  draft run's trainable draft beside its meta target, ``GlideModel``'s own rotary buffers):
  those are copied out before and back after. It also unties tied parameters (each module
  gets a tensor of its own): they are tied again.
* Non-persistent buffers (RoPE's ``inv_freq``) are in no checkpoint: they are recomputed by
  the model's own ``_init_weights``, which is how transformers' ``from_pretrained`` fills them.
* A tied ``lm_head.weight`` is absent from the files (the embedding holds it); DCP would
  fail on the missing key, so keys that share a tensor with a key on disk are not asked for.
* DCP's ``CheckpointException`` derives from ``BaseException``: ``except Exception`` misses it.
* Files that do not name every tensor the model has (older layouts, other key names,
  ``.bin`` weights) cannot be read this way; ``check_loadable`` says so before anything is
  built, and the caller loads the model whole instead.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from treadle.errors import UserError, first_line
from treadle.models.finite import FiniteCheck, file_holding, refuse


# Set on a model built empty: the directory its weights come from. ``materialize`` finds every such module
# (a plain run's model, a draft run's target inside ``GlideModel``) and loads it under its own name.
WEIGHTS_FROM = "treadle_weights_from"
# Set beside it: the config key that named the directory (model.path, draft.target), for a refusal's line.
WEIGHTS_KEY = "treadle_weights_key"


def checkpoint_keys(path: Path) -> set[str] | None:
    """The tensor names of the safetensors files in ``path`` (their headers only), None if it has none."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def _wanted(state: dict[str, torch.Tensor], on_disk: set[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state's entries to read from disk, and the names neither on disk nor tied to a name on disk."""
    storage = {id(_local(t)): k for k, t in state.items() if k in on_disk}
    wanted = {k: t for k, t in state.items() if k in on_disk}
    missing = [k for k, t in state.items() if k not in on_disk and id(_local(t)) not in storage]
    return wanted, missing


def check_loadable(model: nn.Module, path: Path) -> str | None:
    """Why ``path`` cannot fill ``model`` (an empty model of its config) tensor by tensor; None if it can."""
    on_disk = checkpoint_keys(path)
    if on_disk is None:
        return "it has no *.safetensors files"
    _, missing = _wanted(_persistent_state(model), on_disk)
    if missing:
        return f"its files do not name {len(missing)} of the model's tensors (e.g. {missing[0]!r})"
    return None


def empty_causal_lm(path: Path, key: str) -> tuple[nn.Module | None, str | None]:
    """(the ``AutoModelForCausalLM`` of ``path``'s config on the meta device, in eval mode: no weights yet; None).

    (None, the reason) when the files cannot be read part by part: the caller loads the model whole.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from treadle.quiet import hf_quiet

    try:
        with hf_quiet():
            config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{key} {path} cannot be loaded as an AutoModelForCausalLM: {first_line(exc)}") from None
    why = check_loadable(model, path)
    if why is not None:
        return None, why
    setattr(model, WEIGHTS_FROM, path)
    setattr(model, WEIGHTS_KEY, key)
    return model.eval(), None


def is_empty(model: nn.Module) -> bool:
    return any(_local(t).is_meta for _, t in _tensors(model))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _persistent_state(model: nn.Module) -> dict[str, torch.Tensor]:
    # state_dict() keeps tied names separately (both point at one tensor) and leaves non-persistent buffers out.
    return dict(model.state_dict(keep_vars=True))


def _tensors(model: nn.Module):
    return chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


def _tie(model: nn.Module, first: str, others: list[str]) -> None:
    """``to_empty`` gives each module its own new tensor: names that shared one (a tied head) share again."""
    param = model.get_parameter(first)
    for name in others:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, param)


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    _local(getattr(model.get_submodule(owner), attr)).copy_(value)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate ``model``'s meta tensors on ``device`` (as the engine has sharded them, or whole) and fill them from
    the files of every empty module inside; a model with no meta tensor is left as it is.

    Call on every rank, after the engine has sharded the model and before its optimizer is built.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from treadle.distributed import quiet_single_process_dcp

    if not is_empty(model):
        return
    real = {name: _local(t).detach().clone() for name, t in _tensors(model) if not _local(t).is_meta}
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for first, *others in (names for names in shared.values() if len(names) > 1):
        _tie(model, first, others)
    with torch.no_grad():
        for name, value in real.items():
            _set(model, name, value)
    for sub in [m for m in model.modules() if hasattr(m, WEIGHTS_FROM)]:  # listed first: the loop deletes the mark
        path = getattr(sub, WEIGHTS_FROM)
        _recompute_buffers(sub)
        state, _ = _wanted(_persistent_state(sub), checkpoint_keys(path) or set())
        try:
            with quiet_single_process_dcp():  # one process (a store-backed draft run's target): nothing to coordinate
                dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
        except BaseException as exc:  # CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise UserError(f"{path}: its safetensors files cannot be read into the model: {first_line(exc)}") from None
        _check_finite(state, path, getattr(sub, WEIGHTS_KEY, None))
        delattr(sub, WEIGHTS_FROM)


def _check_finite(state: dict[str, torch.Tensor], path: Path, key: str | None) -> None:
    """This rank's part of every tensor just read, on the device it was read to, one host sync for all; a refusal
    names the file whose header holds the tensor. Only the rank holding a bad slice refuses: its exit ends the
    launch (torchrun stops the other ranks)."""
    check = FiniteCheck(key)
    for name, t in state.items():
        check.add(_local(t), name, path)
    bad = check.first_bad()
    if bad is not None:
        t, name, _ = bad
        refuse(t, name, file_holding(path, name) or path, key)


def materialize_by_module(model: nn.Module, device: torch.device, partition: Callable[[nn.Module], None],
                          read: bool = True) -> None:
    """Allocate ``model``'s meta tensors and fill them from the files one module at a time, handing each module to
    ``partition`` (which keeps this rank's part of its parameters and frees the rest) before the next one.

    Children come before their parents, so ``partition`` of a module sees its descendants' parameters already
    partitioned. ``read=False`` leaves parameters unread where ``partition`` overwrites them (ZeRO-3 broadcasts
    rank 0's values); buffers are not partitioned, so every rank reads its own.
    """
    for owner in [m for m in model.modules() if hasattr(m, WEIGHTS_FROM)]:
        path = getattr(owner, WEIGHTS_FROM)
        files = _files_of(path)
        names: dict[int, list[str]] = {}  # a tensor's names in the files' terms (a tied head has two)
        for name, t in owner.state_dict(keep_vars=True).items():
            names.setdefault(id(t), []).append(name)
        made: dict[int, torch.Tensor] = {}  # meta tensor -> its real one: tied names get the same tensor again
        init = getattr(owner, "_init_weights", None)
        check = FiniteCheck(getattr(owner, WEIGHTS_KEY, None))  # what is read: one host sync per module
        for prefix, module in reversed(list(owner.named_modules())):
            fresh = False
            for slots, is_param in ((module._parameters, True), (module._buffers, False)):
                for attr, t in list(slots.items()):
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in made:
                        real = torch.empty_like(t, device=device)
                        made[id(t)] = nn.Parameter(real, requires_grad=t.requires_grad) if is_param else real
                        key = next((k for k in names.get(id(t), []) if k in files), None)
                        if key is not None and (read or not is_param):
                            _read_into(made[id(t)], files[key], key)
                            check.add(made[id(t)], key, files[key])
                        fresh = fresh or is_param
                    slots[attr] = made[id(t)]
            if module._non_persistent_buffers_set and init is not None:
                with torch.no_grad():
                    init(module)  # RoPE's inv_freq: in no file
            check.verify()  # before partition scatters what was read
            if fresh:
                partition(module)
        delattr(owner, WEIGHTS_FROM)


def _files_of(path: Path) -> dict[str, Path]:
    """Which safetensors file of ``path`` holds each tensor (headers only)."""
    from safetensors import safe_open

    files = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    return files


def _read_into(t: torch.Tensor, file: Path, key: str) -> None:
    # Opened per tensor: a mapping kept open would keep every page read so far in this process's RSS.
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f, torch.no_grad():
        t.copy_(f.get_tensor(key))


def _recompute_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (in no checkpoint) filled by the model's own initializer, module by module."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if module._non_persistent_buffers_set:
            if init is None:
                raise RuntimeError(f"{type(module).__name__} has non-persistent buffers and {type(model).__name__} "
                                   "no _init_weights to compute them")
            with torch.no_grad():
                init(module)
