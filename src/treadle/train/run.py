"""Assemble a run from a ``Config``: data, model, engine, schedule, callbacks; then fit.

All input is validated before the run directory is touched, so a bad flag or a
missing shard never damages an earlier run that lives there.
"""

from __future__ import annotations

import contextlib
import datetime
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from pydantic import ValidationError

from treadle import distributed
from treadle.checkpoint.export import claim_export
from treadle.checkpoint.manager import CheckpointManager
from treadle.checkpoint.remote import RemotePath
from treadle.checkpoint.remote_manager import RemoteCheckpointManager
from treadle.checkpoint.validate import run_state
from treadle.config import Config, _explain, explicit_tree, parse_duration
from treadle.data.loader import StepLoader, check_token_ids, eval_batches
from treadle.data.packed import IGNORE_INDEX
from treadle.distributed import init_distributed
from treadle.engine import build_engine, builds_empty, read_deepspeed_config, resolve_engine
from treadle.engine.context_parallel import apply_context_parallel, check_model, split_model_config
from treadle.engine.mesh import build_mesh
from treadle.engine.tensor_parallel import check_model as check_tensor_parallel
from treadle.engine.tensor_parallel import check_target as check_tensor_parallel_target
from treadle.engine.pipeline import plan_stages
from treadle.errors import UserError
from treadle.metrics.flops import (attention_dims, forward_flops_per_token, matmul_parameters, peak_tflops,
                                   train_flops_per_token)
from treadle.metrics.sinks import Console, JsonlSink, Sinks, check_sinks_installed, open_optional_sinks
from treadle.models.chunked_ce import resolve_chunk_tokens, use_chunked_loss
from treadle.models.checkpointing import apply_activation_checkpointing
from treadle.models.fp8 import apply_fp8
from treadle.models import attention
from treadle.models.hf import (build_model, compile_layers, count_parameters, from_scratch_line, persistent_compile_cache,
                               trainable_parameters, vocabulary_fit)
from treadle.train.cotrain import BesideExportCallback, beside_setup
from treadle.train.callbacks import (AdapterExportCallback, Callback, CheckpointCallback, EvalCallback, ExportCallback,
                                    MetricsCallback)
from treadle.drafts.features.run import attach_store, refuse_unstorable
from treadle.drafts.registry import build_draft, kind
from treadle.train.adapters import describe_adapters, draft_lora_adapters, lora_adapters
from treadle.models.lora import quantized_compute_dtype
from treadle.train.auto import resolve_auto
from treadle.train.draft import AcceptanceCallback, DraftExportCallback, TTTAccuracyCallback, eval_prompts
from treadle.train.moe import ExpertLoadCallback, RouterObjective, refuse_router_keys, router_objective
from treadle.engine.optim import build_schedule
from treadle.train.resilience import (FaultInjectionCallback, HealthCheckCallback, NanGuardCallback, ShutdownWatcher,
                                      elastic_callbacks)
from treadle.train.profiling import ProfilerCallback
from treadle.train.run_data import RunData, check_shard_token_ids, open_data
from treadle.train.rundir import (
    check_checkpoint_owner,
    check_output_dir,
    check_resume,
    checkpoint_dir,
    claim_checkpoint_dir,
    prepare_output_dir,
    save_run_config,
)
from treadle.train.step import loss_sum
from treadle.train.trainer import Trainer
from treadle.train.user_callbacks import load_callbacks
from treadle.tokenizer import RunTokenizer


@dataclass
class RunSummary:
    output_dir: Path
    steps: int
    first_loss: float | None
    last_loss: float | None
    first_eval: dict | None
    last_eval: dict | None
    tokens: int
    tokens_per_s: float
    elapsed_s: float
    checkpoints: list[Path]
    export_dir: Path | None
    parameters: int  # trainable
    stop_reason: str | None
    acceptance: tuple[dict | None, dict | None] | None = None  # a draft run: first and last tau_sim records
    # What each figure is and what it is summed and averaged over (every loss is a sum divided by label tokens).
    loss_label: str = "cross-entropy per label token"  # the train loss (a draft's objective: KL, CE or a mix)
    eval_loss_label: str = "cross-entropy per label token"  # the eval loss
    rank: int = 0  # the process that returns it (every rank of a launch gets one)
    finished_before: bool = False  # the run had finished already: nothing ran (the CLI prints no summary)
    draft_dir: Path | None = None  # a draft trained beside the model (draft.target = 'self'): its export


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Notes:
    """Lines about the model the run prints after its start line, on rank 0: ``always`` on every start, ``fresh``
    on a fresh start only (what a resumed run's checkpoint makes untrue, such as "random weights")."""

    always: list[str | None]  # None: nothing to say
    fresh: list[str | None]

    def lines(self, resumed: bool) -> list[str]:
        return [line for line in self.always + ([] if resumed else self.fresh) if line]


@dataclass
class ModelSetup:
    """What the kind of run decides: the module trained, its loss, its evals and its export."""

    model: torch.nn.Module
    vocab_size: int  # the embedding's rows: every token id must be below it (a draft's: its target's)
    loss_fn: Callable
    eval_loss_fn: Callable | None
    eval_callbacks: list[Callback]
    export: ExportCallback | DraftExportCallback
    step_callbacks: list[Callback] = field(default_factory=list)  # before the metrics callback: add to the step's metrics
    notes: Notes = field(default_factory=lambda: Notes([], []))

    def describe(self) -> str:
        trainable = trainable_parameters(self.model)
        frozen = count_parameters(self.model) - trainable
        origin = getattr(self.model, "origin", None)  # a draft's starting weights, where its kind says
        return (f"{trainable / 1e6:.1f}M trainable parameters" + (f" ({frozen / 1e6:.1f}M frozen)" if frozen else "")
                + (f", {origin}" if origin else ""))


def _model_setup(cfg: Config, data: RunData, meta: dict, empty: bool) -> ModelSetup:
    tokenizer = RunTokenizer.from_meta(meta)
    model = build_model(cfg.model, meta["vocab_size"], empty=empty, tokenizer=tokenizer)
    check_shard_token_ids(data, model.config.vocab_size)  # model.overrides may set it, model.path brings its own
    adapters = None
    if cfg.lora.rank is not None:  # before the chunked head replaces lm_head (a modules_to_save head stays unchunked)
        adapters = lora_adapters(cfg, model, meta)
        model = adapters.model
    # build_model refused a vocabulary below the tokenizer's; one far larger is a warning, printed on every start
    vocabulary = vocabulary_fit(model.config.vocab_size, tokenizer, cfg.model)
    chunk = resolve_chunk_tokens(cfg.model.loss_chunk_tokens, model.config.vocab_size)
    if cfg.distributed.tensor_parallel > 1:  # the loss runs on vocabulary shards instead (config refuses a number)
        chunk = 0
    if cfg.distributed.pipeline_parallel > 1 and chunk:  # the last stage returns logits to the schedule's loss
        if cfg.model.loss_chunk_tokens != "auto":
            raise UserError(f"model.loss_chunk_tokens = {cfg.model.loss_chunk_tokens} with "
                            "distributed.pipeline_parallel > 1: the chunked loss is not built into pipeline stages yet; "
                            "accepted: loss_chunk_tokens = 0 or auto (off with pipelines)")
        chunk = 0
    if chunk:  # before any engine wraps the model: the head is replaced in place (loss_sum finds it)
        use_chunked_loss(model, chunk, IGNORE_INDEX, explicit=cfg.model.loss_chunk_tokens != "auto")
    if adapters is None:
        export = ExportCallback(Path(cfg.train.output_dir) / "hf", data.tokenizer_dir, meta.get("chat_template"))
    else:
        export = AdapterExportCallback(Path(cfg.train.output_dir) / "adapter", adapters, cfg.lora.base_name)
    objective = router_objective(model, cfg.model)
    notes = Notes(always=[vocabulary, describe_adapters(adapters)], fresh=[from_scratch_line(cfg.model)])
    if objective is None:
        return ModelSetup(model, model.config.vocab_size, loss_sum, None, [], export, notes=notes)
    return ModelSetup(model, model.config.vocab_size, objective, objective.evaluate, [], export,
                      step_callbacks=[ExpertLoadCallback(objective, cfg.train.log_every)], notes=notes)






def _draft_setup(cfg: Config, data: RunData, meta: dict, empty: bool) -> ModelSetup:
    """A frozen target and a trainable draft; the rest of the run is unchanged."""
    train_ds, val_ds = data.train, data.val
    refuse_router_keys(cfg.model, f"a draft run trains a {cfg.draft.kind} draft, which has no experts")
    if cfg.draft.features:
        refuse_unstorable(cfg, "draft.features")
    model, target_dir, identity = build_draft(cfg.draft, train_ds.vocab_size, train_ds.tokenizer_fingerprint, empty)
    check_shard_token_ids(data, model.target.config.vocab_size)  # before eval prompts are cut from the data
    meta["target_fingerprint"] = identity["config_fingerprint"]
    # Adapters on the trained draft of draft.init (frozen, as the target), before the objective holds its modules.
    adapters = draft_lora_adapters(cfg, model, meta) if cfg.lora.rank is not None else None
    objective = kind(cfg.draft.kind).setup(cfg, model, [o.dataset for o in data.sources])
    if cfg.draft.features:  # the store's windows, with the target's reads, stand in for the data's
        data.sources[0].dataset, data.val = attach_store(cfg, model, target_dir, identity, train_ds, val_ds)
    # acc_k from the objective's ttt_hits_k / ttt_rows_k: does nothing for an objective that reports none (no unroll)
    step_callbacks = [TTTAccuracyCallback()]
    prompts = eval_prompts(val_ds or train_ds, cfg.draft.eval_prompts, cfg.draft.eval_prompt_len)
    check_token_ids(prompts, model.target.config.vocab_size, lambda: f"the draft's eval prompts ({(val_ds or train_ds).where})")
    out = Path(cfg.train.output_dir) / "draft"
    export = (DraftExportCallback(out, target_dir, identity, cfg.draft) if adapters is None
              else AdapterExportCallback(Path(cfg.train.output_dir) / "adapter", adapters, cfg.lora.base_name))
    # tau_sim needs the target's greedy texts and its reads on them: the live target's, or a treadle store's.
    acceptance = [AcceptanceCallback(cfg.draft, prompts, cfg.train.eval_every, cfg.train.eval_at_start)]
    return ModelSetup(model, model.target.config.vocab_size, objective, objective.evaluate,
                      acceptance if model.live or model.stored is not None else [],
                      export, step_callbacks=step_callbacks, notes=Notes([describe_adapters(adapters)], []))




def choose_attention(cfg: Config, model: torch.nn.Module, device: torch.device, cp: int) -> list[str]:
    """``model.attention`` resolved and applied to the model that reads the packed rows (a draft run's target, and
    then the draft's own masks: BlockMasks on CUDA); the line that says what ``auto`` chose."""
    reader = model.target if cfg.draft.frozen_target else model
    if reader is None:  # a draft trained from a store: no target runs
        return []
    choice, why = attention.resolve(cfg.model.attention, reader.config, device, cfg.data.seq_len, cp)
    attention.use(reader, choice)
    if cfg.draft.frozen_target:  # the draft's own masks as FlexAttention BlockMasks where flex trains (drafts/masks.py)
        model.flex_masks = choice in attention.NAMES and device.type == "cuda"
    return [f"treadle: model.attention = auto -> {choice}: {why}"] if cfg.model.attention == "auto" else []


def model_flops_per_token(model: torch.nn.Module, seq_len: int, draft: bool) -> float:
    """FLOPs one trained token costs (metrics/flops.py). A draft run: the draft block trained (two attentions: its
    own and the cross-attention into the target's K/V), the target's head it scores through (frozen: no weight
    gradient, 4 per parameter, not 6), and the frozen target's forward."""
    if not draft:
        return train_flops_per_token(matmul_parameters(model), *attention_dims(model.config), seq_len)
    target = model.target
    _, heads, head_dim = attention_dims(target.config)
    head = target.get_output_embeddings().weight
    return (train_flops_per_token(matmul_parameters(model.draft_model), 2, heads, head_dim, seq_len)
            + 4.0 * float(getattr(head, "ds_numel", 0) or head.numel())
            + forward_flops_per_token(matmul_parameters(target), *attention_dims(target.config), seq_len))


def refuse_sliced_load_balancing(loss_fn, cp: int) -> None:
    """An MoE's load-balancing loss is a product of two means over a micro-batch, not a token sum: on a slice of
    every sequence it would be another loss than one process's (the z-loss is a token sum and stays exact)."""
    if isinstance(loss_fn, RouterObjective) and loss_fn.aux_coef:
        raise UserError(f"distributed.context_parallel = {cp} with an MoE load-balancing loss (model.router_aux_loss_coef "
                        f"= {loss_fn.aux_coef:g}, the model's own when unset): it would be computed per sequence slice; "
                        "accepted: model.router_aux_loss_coef = 0, or context_parallel = 1")


def checked_config(cfg: Config) -> Config:
    """The whole config validated again, cross-field rules included, as ``load_config`` would.

    Assigning to a section (``cfg.train.max_steps = 3``) re-validates that field only, not Config's rules across
    sections: a config built or edited in Python is checked here, where every run starts. Each section is
    rebuilt from the fields that were set, so the rules that ask what was set (data.train beside data.sources)
    see what the user set.
    """
    if not isinstance(cfg, Config):
        raise UserError(f"a run needs a treadle Config, got {type(cfg).__name__}; accepted: treadle.Config or load_config(...)")
    try:
        return Config.model_validate(explicit_tree(cfg))
    except ValidationError as err:
        raise _explain(err, "") from None


def _treadle_callback_names(cls: type = Callback) -> set[str]:
    """Class names of treadle's own callbacks (every subclass defined in a treadle module, at any depth)."""
    return {c.__name__ for c in cls.__subclasses__() if c.__module__.startswith("treadle.")} | {
        n for c in cls.__subclasses__() for n in _treadle_callback_names(c)}


def _check_user_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    """User callbacks are Callback instances with their own class names: a checkpoint keeps each callback's
    state under its class name, so a name taken twice would hand one callback the other's state on resume."""
    taken = _treadle_callback_names()
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise UserError(f"callbacks: {cb!r} is not a treadle Callback; accepted: instances of subclasses of "
                            "treadle.Callback")
        name = type(cb).__name__
        if name in taken:
            raise UserError(f"callbacks: two callbacks of a run are named {name} (a checkpoint keeps callback state "
                            "by class name); accepted: one callback per class name, none named like treadle's own")
        taken.add(name)
    return list(callbacks)


def build_trainer(cfg: Config, live: bool | None = None, callbacks: Sequence[Callback] = ()) -> Trainer:
    """Everything a run needs, validated and resumed if there is a checkpoint; nothing trained yet.

    Under a launcher (torchrun, deepspeed) every rank runs this; the process group is joined
    first, and what one process must do alone (the run directory, metrics, the console, the
    checkpoint's finalization) is rank 0's. ``callbacks`` (``Callback`` instances) run after
    treadle's evaluation callbacks and before its checkpoint: they see the step's eval metrics,
    and the checkpoint of a step holds their state after that step (``state_dict``).

    If anything raises, what was opened is closed again (a process group this call joined, the
    prefetch thread, the metrics file, a checkpoint write); on success the trainer owns them:
    ``fit`` closes the loader and the checkpoint writer, ``close_trainer`` the rest.
    """
    cfg = checked_config(cfg)  # before anything is opened or written
    check_sinks_installed(cfg.metrics.sinks)
    callbacks = _check_user_callbacks([*load_callbacks(cfg.callbacks), *callbacks])
    with contextlib.ExitStack() as opened:
        if not torch.distributed.is_initialized():
            opened.callback(distributed.destroy)
        trainer = _assemble(cfg, live, callbacks, opened)
        opened.pop_all()
    return trainer


def close_trainer(trainer: Trainer) -> None:
    """Close what a trainer holds; safe to call twice, and after ``fit`` (which closes loader and checkpoints)."""
    try:
        trainer.checkpoints.join()
        trainer.loader.close()
    finally:
        trainer.metrics.close()


def _resume_step(ckpt: Path | None) -> int:
    """The step a resume continues from (0: a fresh start), for what counts the steps left; a damaged checkpoint
    reads 0 here and is refused by check_resume, with its other refusals in their order."""
    if ckpt is None:
        return 0
    try:
        return run_state(ckpt)["train"]["step"]
    except UserError:
        return 0


def _assemble(cfg: Config, live: bool | None, user_callbacks: Sequence[Callback], opened: contextlib.ExitStack) -> Trainer:
    d = cfg.distributed
    info = init_distributed(cfg.train.device, num_threads=cfg.train.threads or None,
                            timeout=datetime.timedelta(seconds=d.timeout_s))
    engine_name = resolve_engine(d.engine, info, d.pipeline_parallel, draft=cfg.draft.frozen_target)
    mesh = build_mesh(d, info)  # every axis; one line when their product does not fit the launch
    layout = mesh.layout  # data-parallel x context ranks
    elastic = elastic_callbacks(cfg, info.rank, info.world_size)  # torchrun restarts; a drill's keys checked now
    deepspeed_json = read_deepspeed_config(d.deepspeed_config) if engine_name == "deepspeed" else None
    device, main = info.device, info.is_main
    seq_len = cfg.data.seq_len
    out = Path(cfg.train.output_dir)
    distributed.on_main(check_output_dir, out)  # a user's directory is refused before anything else
    ckpt_dir = checkpoint_dir(cfg, engine_name)  # an object store: reachable, writable (one line if not)
    distributed.on_main(check_checkpoint_owner, cfg, ckpt_dir)  # another run's: refused before recover() clears
    # Rank 0 tokenizes data files into the cache; the others then find them there.
    data = distributed.on_main(open_data, cfg) or open_data(cfg)
    train_ds, val_ds, tokenizer_dir = data.train, data.val, data.tokenizer_dir

    manager = RemoteCheckpointManager if isinstance(ckpt_dir, RemotePath) else CheckpointManager
    checkpoints = manager(ckpt_dir, cfg.checkpoint.keep_last, info.rank, world_size=info.world_size,
                          async_save=cfg.checkpoint.async_save, best_metric=cfg.checkpoint.best_metric,
                          best_mode=cfg.checkpoint.best_mode)
    opened.callback(checkpoints.join)  # a rollback below may write
    # One choice for all ranks: on_main returns the result on rank 0 only (the others would not load it).
    resume_from = distributed.broadcast_object(distributed.on_main(checkpoints.find_resume, cfg.checkpoint.resume))

    seed_everything(cfg.train.seed)
    meta = {"vocab_size": train_ds.vocab_size, "eos_id": train_ds.meta.get("eos_id"),
            "tokenizer_dir": str(tokenizer_dir) if tokenizer_dir else None, "tokenizer_fingerprint": train_ds.tokenizer_fingerprint,
            "chat_template": data.chat_template}  # `treadle export` of a checkpoint gives it to the tokenizer too
    # A model read from disk is built as the engine wants it: empty (FSDP2 reads each rank's shards once it has
    # sharded it, ZeRO-3 reads and partitions it module by module), or whole.
    empty = builds_empty(engine_name, cfg, info.world_size, deepspeed_json)
    setup = (_draft_setup if cfg.draft.frozen_target else _model_setup)(cfg, data, meta, empty)
    if cfg.draft.beside:  # a draft trained beside the model, in its step (train/cotrain.py)
        setup = beside_setup(cfg, setup, data, device, checkpoints)
    train_ds, val_ds = data.train, data.val  # a store-backed draft run's: the store's windows (draft.features)
    if d.pipeline_parallel > 1 and setup.loss_fn is not loss_sum:  # the last stage computes a plain cross-entropy
        raise UserError("distributed.pipeline_parallel > 1 is not supported for mixture-of-experts models (their "
                        "router losses come from every stage); accepted: pipeline_parallel = 1")
    if d.pipeline_parallel > 1:  # the layer split, before anything is written (the engine splits it later)
        plan_stages(setup.model, d.pipeline_parallel, d.pipeline_schedule)
    # model.dtype / compile = auto -> what runs fastest here, before check_resume compares and config.toml records it
    cfg, auto_lines, step_time_check = resolve_auto(cfg, setup.model, engine_name, device, _resume_step(resume_from))
    auto_lines += choose_attention(cfg, setup.model, device, layout.cp_size)
    if cfg.model.dtype == "fp8":  # a model transform: before checkpointing wraps layers, compile and the engine
        auto_lines.append(apply_fp8(setup.model, cfg.model.fp8_recipe))
    if cfg.lora.quantize == "4bit" and cfg.model.dtype == "bf16":  # QLoRA: the NF4 matmuls in autocast's dtype
        quantized_compute_dtype(setup.model, torch.bfloat16)
    # Per decoder layer, before compile and before the engine wraps the model (FSDP2 shards per layer). A draft
    # run checkpoints its draft block only: the frozen target runs under no_grad and keeps no activations.
    apply_activation_checkpointing(setup.model.draft_model if cfg.draft.frozen_target else setup.model, cfg.model)
    if mesh.tp > 1 and cfg.draft.frozen_target:  # before anything is written: a target it cannot split is refused
        check_tensor_parallel_target(setup.model.target, mesh.tp, cfg.draft.kind)
    elif mesh.tp > 1:
        check_tensor_parallel(setup.model, mesh.tp, seq_len)
    if layout.cp_size > 1:  # before anything is written: a model it cannot split is refused
        check_model(split_model_config(setup.model), layout.cp_size, mesh.tp)
        refuse_sliced_load_balancing(setup.loss_fn, layout.cp_size)
    resume = distributed.on_main(check_resume, cfg, out, resume_from, checkpoints, meta)
    if cfg.checkpoint.export_hf:  # a user's files in <output_dir>/hf are refused now, not after the training
        distributed.on_main(claim_export, setup.export.out_dir, "the run's export")
    distributed.on_main(prepare_output_dir, out, cfg, checkpoints)  # the first write: every input above is valid
    if cfg.checkpoint.dir is not None:
        distributed.on_main(claim_checkpoint_dir, ckpt_dir, cfg.train.output_dir)
    if resume is not None and resume.rollback:  # asked for with checkpoint.allow_rollback
        checkpoints.roll_back_to(resume.checkpoint, resume.rollback)
    model = setup.model.train()
    if layout.cp_size > 1:  # a model transform, where parallelism is applied: before compile and the engine's wrap
        apply_context_parallel(model, layout.cp_group)
    flops_per_token = model_flops_per_token(model, seq_len, cfg.draft.frozen_target)  # before a pipeline prunes it
    if cfg.model.compile:  # a draft is one block: compile it whole; the frozen target stays eager
        persistent_compile_cache()
        model.draft_model.compile() if cfg.draft.frozen_target else compile_layers(model)
    engine = build_engine(engine_name, model, cfg, device, deepspeed_json, mesh=mesh)
    t, r = cfg.train, cfg.resilience
    # Data-parallel ranks (replicas x shards) draw the samples; the ranks of a context group share them and slice
    # every sequence, those of a tensor-parallel group or of one pipeline share them whole (the mesh says which).
    slicing = dict(cp_rank=layout.cp_rank, cp_size=layout.cp_size)
    dp_rank, dp_size = layout.dp_rank, layout.dp_size
    loader = StepLoader({o.name: o.dataset for o in data.sources}, t.micro_batch_size, t.grad_accum_steps, t.seed,
                        dp_rank, dp_size, data.mixture, prefetch=cfg.data.prefetch, vocab_size=setup.vocab_size,
                        **slicing)
    opened.callback(loader.close)
    # Order matters: the guard may roll back before eval and checkpoint see the step,
    # and eval (which may set the "best" metric) runs before the checkpoint; user callbacks come
    # after eval (they see its result) and before the checkpoint (which saves their state).
    peak = peak_tflops(device, cfg.model.dtype, cfg.metrics.peak_tflops)
    callbacks = [*setup.step_callbacks, MetricsCallback(t.log_every, flops_per_token, peak), NanGuardCallback(r)]
    if step_time_check is not None:  # the auto choices' figure against the first steps
        callbacks.append(step_time_check)
    if info.world_size > 1 and d.health_check_every:
        callbacks.append(HealthCheckCallback(d.health_check_every, d.health_check_timeout_s))
    if r.inject_nan_steps and (not r.inject_nan_ranks or info.rank in r.inject_nan_ranks):
        callbacks.append(FaultInjectionCallback(r.inject_nan_steps))
    if cfg.profile.start_step is not None:  # first: the window closes right after its last step, before eval or a save
        p = cfg.profile
        callbacks.insert(0, ProfilerCallback(p.start_step, p.steps, Path(p.dir) if p.dir else out / "profile",
                                             p.record_shapes, p.memory, p.with_stack))
    if val_ds is not None:
        callbacks.append(EvalCallback(t.eval_every, t.eval_at_start, perplexity=not cfg.draft.frozen_target))
    callbacks += setup.eval_callbacks
    callbacks += user_callbacks
    callbacks.append(CheckpointCallback(cfg.checkpoint.every, cfg.checkpoint.every_minutes * 60))
    if cfg.checkpoint.export_hf:
        callbacks.append(setup.export)
    callbacks += elastic  # last: a drill's kill comes after the step's checkpoint
    bf16 = cfg.model.dtype in ("bf16", "fp8")  # fp8: what torchao leaves in high precision runs in bf16 autocast
    console = Console(t.max_steps, enabled=main, live=live, records="console" in cfg.metrics.sinks)
    metrics = Sinks(JsonlSink(out / "metrics.jsonl", enabled=main and "jsonl" in cfg.metrics.sinks), warn=console.print)
    opened.callback(metrics.close)
    trainer = Trainer(
        cfg, engine, build_schedule(engine.optimizer, cfg), loader,
        val_batches=lambda: eval_batches(val_ds, t.micro_batch_size, t.eval_batches, dp_rank, dp_size,
                                         setup.vocab_size, **slicing),
        callbacks=callbacks,
        checkpoints=checkpoints,
        metrics=metrics,
        console=console,
        autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
        meta=meta,
        shutdown=ShutdownWatcher(parse_duration(t.time_limit) if t.time_limit else None, cfg.resilience.shutdown_timeout_s),
        loss_fn=setup.loss_fn,
        eval_loss_fn=setup.eval_loss_fn,
    )
    if resume_from is not None:
        trainer.resume(resume_from)
    if trainer.finished:  # its one line said so: no start line, nothing written
        return trainer
    # Records after the checkpoint (or all, on a fresh start) came from a run that died: they are logged again.
    trainer.metrics.truncate_after(trainer.state.step if resume_from is not None else -1)
    if main:  # TensorBoard's event files likewise; W&B continues its run
        open_optional_sinks(metrics, cfg, out, trainer.state.step if resume_from is not None else None)
    kept = distributed.on_main(save_run_config, cfg, out, resume)
    if resume is not None and resume.describe(kept):
        trainer.console.print(resume.describe(kept))
    where = f"{device}" if info.world_size == 1 else f"{info.world_size} ranks ({engine_name}, {device.type})"
    if layout.cp_size > 1 and mesh.tp == 1:
        where += f", {layout.dp_size} data-parallel x {layout.cp_size} context-parallel"
    elif mesh.tp > 1 or mesh.sizes["dp_replicate"] > 1:
        where += f", {mesh.describe()}"
    trainer.console.print(
        f"treadle: {setup.describe()} on {where}, {RunTokenizer.from_meta(meta).describe()}, "
        f"{sum(o.dataset.num_tokens for o in data.sources):,} train tokens, "
        f"{loader.global_batch} x {seq_len} tokens per step, {validation_words(cfg, data)}, run directory {out}"
    )
    if cfg.data.sources or any(o.kind == "sft" or o.skipped for o in data.sources):
        probs = data.mixture.probabilities(trainer.state.step)
        for o, p in zip(data.sources, probs):
            trainer.console.print(f"  source {o.describe()}, p={p:.3f}")
    for line in setup.notes.lines(resumed=resume_from is not None) + auto_lines + unreached_phases(cfg):
        trainer.console.print(line)
    return trainer


def validation_words(cfg: Config, data: RunData) -> str:
    """Which validation set eval loss is measured on, for the start line (the built-in corpus says nothing about
    a user's own data, so it is named as such)."""
    d = cfg.data
    if data.val is None:
        return "no validation set (data.val = [])"
    if d.val_fraction:
        return f"validation on {len(data.val):,} samples held out of the training data (data.val_fraction = {d.val_fraction:g})"
    if d.val == ["builtin"]:
        return "validation on the built-in corpus (data.val)"
    return f"validation on {', '.join(d.val)} (data.val)"


def unreached_phases(cfg: Config) -> list[str]:
    """A warning line per data phase the run never reaches (start_step is 0-based: a phase at start_step s trains
    the step logged as s + 1). Not an error: a run may be shortened on purpose (a smoke test of a recipe)."""
    return [f"treadle: warning: data.phases[{i}] starts at start_step = {p.start_step}, but the run ends at "
            f"train.max_steps = {cfg.train.max_steps}: it never runs"
            for i, p in enumerate(cfg.data.phases) if p.start_step >= cfg.train.max_steps]


def run_training(cfg: Config, live: bool | None = None, callbacks: Sequence[Callback] = ()) -> RunSummary:
    """Build, fit and close a run (``build_trainer``); everything it opened is closed, also when it raises."""
    joined = not torch.distributed.is_initialized()  # a group this run creates is left at its end
    try:
        trainer = build_trainer(cfg, live, callbacks)
        try:
            state = trainer.fit()
        finally:
            close_trainer(trainer)
    finally:
        if joined:
            distributed.destroy()
    out = Path(trainer.cfg.train.output_dir)
    metrics_cb = next(cb for cb in trainer.callbacks if isinstance(cb, MetricsCallback))
    eval_cb = next((cb for cb in trainer.callbacks if type(cb) is EvalCallback), None)
    return RunSummary(
        output_dir=out,
        steps=state.step,
        first_loss=metrics_cb.first_loss,
        last_loss=metrics_cb.last_loss,
        first_eval=eval_cb.first if eval_cb else None,
        last_eval=eval_cb.last if eval_cb else None,
        tokens=state.tokens,
        tokens_per_s=state.tokens / max(state.elapsed_s, 1e-9),
        elapsed_s=state.elapsed_s,
        checkpoints=trainer.checkpoints.complete(),
        export_dir=next((cb.out_dir for cb in trainer.callbacks if isinstance(cb, (ExportCallback, DraftExportCallback))), None),
        parameters=trainable_parameters(trainer.engine.module),
        stop_reason=trainer.stop_reason,
        acceptance=next(((cb.first, cb.last) for cb in trainer.callbacks if isinstance(cb, AcceptanceCallback)),
                        (None, None) if trainer.cfg.draft.kind else None),  # a draft run without tau_sim: (None, None)
        rank=trainer.engine.rank,
        finished_before=trainer.finished,
        draft_dir=next((cb.draft_dir for cb in trainer.callbacks if isinstance(cb, BesideExportCallback)), None),
        loss_label=getattr(trainer.loss_fn, "label", RunSummary.loss_label),
        eval_loss_label=getattr(getattr(trainer.eval_loss_fn, "__self__", trainer.eval_loss_fn), "eval_label",
                                RunSummary.eval_loss_label),
    )
