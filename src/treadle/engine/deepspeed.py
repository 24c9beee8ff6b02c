"""DeepSpeed ZeRO 0/1/2/3 behind ``LocalEngine``'s interface.

The loop is unchanged; what differs is hidden here:

* The loop calls ``engine.model``, DeepSpeed's engine object; ``module`` is the model
  itself. ``optimizer`` is the torch AdamW the caller built: DeepSpeed keeps stepping
  the same param-group dicts (with its flat fp32 partitions as their params), so the
  loop's LambdaLR, which writes ``param_groups[i]["lr"]``, steers DeepSpeed's update.
* Gradients are SUMMED over ranks, not averaged, and not divided by the accumulation
  steps: the loop already divides each micro-batch's summed loss by the token count of
  the whole step on all ranks. ``backward`` passes ``scale_wrt_gas=False`` and multiplies
  the loss by the world size, which DeepSpeed's averaging divides out again (its
  ``gradient_allreduce_op: "sum"`` would do it too, but ZeRO-3 refuses it).
* Accumulation follows the boundary flag (``set_gradient_accumulation_boundary(last)``
  before every micro-batch), never DeepSpeed's micro-step counter. ZeRO 0/1 reduce
  once, at the boundary; ZeRO 2/3 reduce-scatter every micro-batch into this rank's
  gradient partition (that is how they avoid a full gradient per rank; DeepSpeed's
  ``no_sync`` refuses them).
* DeepSpeed clips inside its ``step`` at the config's ``gradient_clipping``, which is
  always written (0.19.8 clips at 1.0 unless told). ``clip_grad_norm`` measures the
  global norm with DeepSpeed's own routine for the optimizer in use, and ``step`` hands
  that value back to DeepSpeed instead of letting it measure again (``_Hooks``).
* A step the loop skips (non-finite loss or norm: ``zero_grad`` without ``step``) goes
  through DeepSpeed's own overflow skip, the one fp16 loss scaling uses: DeepSpeed
  clears its gradient partitions and counters itself, and counts the step in
  ``skipped_steps``. Plain fp32 ZeRO-0 has no such path: its gradients are just dropped.
* Checkpoints are DeepSpeed's (``checkpoint_format = "deepspeed"``), frozen parameters
  left out; a small JSON beside them records world size and stage, because ZeRO's
  optimizer partitions load only at the world size that wrote them.
* bf16: DeepSpeed keeps the module in bf16 and fp32 master weights in the optimizer;
  gradients accumulate in fp32 (``data_types.grad_accum_dtype``).
* Offload keeps the torch AdamW (``zero_force_ds_cpu_optimizer: false``): DeepSpeed's
  CPU Adam would be faster on large models but JIT-compiles a C++ op first (~40 s).

Every method that communicates (the collectives, ``clip_grad_norm``, ``step``,
``zero_grad``, ``save_checkpoint``, ``load_checkpoint``, ``export_state_dict``) must be
called on all ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from treadle.engine.local import CollectiveEngine
from treadle.errors import UserError

TAG = "state"  # the one DeepSpeed tag in a checkpoint directory: treadle names checkpoints itself
UNIVERSAL_TAG = f"{TAG}_universal"  # where the error message tells ds_to_universal to write
META = "treadle_deepspeed.json"

log = logging.getLogger(__name__)


def _merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``; nested dicts merge key by key instead of being replaced."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def deepspeed_config(*, zero_stage: int, micro_batch_size: int, grad_accum_steps: int, world_size: int,
                     grad_clip: float, bf16: bool, offload: bool = False, user_config: dict | None = None) -> dict:
    """The DeepSpeed config treadle generates; ``user_config``'s keys override it (deep merge)."""
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"distributed.zero_stage = {zero_stage}; accepted: 0, 1, 2, 3")
    if offload and zero_stage == 0:
        raise UserError("distributed.cpu_offload with deepspeed needs ZeRO: accepted: zero_stage 1-3 (optimizer "
                        "state offloaded; stage 3 also parameters), or cpu_offload = false")
    if bf16 and zero_stage == 0:
        raise UserError("model.dtype = bf16 with deepspeed needs zero_stage >= 1: DeepSpeed 0.19.8 accumulates "
                        "stage-0 bf16 gradients in bf16 and refuses fp32 accumulation there; accepted: zero_stage 1-3 "
                        "(stage 1 is DeepSpeed's bf16 optimizer), or model.dtype = fp32")
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "gradient_clipping": float(grad_clip),  # 0.0 = off; DeepSpeed's own default would clip at 1.0
        "zero_allow_untested_optimizer": True,  # the caller's torch AdamW
        "zero_force_ds_cpu_optimizer": False,  # keep it under offload too (no CPU Adam build)
        "steps_per_print": 2**31 - 1,  # treadle logs; DeepSpeed's progress lines would only repeat it
        "wall_clock_breakdown": False,
    }
    if bf16:  # fp32 master weights (DeepSpeed's bf16 default) and fp32 accumulation across micro-batches
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return _merge(config, user_config or {})


def _import_deepspeed(device: torch.device):
    """DeepSpeed, made to use ``device``'s accelerator, quiet, without its JIT-built shm allreduce, and joined to
    the process group treadle made."""
    # DeepSpeed picks its accelerator once, at import: on a CPU run on a GPU machine it would pick CUDA.
    os.environ.setdefault("DS_ACCELERATOR", device.type)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != device.type:
        raise RuntimeError(f"DeepSpeed was imported for {get_accelerator().device_name()}, but this run trains on "
                           f"{device.type}: set DS_ACCELERATOR={device.type} before anything imports deepspeed")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed 0.19.8 calls collectives torch 2.13 deprecates: one warning per kind and rank, about DeepSpeed's code.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                            r"is deprecated", category=FutureWarning)
    # The shared-memory allreduce is compiled with g++ on first use (~27 s, fails without a compiler);
    # gloo does the same reduction. Read once, when DeepSpeed wraps the process group.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # The group already exists (init_distributed): DeepSpeed wraps it and never looks for MPI.
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False,
                               dist_init_required=False)
    return deepspeed


def zero3_partitioner(config: dict, device: torch.device) -> Callable[[nn.Module], None]:
    """What ``sharded_load.materialize_by_module`` hands each module to under ZeRO-3: its new parameters become
    ZeRO-3 partitions (rank 0's values broadcast, each rank keeping its part), as ``deepspeed.initialize`` would
    convert them later, but one module at a time, so no rank ever holds the whole model."""
    deepspeed = _import_deepspeed(device)
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    def partition(module: nn.Module) -> None:
        new = [p for p in module.parameters() if not is_zero_param(p)]
        done = next((p for p in module.parameters() if is_zero_param(p)), None)
        if done is None:
            # memory_efficient_linear off: Init(module=...) would replace torch's F.linear for the whole process.
            deepspeed.zero.Init(module=module, config_dict_or_path=_merge(config, {"zero_optimization": {
                "memory_efficient_linear": False}}))
        elif new:
            done.convert_to_zero_parameters(param_list=new)  # the settings of the Init that made ``done``

    return partition


@contextlib.contextmanager
def _shadow(obj: Any, **attrs: Any) -> Iterator[None]:
    """Instance attributes that hide ``obj``'s own (a method, a flag) while the block runs."""
    saved = {name: obj.__dict__[name] for name in attrs if name in obj.__dict__}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name in attrs:
            if name in saved:
                setattr(obj, name, saved[name])
            else:
                delattr(obj, name)


class _Hooks:
    """How to measure the global gradient norm of the DeepSpeed optimizer in use, and make its step reuse a value.

    One subclass per optimizer DeepSpeed may wrap the torch optimizer in. ``reuse(norm)``
    makes DeepSpeed's step take ``norm`` for clipping; with an infinite norm the step
    becomes DeepSpeed's overflow skip instead (the gradients are discarded).
    """

    has_skip_path = True

    def __init__(self, ds_engine):
        self.ds = ds_engine
        self.opt = ds_engine.optimizer

    def norm(self) -> torch.Tensor:
        raise NotImplementedError

    def reuse(self, norm: torch.Tensor) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def skip(self) -> contextlib.AbstractContextManager:
        return self.reuse(torch.tensor(math.inf, device=self.ds.device))

    @staticmethod
    def for_engine(ds_engine) -> _Hooks:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        opt = ds_engine.optimizer
        for cls, hooks in ((DeepSpeedZeroOptimizer_Stage3, _Zero3Hooks), (DeepSpeedZeroOptimizer, _Zero12Hooks),
                           (BF16_Optimizer, _BF16Hooks), (torch.optim.Optimizer, _TorchHooks)):
            if isinstance(opt, cls):
                return hooks(ds_engine)
        raise NotImplementedError(f"DeepSpeed wrapped the optimizer in {type(opt).__name__}, which treadle does not "
                                  "know (fp16 is not supported: use bf16 or fp32)")


class _TorchHooks(_Hooks):
    """fp32 ZeRO-0: DeepSpeed steps the torch optimizer itself; every rank holds the full reduced gradient."""

    has_skip_path = False  # no overflow path: a skipped step is dropped gradients and nothing else

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.ds.module.parameters() if p.grad is not None]

    def norm(self) -> torch.Tensor:
        return get_total_norm([p.grad for p in self._params()], foreach=True)

    def reuse(self, norm):
        clip = self.ds.gradient_clipping()
        return _shadow(self.ds, clip_fp32_gradients=lambda: clip_grads_with_norm_(self._params(), clip, norm,
                                                                                 foreach=True))


class _BF16Hooks(_Hooks):
    """bf16 ZeRO-0/1: BF16_Optimizer accumulates full fp32 gradients (reduced at the boundary) beside the bf16 module."""

    def norm(self):
        from deepspeed.runtime.utils import get_global_norm_of_tensors

        grads, _experts = self.opt.get_grads_for_norm()
        return get_global_norm_of_tensors(grads, mpu=self.opt.mpu, norm_type=self.opt.norm_type)

    def reuse(self, norm):
        # Its step measures the norm of what get_grads_for_norm() returns: the norm of [norm] is norm.
        grads_for_norm = type(self.opt).get_grads_for_norm.__get__(self.opt)
        return _shadow(self.opt, get_grads_for_norm=lambda for_clipping=False: (
            grads_for_norm(for_clipping=True) if for_clipping else ([norm.reshape(1)], {})))


class _Zero12Hooks(_Hooks):
    """ZeRO-1/2: each rank holds the reduced gradient of its partition (``averaged_gradients`` or the CPU copy)."""

    def norm(self):
        return self.opt.scaled_global_norm()  # loss scale 1 (no fp16): the true norm

    def reuse(self, norm):
        return _shadow(self.opt, scaled_global_norm=lambda norm_type=2: norm)

    def skip(self):
        # A bf16 ZeRO-1/2 step ignores an invalid norm unless overflow checking is on; force the overflow instead.
        return _shadow(self.opt, check_grad_overflow=True,
                       check_overflow=lambda partition_gradients=True: setattr(self.opt, "overflow", True))


class _Zero3Hooks(_Hooks):
    """ZeRO-3: gradient partitions per sub-group; the step combines their norms (an invalid one means overflow)."""

    def norm(self):
        from deepspeed.runtime.utils import combine_grad_norm_groups

        return combine_grad_norm_groups(self.opt._get_norm_groups())

    def reuse(self, norm):
        return _shadow(self.opt, _get_norm_groups=lambda: [norm])


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


# Where DeepSpeed's optimizers keep fp32 master weights and gradient buffers (absent ones are skipped).
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")
_GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "accumulated_grads_in_cpu",
               "grad_partitions_flat_buffer", "fp32_groups_gradients_flat")


class DeepSpeedEngine(CollectiveEngine):
    checkpoint_format = "deepspeed"  # save_checkpoint / load_checkpoint, not DCP over state_dict()

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *, zero_stage: int,
                 micro_batch_size: int, grad_accum_steps: int, grad_clip: float, bf16: bool, offload: bool = False,
                 user_config: dict | None = None):
        """Wrap ``model`` (fp32, identical on every rank) and ``optimizer`` (a torch optimizer over its trainable params).
        """
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedEngine needs a process group: call treadle.distributed.init_distributed() first")
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.config = deepspeed_config(zero_stage=zero_stage, micro_batch_size=micro_batch_size,
                                       grad_accum_steps=grad_accum_steps, world_size=self.world_size,
                                       grad_clip=grad_clip, bf16=bf16, offload=offload, user_config=user_config)
        if self.config["gradient_clipping"] != float(grad_clip):
            raise UserError(f"distributed.deepspeed_config sets gradient_clipping = {self.config['gradient_clipping']}, "
                            f"but train.grad_clip = {grad_clip}; accepted: leave gradient_clipping out (treadle writes "
                            "train.grad_clip there)")
        deepspeed = _import_deepspeed(device)
        # BF16_Optimizer print()s memory usage while it builds (force=True, past DeepSpeed's logger).
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            self.model, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                                       dist_init_required=False)
        log.debug("deepspeed.initialize printed: %s", printed.getvalue())
        self.module = self.model.module
        self.optimizer = optimizer
        self.zero_stage = self.model.zero_optimization_stage()
        self.bf16 = self.model.bfloat16_enabled()
        self._hooks = _Hooks.for_engine(self.model)
        self._norm: torch.Tensor | None = None  # measured by clip_grad_norm, reused by step
        self._pending = False  # gradients accumulated since the last step or zero_grad

    # ------------------------------------------------------------------ the step

    @contextlib.contextmanager
    def no_sync(self, last: bool) -> Iterator[None]:
        # Set before the forward: ZeRO-3 and the backward hooks read it as they go.
        self.model.set_gradient_accumulation_boundary(last)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        self._pending = True
        self._norm = None
        # The loss is already this rank's share of the step's global mean: no division by the accumulation
        # steps, and the world-size factor cancels DeepSpeed's average over ranks (the shares must add up).
        self.model.backward(loss * self.loss_multiplier, scale_wrt_gas=False)

    @property
    def loss_multiplier(self) -> int:
        return self.world_size

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global pre-clip norm (equal on every rank); DeepSpeed clips at ``max_norm`` during ``step``."""
        if max_norm != self.model.gradient_clipping():
            raise ValueError(f"clip_grad_norm({max_norm}) but DeepSpeed clips at gradient_clipping = "
                             f"{self.model.gradient_clipping()} (its config, fixed when the engine was built)")
        norm = self._hooks.norm().detach().float()
        # DeepSpeed reports a non-finite norm as -1 in places; the loop must see it as non-finite.
        self._norm = torch.where(norm < 0, torch.full_like(norm, math.inf), norm)
        return self._norm

    def step(self) -> None:
        norm = self._norm if self._norm is not None else self._hooks.norm()
        with self._hooks.reuse(norm):
            self.model.step()
        self._norm = None
        self._pending = False

    def zero_grad(self) -> None:
        if self._pending:
            # Gradients the loop decided not to apply. DeepSpeed's zero_grad() only drops the module's
            # .grad: ZeRO-3's partitions, bf16's fp32 accumulators and offloaded copies would carry them
            # into the next step. Its overflow skip clears all of that and resets its micro-step counters.
            self.model.set_gradient_accumulation_boundary(True)
            if self._hooks.has_skip_path:
                with self._hooks.skip():
                    self.model.step()
            self._pending = False
            self._norm = None
        self.model.zero_grad()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        raise NotImplementedError("the DeepSpeed engine checkpoints with save_checkpoint(), not DCP")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("the DeepSpeed engine restores with load_checkpoint(), not DCP")

    def save_checkpoint(self, directory: Path) -> None:
        """DeepSpeed's checkpoint of module and optimizer (frozen parameters left out) under ``directory``."""
        directory = Path(directory)
        self.model.save_checkpoint(str(directory), tag=TAG, exclude_frozen_parameters=True)
        if self.rank == 0:
            meta = {"world_size": self.world_size, "zero_stage": self.zero_stage, "bf16": self.bf16,
                    "partitioned": self._partitioned()}
            (directory / META).write_text(json.dumps(meta) + "\n")
        dist.barrier()  # complete on every rank when this returns

    def _partitioned(self) -> bool:
        """Whether the optimizer state is split per rank (only fp32 ZeRO-0 keeps one whole copy)."""
        return not isinstance(self._hooks, _TorchHooks)

    def load_checkpoint(self, directory: Path) -> None:
        """Restore module and optimizer from ``save_checkpoint``'s directory (frozen parameters keep their values).

        DeepSpeed unpickles its files without the weights-only restriction: the caller vets them first
        (``treadle.checkpoint.validate.inspect``, which every resume goes through).
        """
        directory = Path(directory)
        universal = self.model.load_universal_checkpoint()
        if not universal:
            check_resumable(directory, self.world_size, self.zero_stage)
        path, _ = self.model.load_checkpoint(str(directory), tag=UNIVERSAL_TAG if universal else TAG,
                                             load_module_strict=False, load_optimizer_states=True,
                                             load_lr_scheduler_states=False, custom_load_fn=_load_trainable)
        if path is None:
            raise UserError(f"{directory} holds no DeepSpeed checkpoint tagged {TAG!r}")
        self._pending, self._norm = False, None

    # ------------------------------------------------------------------ export and accounting

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights as CPU tensors of their own on rank 0 (frozen ones included), ``{}`` elsewhere.

        Trainable weights are the fp32 masters; under bf16 a frozen weight is its bf16 copy
        (DeepSpeed casts the whole module at initialize: the frozen fp32 values are gone).
        """
        if self.zero_stage == 3:
            state = self.model._zero3_consolidated_16bit_state_dict()  # gathered layer by layer; None off rank 0
        else:
            state = self.module.state_dict() if self.rank == 0 else None
        if self.bf16:  # the module holds bf16 copies; the fp32 masters live in the optimizer's partitions
            for name, p in self.module.named_parameters():
                if p.requires_grad:
                    full = self._full_master(p)  # a collective: every rank, same order
                    if self.rank == 0:
                        state[name] = full
        if self.rank != 0:
            return {}
        # Copies: the module's tensors are views into DeepSpeed's flat buffers (safetensors refuses shared storage).
        return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                for k, v in state.items()}

    def _full_master(self, p: nn.Parameter) -> torch.Tensor:
        """The whole fp32 master of parameter ``p``, on every rank."""
        if hasattr(p, "ds_id"):  # ZeRO-3: every rank knows every parameter
            return p._z3_optimizer.get_full_hp_param(p)
        # ZeRO-1/2 and BF16_Optimizer: a rank without a fragment of p has no _hp_mapping at all, and
        # DeepSpeed's safe_get_full_fp32_param then skips the all-reduce the other ranks wait in.
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            address = mapping.lp_fragment_address
            full.narrow(0, address.start, address.numel).copy_(mapping.get_hp_fragment())
        dist.all_reduce(full)
        return full.view(p.shape)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state, as DeepSpeed holds them.

        Each storage is counted once, in the first of these that reaches it: ``params`` are
        the weights forward runs on (the whole module, or under ZeRO-3 this rank's partitions
        plus whatever is gathered at the moment); ``grads`` every gradient buffer (module
        gradients, DeepSpeed's partition buffers and fp32 accumulators); ``optim`` the
        optimizer's moments plus DeepSpeed's fp32 master partitions, which exist only for
        the optimizer (fp32 ZeRO-0 has none: its master weights are the parameters). Host
        and device memory count alike (offload moves bytes, it does not remove them).
        Gradients exist from the first backward of a step to its ``step``, except ZeRO-3's
        partition buffer and bf16's accumulators, which are allocated once. Under ZeRO-3,
        parameters below ``stage3_param_persistence_threshold`` elements (1e5 by default)
        stay gathered on every rank and count whole: a small model needs it at 0 to halve.
        """
        seen: set[int] = set()

        def nbytes(tensors: Iterable[torch.Tensor]) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if t.numel() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        opt = self.model.optimizer
        params = list(self.module.parameters())
        masters = [t for name in _MASTER_ATTRS for t in _tensors(getattr(opt, name, None))]
        masters += [p for g in self.optimizer.param_groups for p in g["params"]]
        report = {"params": nbytes([p.data for p in params] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")])}
        grads = [p.grad for p in params + masters if p.grad is not None]
        grads += [p.grad_accum for p in params if getattr(p, "grad_accum", None) is not None]  # ZeRO-1/2
        grads += [t for name in _GRAD_ATTRS for t in _tensors(getattr(opt, name, None))]
        report["grads"] = nbytes(grads)
        moments = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        report["optim"] = nbytes(masters + moments)
        return report


_META_TYPES = {"world_size": int, "zero_stage": int, "bf16": bool, "partitioned": bool}


def meta_problem(directory: Path) -> str | None:
    """What is wrong with ``save_checkpoint``'s record beside DeepSpeed's files (``META``), or None."""
    try:
        meta = json.loads((Path(directory) / META).read_text())
    except FileNotFoundError:
        return f"{META} is missing"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{META} is not valid JSON ({str(exc).splitlines()[0]})"
    if not isinstance(meta, dict) or any(type(meta.get(k)) is not t for k, t in _META_TYPES.items()):
        return f"{META} is not what treadle writes (accepted: a JSON object with {', '.join(_META_TYPES)})"
    return None


def _read_meta(directory: Path) -> dict:
    """What ``save_checkpoint`` recorded beside DeepSpeed's files (world size, stage, partitioned)."""
    problem = meta_problem(directory)
    if problem is not None:
        raise UserError(f"{directory} is not a treadle DeepSpeed checkpoint: {problem}")
    return json.loads((Path(directory) / META).read_text())


def check_resumable(directory: Path, world_size: int, zero_stage: int) -> None:
    """A one-line UserError unless an engine at ``world_size`` / ``zero_stage`` can load ``directory`` as it is."""
    directory = Path(directory)
    meta = _read_meta(directory)
    saved, stage = meta["world_size"], meta["zero_stage"]
    if meta["partitioned"] and (saved, stage) != (world_size, zero_stage):
        raise UserError(
            f"checkpoint {directory} holds DeepSpeed ZeRO-{stage} state partitioned over world size {saved}, but this "
            f"run has world size {world_size} and ZeRO-{zero_stage}; accepted: the same world size and zero_stage, or "
            f"DeepSpeed's universal checkpoint: {universal_command(directory)}, then resume with "
            f'{{"checkpoint": {{"load_universal": true}}}} in distributed.deepspeed_config')


def universal_command(directory: Path) -> str:
    """The conversion of a checkpoint directory to DeepSpeed's universal format, where load_checkpoint looks for it."""
    # treadle saves no Megatron-style universal_checkpoint_info: the converter must inject the minimal one.
    return (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {Path(directory) / TAG} "
            f"--output_folder {Path(directory) / UNIVERSAL_TAG} --inject_missing_state")


def _load_trainable(src: dict, dst: nn.Module) -> None:
    """DeepSpeed's module loading, strict for trainable parameters only (frozen ones were never saved)."""
    frozen = {name for name, p in dst.named_parameters() if not p.requires_grad}
    result = dst.load_state_dict({k: v for k, v in src.items() if k not in frozen}, strict=False)
    missing = sorted(set(result.missing_keys) - frozen)
    if missing or result.unexpected_keys:
        raise UserError(f"the DeepSpeed checkpoint does not fit this model: missing trainable {missing[:5]}, "
                        f"unexpected {sorted(result.unexpected_keys)[:5]}; accepted: a checkpoint of the same "
                        "model and the same frozen/trainable split")


def checkpoint_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights a DeepSpeed checkpoint holds (frozen ones were never saved), without a process group.

    For ``treadle export``: ZeRO 1-3 keep the fp32 masters in per-rank partitions, which
    DeepSpeed's ``zero_to_fp32`` reassembles (it unpickles without restriction: the
    caller vets the files first, ``treadle.checkpoint.validate.inspect``); fp32 ZeRO-0 saved
    the module whole, read here weights-only.
    """
    directory = Path(directory)
    meta = _read_meta(directory)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if meta["partitioned"]:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()):  # it prints progress
            state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG, exclude_frozen_parameters=True)
    else:
        files = sorted((directory / TAG).glob("*model_states.pt"))
        if not files:
            raise UserError(f"{directory / TAG} holds no model_states.pt; accepted: a DeepSpeed checkpoint treadle wrote")
        state = torch.load(files[0], map_location="cpu", weights_only=True)["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
