"""Loading a checkpoint (DCP or DeepSpeed) without executing anything it contains.

What torch 2.13's ``torch.distributed.checkpoint`` (DCP) unpickles on load, and
how each path is closed here:

- ``state/.metadata`` is read by ``FileSystemReader.read_metadata`` with a plain
  ``pickle.load``: a crafted file runs arbitrary code. We read it ourselves with
  ``RestrictedUnpickler`` (an allow-list of the classes DCP writes there) and
  hand the result to DCP through ``_PrereadReader``, so DCP never opens the file.
- Tensor entries of ``*.distcp`` are read with ``torch.load(weights_only=True)``
  by DCP itself: already restricted.
- Non-tensor ("bytes") entries of ``*.distcp`` are read by
  ``DefaultLoadPlanner.load_bytes`` with an unrestricted ``torch.load``: a
  crafted entry runs code. Our state dicts do have such entries (the optimizer's
  ``param_groups``: lr, betas, eps, flags, parameter names), so ``_SafePlanner``
  replaces that call with ``torch.load(weights_only=True)``, which only rebuilds
  primitives, containers and tensors.

DeepSpeed 0.19.8 reads every file of its checkpoints (``*model_states.pt``,
``*optim_states.pt``, the universal format's ``zero/<param>/*.pt``) with
an unrestricted ``torch.load`` (weights-only off), and treadle cannot change that call. So
``vet_deepspeed`` checks each ``*.pt`` under ``deepspeed/`` before DeepSpeed sees
the directory: the ``data.pkl`` that ``torch.load`` would unpickle (found with
torch's own zip reader, so it is the same record) is run through the same C
unpickler with ``find_class`` answering only the globals DeepSpeed writes
(``_DEEPSPEED_GLOBALS``), each with an inert stand-in. Nothing is imported or
called (not even DeepSpeed's own classes: vetting does not import deepspeed), tensor
bytes are not read, and every way a pickle can name a global (GLOBAL, STACK_GLOBAL,
INST, OBJ, EXT*) goes through ``find_class``; a file that is not a ``torch.save``
zip (the legacy format unpickles several streams) or is a TorchScript archive is
refused too. Why not a static opcode scan: it is a second parser that must agree with
the unpickler on every opcode (torch's ``get_unsafe_globals_in_checkpoint`` gives up on
protocol 4 and, by its own note, misses globals pushed on the stack); here the parser
is the unpickler itself. Why not ``torch.load(weights_only=True)`` with DeepSpeed's
classes allow-listed: that imports DeepSpeed (which picks its accelerator at import, so
vetting before the engine exists could pick the wrong one), calls the allowed classes,
and reads every tensor.

Invariants:
- ``safe_dcp_load`` never calls an unrestricted unpickler on checkpoint bytes.
- A DeepSpeed checkpoint reaches DeepSpeed only after ``vet_deepspeed`` passed
  (``validate.inspect`` calls it; resume and export both go through it).
- A refused object is a ``UserError`` naming the checkpoint, the file and the
  pickled global (``checkpoint <path>: <file> contains a pickled object of type X.Y, refused``).
- The metadata handed to DCP is the very object that passed the allow-list:
  nothing is re-read between the check and the load.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
# torch.load's own steps for a zip archive (private, pinned with torch 2.13): vetting reads the very record it unpickles.
from torch.serialization import _is_torchscript_zip, _is_zipfile, _open_zipfile_reader

from treadle.checkpoint.remote import RemotePath
from treadle.distributed import quiet_single_process_dcp
from treadle.errors import UserError

# Exactly what DCP 2.13 pickles into .metadata (found by listing the globals of
# real checkpoints), plus harmless path/container types older or other-OS
# writers use. Anything else -- os.system, builtins.eval, subprocess.Popen -- is refused.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    # Maps a layout's name to the torch.layout object through a fixed table; calls nothing else.
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


# Exactly what DeepSpeed 0.19.8 pickles into its checkpoint files for ZeRO 0-3, bf16, CPU offload and the
# universal format (listed from real checkpoints the engine wrote; tests/test_checkpoint.py lists them again).
# Each is safe to call with any arguments: containers, tensor rebuilding from the file's own storages, and three
# plain DeepSpeed records (an enum, a dataclass, a loss-scale holder).
_DEEPSPEED_GLOBALS = {
    "collections.OrderedDict", "torch.Size", "torch.Tensor", "torch._utils._rebuild_tensor_v2",
    "torch._tensor._rebuild_from_type_v2", "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.utils.tensor_fragment.fragment_address",
} | {f"torch.{t}Storage" for t in ("Float", "BFloat16", "Half", "Double", "Long", "Int", "Short", "Char", "Byte", "Bool")}


class CheckpointDamaged(UserError):
    """A checkpoint that cannot be used; ``reason`` is the part after ``checkpoint <path>: ``."""

    def __init__(self, ckpt: Path, reason: str):
        super().__init__(f"checkpoint {ckpt}: {reason}")
        self.reason = reason


class RefusedPickle(Exception):
    """A pickle asked for a global outside the allow-list (``name`` is ``module.qualname``)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only allow-listed globals and torch dtypes."""

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as the global torch.<name>
        raise RefusedPickle(f"{module}.{name}")

    def persistent_load(self, pid):  # DCP metadata never uses persistent ids; tensor pickles do
        raise RefusedPickle("persistent id")


class _Inert:
    """What a vetted global stands for while vetting: accepts any construction and state, does nothing."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass


class _VettingUnpickler(pickle.Unpickler):
    """Walks a pickle as ``torch.load`` would, refusing any global outside ``_DEEPSPEED_GLOBALS``; runs nothing."""

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" in _DEEPSPEED_GLOBALS:
            return _Inert
        raise RefusedPickle(f"{module}.{name}")

    def persistent_load(self, pid):  # a tensor's storage: its bytes stay unread
        return _Inert()


def _relative(file: Path, ckpt: Path) -> str:
    return str(file.relative_to(ckpt)) if file.is_relative_to(ckpt) else str(file)


def vet_torch_file(file: Path, ckpt: Path) -> None:
    """CheckpointDamaged unless an unrestricted ``torch.load(file)`` would only rebuild allow-listed objects."""
    rel = _relative(file, ckpt)
    try:
        with open(file, "rb") as f:
            if not _is_zipfile(f):
                raise CheckpointDamaged(ckpt, f"{rel} is not a torch.save zip archive")
            with _open_zipfile_reader(f) as archive:
                if _is_torchscript_zip(archive):
                    raise CheckpointDamaged(ckpt, f"{rel} is a TorchScript archive (it would run code), refused")
                data = archive.get_record("data.pkl")
        _VettingUnpickler(io.BytesIO(data)).load()
    except RefusedPickle as exc:
        raise _refused(ckpt, rel, exc.name) from None
    except CheckpointDamaged:
        raise
    except Exception as exc:  # truncated or garbage: the zip reader and the unpickler raise all sorts
        raise CheckpointDamaged(ckpt, f"{rel} is unreadable ({type(exc).__name__}: {_first_line(exc)})") from None


def vet_deepspeed(ds_dir: Path, ckpt: Path) -> None:
    """Every file DeepSpeed may ``torch.load`` under ``ds_dir`` (all ``*.pt``, any depth) through ``vet_torch_file``."""
    for file in sorted(ds_dir.rglob("*.pt")):
        if not file.is_dir():
            vet_torch_file(file, ckpt)


def _refused(ckpt: Path, file: str, name: str) -> CheckpointDamaged:
    return CheckpointDamaged(ckpt, f"{file} contains a pickled object of type {name}, refused")


def read_metadata(state_dir: Path, ckpt: Path | None = None) -> Metadata:
    """``state_dir/.metadata`` through the allow-list; UserError if refused or unreadable."""
    ckpt = ckpt or state_dir.parent
    file = state_dir / ".metadata"
    rel = _relative(file, ckpt)
    try:
        with file.open("rb") as f:  # a Path, or a RemotePath (an object store)
            md = RestrictedUnpickler(f).load()
    except RefusedPickle as exc:
        raise _refused(ckpt, rel, exc.name) from None
    except FileNotFoundError:
        raise CheckpointDamaged(ckpt, f"{rel} is missing") from None
    except Exception as exc:  # truncated or garbage: the unpickler raises all sorts
        raise CheckpointDamaged(ckpt, f"{rel} is unreadable ({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointDamaged(ckpt, f"{rel} is not DCP metadata")
    return md


class _Preread:
    """A DCP reader whose metadata was already read (and vetted) by us."""

    def __init__(self, path, metadata: Metadata):
        super().__init__(path)
        self._vetted = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = self._vetted
        # What FileSystemReader.read_metadata does after unpickling, minus the unpickling.
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _PrereadReader(_Preread, FileSystemReader):
    pass


@functools.cache
def _preread_fsspec_reader() -> type:
    """``_Preread`` over DCP's fsspec reader, made on first use: only a run with an object store imports fsspec."""
    from treadle.checkpoint.remote import dcp_fsspec

    return type("_PrereadFsspecReader", (_Preread, dcp_fsspec().FsspecReader), {})


def _preread_reader(state_dir, metadata: Metadata):
    """The reader of ``state_dir``: on disk, or in an object store through DCP's fsspec reader."""
    if isinstance(state_dir, RemotePath):
        return _preread_fsspec_reader()(state_dir.url, metadata)
    return _PrereadReader(state_dir, metadata)


class _SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with non-tensor entries read by torch's weights-only unpickler."""

    def __init__(self, ckpt: Path):
        super().__init__()
        self._ckpt = ckpt

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _refused(self._ckpt, f"the state entry {fqn}", _global_named(exc)) from None
        # The same two ways DefaultLoadPlanner.load_bytes stores the value.
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _global_named(exc: Exception) -> str:
    # torch's weights-only error says e.g. "Unsupported global: GLOBAL posix.system was not an allowed global".
    m = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return m.group(1) if m else "(not allowed by torch.load(weights_only=True))"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def causes(exc: BaseException):
    """The exception, everything it was raised from or during, and what DCP wrapped per rank."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
        todo += [e.__cause__, e.__context__]


@contextlib.contextmanager
def loading(ckpt: Path):
    """Any failure inside becomes one UserError naming ``ckpt`` (ours and interrupts pass through unworded)."""
    try:
        yield
    except BaseException as exc:  # DCP wraps every rank's failure in CheckpointException (a BaseException)
        for cause in causes(exc):
            if isinstance(cause, (UserError, KeyboardInterrupt, SystemExit)):
                raise cause from None  # ours, or an interrupt: unwrap it, do not reword it
        root = next((c for c in causes(exc) if not isinstance(c, CheckpointException)), exc)
        raise UserError(f"checkpoint {ckpt} cannot be loaded: {type(root).__name__}: {_first_line(root)}") from None


def safe_dcp_load(state: dict, state_dir: Path, ckpt: Path, metadata: Metadata | None = None) -> None:
    """``dcp.load(state, state_dir)`` with every unpickling restricted (see the module docstring)."""
    md = metadata if metadata is not None else read_metadata(state_dir, ckpt)
    with loading(ckpt), quiet_single_process_dcp():
        dcp.load(state, storage_reader=_preread_reader(state_dir, md), planner=_SafePlanner(ckpt))
