"""The config's schema: one pydantic model per ``[section]``, and ``Config``, the whole run.

Each section forbids unknown keys and checks its own values; ``Config`` checks the rules across sections. The
descriptions, types and bounds written here are what ``treadle config --explain``, the "accepted: ..." of every
config error and docs/configuration.md say (``treadle.config.doc`` reads them off): change a key here, and
regenerate the reference with ``treadle config --reference > docs/configuration.md``.

Reading a file and the command line is ``treadle.config.load``; the words of an error, ``treadle.config.messages``;
writing TOML back, ``treadle.config.render``.
"""

from __future__ import annotations

import math
import os
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from treadle.config.draft import DraftConfig
from treadle.config.lora import LoraConfig
from treadle.config.messages import config_error
from treadle.config.section import Section
from treadle.drafts.settings import check as check_draft, check_context_parallel as check_draft_context_parallel
from treadle.drafts.settings import check_beside as check_draft_beside, check_lora as check_draft_lora


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str) -> float:
    """'3h50m', '90s', '1d2h', '45m' -> seconds."""
    m = _DURATION.match(text.strip())
    if not text.strip() or m is None or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration; accepted: e.g. '3h50m', '90m', '45s', '1d'")
    d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


class TrainConfig(Section):
    micro_batch_size: int = Field(8, ge=1, description="sequences per micro-batch per rank")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    max_steps: int = Field(200, ge=1, description="optimizer steps of the whole run")
    seed: int = Field(0, ge=0)
    output_dir: str = Field("runs/default", description="run directory")
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(100, ge=0, description="steps between evaluations; 0 = only at the end (and the start)")
    eval_at_start: bool = Field(True, description="evaluate before the first step too: the baseline later evals are "
                                "compared to, and a broken validation set found at once (false: skip it)")
    eval_batches: int = Field(16, ge=1, description="validation batches per evaluation")
    grad_clip: float = Field(1.0, ge=0.0, description="max global grad norm; 0 = no clipping")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = torch's default")
    time_limit: str | None = Field(None, description="wall-clock budget, e.g. '3h50m': checkpoint and exit (code 75) before it")

    @field_validator("time_limit")
    @classmethod
    def _time_limit(cls, v: str | None) -> str | None:
        if v is not None:
            parse_duration(v)
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu") and not v.startswith("cuda"):
            raise ValueError("accepted: auto, cpu, cuda, cuda:N")
        return v


_Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # bounds in the annotation: config --explain and errors show them


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.1, ge=0.0)
    betas: tuple[_Beta, _Beta] = Field((0.9, 0.95), description="AdamW's decay rates of the moment estimates")
    eps: float = Field(1e-8, gt=0.0)
    decay_embeddings: bool = Field(False, description="apply weight decay to embedding tables")
    decay_norms_and_biases: bool = False


class ScheduleConfig(Section):
    warmup_steps: int | None = Field(None, ge=0, description="linear warmup length in steps")
    warmup_proportion: float | None = Field(None, ge=0.0, lt=1.0, description="warmup as a fraction of max_steps")
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="final lr / peak lr")
    wsd_decay_proportion: float = Field(0.2, gt=0.0, le=1.0, description="wsd: fraction of the run spent decaying")

    @model_validator(mode="after")
    def _one_warmup(self) -> ScheduleConfig:
        if self.warmup_steps is not None and self.warmup_proportion is not None:
            raise ValueError("set schedule.warmup_steps or schedule.warmup_proportion, not both; accepted: one of "
                             "them (an override of one replaces the file's other; --schedule.warmup_steps=none unsets it)")
        return self


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="steps between checkpoints; 0 = none by step count")
    every_minutes: float = Field(30.0, ge=0.0, description="wall-clock minutes between checkpoints, besides 'every' "
                                 "(whichever is due first; rank 0's clock); 0 = none by time")
    keep_last: int = Field(2, ge=1)
    dir: str | None = Field(None, description="where checkpoints go: unset = <output_dir>/checkpoints; a local "
                            "path, or an fsspec URL (s3://bucket/prefix, gs://..., an S3-compatible endpoint through "
                            "AWS_ENDPOINT_URL); credentials come from the environment or the backend's own "
                            "configuration, never from this file")
    resume: str = Field("auto", description="auto | none | <checkpoint path>")
    export_hf: bool = Field(True, description="write <output_dir>/hf (a draft run: <output_dir>/draft) at the end")
    async_save: bool = Field(False, description="write checkpoints in the background; latest moves when durable "
                             "(local, ddp, fsdp2 at any world size; deepspeed saves synchronously)")
    best_metric: str | None = Field(None, description="a logged metric (e.g. eval_loss) whose best checkpoint is kept")
    best_mode: Literal["min", "max"] = "min"
    allow_schedule_change: bool = Field(
        False, description="resume although the learning rate at the resumed step changes (optim.lr, train.max_steps "
                           "under a decaying schedule, schedule.*, data.phases); one run only, not saved as true")
    allow_rollback: bool = Field(
        False, description="resume from an older checkpoint of this run: newer checkpoints are removed and metrics after "
                           "it dropped; one run only, not saved as true")


class ResilienceConfig(Section):
    nan_policy: Literal["skip", "rollback", "abort"] = Field("skip", description="what a non-finite loss or grad norm does")
    max_consecutive_bad: int = Field(3, ge=1, description="bad steps in a row before rollback (or abort under skip)")
    rollback_lr_scale: float = Field(0.5, gt=0.0, le=1.0, description="lr multiplier applied at each rollback")
    max_rollbacks: int = Field(3, ge=0, description="rollbacks before the run gives up")
    shutdown_timeout_s: float = Field(300.0, gt=0.0, description="forced exit if the shutdown checkpoint hangs")
    inject_nan_steps: list[int] = Field(default_factory=list, description="FAULT INJECTION for tests and drills: steps whose loss is made NaN")
    inject_nan_ranks: list[int] = Field(default_factory=list, description="FAULT INJECTION: ranks that inject (empty = all)")
    inject_kill_step: int | None = Field(None, ge=1, description="FAULT INJECTION for drills: SIGKILL one rank right "
                                         "after this step's checkpoint (a multiple of checkpoint.every), on "
                                         "torchrun's first attempt only: a job under --max-restarts restarts and "
                                         "resumes past it")
    inject_kill_rank: int = Field(0, ge=0, description="FAULT INJECTION: the rank that inject_kill_step kills")


class ModelConfig(Section):
    preset: str = Field("tiny", description="built-in architecture, used when model.path is unset")
    path: str | None = Field(None, description="local Hugging Face model directory to load (a treadle run directory: "
                             "its hf/); one holding a config.json and no weights: that architecture, random weights, "
                             "model.overrides on top")
    dtype: Literal["auto", "fp32", "bf16", "bf16-weights", "fp8"] = Field(
        "auto", description="bf16 = autocast over fp32 weights; bf16-weights = bf16 parameters and activations, the "
        "optimizer updating an fp32 master copy (local engine); fp8 = bf16 plus torchao's float8 for the large linear "
        "layers (CUDA capability >= 8.9, torchao installed; engines local, ddp, fsdp2; models/fp8.py); auto = the "
        "fastest here, never fp8 (it changes the math): bf16 on CUDA from Ampere on, on CPU measured on one decoder "
        "layer of the run's shape (cached per machine and shape)")
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="model.dtype = fp8: torchao's float8 scaling, one scale per tensor (tensorwise, "
        "the faster) or per row (rowwise, the more accurate)")
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile each decoder layer; auto = when the run's estimated eager time is long "
        "enough for the compile to pay back (models/autotune.py)")
    attention: Literal["auto", "dense", "varlen", "flex"] = Field(
        "auto", description="how a packed row's documents are kept apart: dense = transformers' [T, T] mask; varlen = "
        "each document by itself (CUDA: torch's flash varlen; CPU: sdpa per document, memory linear in the row); "
        "flex = FlexAttention with a document BlockMask (CUDA); auto = flex on rows of 8192 tokens or more on CUDA, varlen "
        "over 2048 on CPU, else dense (models/attention.py)")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="recompute activations in backward, per decoder layer: full (keep only each layer's input) "
                            "or selective (keep the outputs of the ops in activation_checkpointing_save_ops)")
    activation_checkpointing_every: int = Field(1, ge=1, description="checkpoint every k-th decoder layer (the 1st, "
                                                "k+1-th, ...); 1 = all")
    activation_checkpointing_save_ops: list[str] = Field(
        default_factory=list, description="selective: aten op names whose outputs are kept (e.g. 'mm', "
                                          "'_scaled_dot_product_flash_attention_for_cpu'); [] = matmuls and attention")
    overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "HF config fields set on top of the preset, or of a model.path config.json without weights; beside a "
        "model.path with weights (which keeps its config.json) only values that agree with it, others are refused"))
    router_aux_loss_coef: float | None = Field(
        None, ge=0.0, description="MoE models: weight of the router load-balancing loss added to the loss; unset = the "
        "HF config's own router_aux_loss_coef (0.001 Mixtral/Qwen-MoE, 0.01 OLMoE); a model without experts refuses > 0")
    router_z_loss_coef: float = Field(
        0.0, ge=0.0, description="MoE models: weight of the router z-loss (mean logsumexp(router logits)^2, ST-MoE "
        "uses 0.001); 0 = off; a model without experts refuses > 0")
    loss_chunk_tokens: Literal["auto"] | Annotated[int, Field(ge=0)] = Field(
        "auto", description="LM head + cross-entropy computed this many tokens at a time (the [tokens, vocab] logits "
        "never exist whole); 0 = off; auto = 1024 from a vocabulary of 32000 up, else off")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile(cls, v: Any) -> Any:
        if v != "auto" and not isinstance(v, bool):
            raise ValueError("accepted: 'auto', true or false")
        return v

    @field_validator("loss_chunk_tokens", mode="before")
    @classmethod
    def _chunk_tokens(cls, v: Any) -> Any:
        if v != "auto" and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise ValueError("accepted: 'auto', 0 (off) or a number of tokens per chunk")
        return v

    @model_validator(mode="after")
    def _checkpointing_ops(self) -> ModelConfig:
        if self.activation_checkpointing_save_ops and self.activation_checkpointing != "selective":
            raise ValueError("activation_checkpointing_save_ops is set but activation_checkpointing = "
                             f"{self.activation_checkpointing!r}; accepted: the ops with activation_checkpointing = 'selective'")
        return self


_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class SourceConfig(Section):
    """One entry of ``[[data.sources]]``: a named source and its share of the mixture."""

    name: str = Field(description="short identifier; metrics are logged as loss/<name>, tokens/<name>")
    path: list[str] = Field(description="'builtin', shard directories, or .jsonl/.json/.parquet/.arrow files (a file, a directory or a glob)")
    weight: float = Field(1.0, ge=0.0, description="sampling weight; probability ~ weight^(1/data.temperature)")
    format: Literal["auto", "text", "sft", "tokens"] = Field(
        "auto", description="files: text (a text field), sft (messages or prompt/completion); auto: from the first row")
    text_field: str = Field("text", description="format text: the field holding the document")

    @field_validator("path", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("accepted: letters, digits, '_', '.', '-'")
        return v


class PhaseConfig(Section):
    """One entry of ``[[data.phases]]``: from ``start_step`` on, other weights and a scaled learning rate."""

    start_step: int = Field(ge=0, description="first step of the phase")
    weights: dict[str, float] = Field(default_factory=dict, description="source name -> weight; unnamed sources keep their weight")
    lr_scale: float = Field(1.0, gt=0.0, description="multiplies the scheduled learning rate during the phase")

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, w in v.items() if w < 0]
        if bad:
            raise ValueError(f"weight of {bad[0]!r} is negative; accepted: weights >= 0")
        return v


# data.val_fraction when the training data is the user's own and no validation set is named: eval loss then
# measures that data, not the built-in corpus (5%, as Hugging Face's run_clm holds out by default).
OWN_DATA_VAL_FRACTION = 0.05


class DataConfig(Section):
    seq_len: int = Field(256, ge=8)
    train: list[str] = Field(default_factory=lambda: ["builtin"], description="shard dirs / data files, or 'builtin' (one source named 'train')")
    val: list[str] = Field(default_factory=lambda: ["builtin"], description="shard dirs / data files, 'builtin', or [] for no eval; "
                           "unused while data.val_fraction > 0")
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="hold out this fraction of every training source's "
                                "documents (fixed by a hash of the document's index) as the validation set, instead of "
                                f"data.val; 0 = off; when neither key is set and the training data is your own (not "
                                f"'builtin'), {OWN_DATA_VAL_FRACTION}")
    sources: list[SourceConfig] = Field(default_factory=list, description="a weighted mixture; replaces data.train")
    temperature: float = Field(1.0, gt=0.0, description="mixture temperature: probability ~ weight^(1/temperature)")
    phases: list[PhaseConfig] = Field(default_factory=list, description="curriculum: mixture weights and lr_scale by step")
    mask_cross_doc: bool = Field(True, description="no loss on predicting the first token of the next document")
    tokenizer: str = Field("auto", description="'auto' (the shards', else the target's / model's, else the built-in) or a directory")
    chat_template: Literal["auto", "builtin"] = Field("auto", description="sft: the tokenizer's chat template if it has one, or treadle's built-in")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="sft: an example longer than seq_len + 1 tokens is cut, or dropped")
    bad_rows: Literal["error", "skip"] = Field("error", description="a malformed row stops the run (naming file and line), or is skipped and counted")
    prefetch: bool = Field(True, description="build the next step's batches in a background thread")

    @field_validator("train", "val", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _hold_out_own_data(cls, data: Any) -> Any:
        """Training data of the user's own and neither data.val nor data.val_fraction set: hold out
        OWN_DATA_VAL_FRACTION of it, rather than validate on the built-in corpus. Set here, so the resolved
        config says so (and a saved config, which has the key, is not changed by it again)."""
        if not isinstance(data, dict) or "val" in data or "val_fraction" in data:
            return data
        if isinstance(data.get("sources"), list) and data["sources"]:
            entries = [s.path if isinstance(s, SourceConfig) else s.get("path") if isinstance(s, dict) else None
                       for s in data["sources"]]
        else:
            entries = [data.get("train", ["builtin"])]
        paths = [p for e in entries for p in ([e] if isinstance(e, str) else e if isinstance(e, list) else [])]
        if any(p != "builtin" for p in paths):
            return {**data, "val_fraction": OWN_DATA_VAL_FRACTION}
        return data

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        names = [s.name for s in self.sources]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"data.sources: name {dup!r} is used twice; accepted: one name per source")
        if self.sources and "train" in self.model_fields_set:
            raise ValueError("data.train and data.sources are both set; accepted: one of them (data.sources replaces "
                             "data.train; --data.sources=[] drops a file's sources, and --data.phases=[] its phases)")
        if self.val_fraction and self.val and "val" in self.model_fields_set:
            raise ValueError(f"data.val = {self.val} and data.val_fraction = {self.val_fraction} are both set; accepted: "
                             "one of them (data.val_fraction holds out part of the training data as the validation set; "
                             "--data.val_fraction=0 turns it off)")
        known = names or ["train"]
        starts = [p.start_step for p in self.phases]
        if starts != sorted(set(starts)):
            raise ValueError(f"data.phases: start_step values {starts} must be strictly increasing")
        weights = [{n: s.weight for n, s in zip(names, self.sources)}] if names else []
        for p in self.phases:
            unknown = sorted(set(p.weights) - set(known))
            if unknown:
                raise ValueError(f"data.phases: weights name {unknown[0]!r}, which is not a source; accepted: {', '.join(known)}")
            if names:
                weights.append({**weights[0], **p.weights})
        for w in weights:
            if not any(v > 0 for v in w.values()):
                raise ValueError("data.sources: every weight (of the sources, and of each phase) is 0; accepted: at least one weight > 0")
        return self


class DistributedConfig(Section):
    """How the run is spread over processes; the loop is the same whichever engine runs it."""

    engine: Literal["auto", "local", "ddp", "fsdp2", "deepspeed"] = Field(
        "auto", description="auto: local for one process, fsdp2 under a launcher with several")
    zero_stage: int = Field(2, ge=0, le=3, description="deepspeed: ZeRO stage 0-3")
    deepspeed_config: str | None = Field(None, description="deepspeed: a JSON file whose keys override the generated config")
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="fsdp2: dtype gradients are reduced in")
    reshard_after_forward: bool = Field(True, description="fsdp2: free gathered layers after forward (less memory, more traffic)")
    cpu_offload: bool = Field(False, description="fsdp2 / deepspeed: keep sharded parameters and optimizer state on the CPU")
    timeout_s: float = Field(600.0, gt=0.0, description="bound on every collective: a dead peer becomes an error")
    health_check_every: int = Field(50, ge=0, description="steps between health checks of all ranks; 0 = off")
    health_check_timeout_s: float = Field(60.0, gt=0.0, description="a rank that does not answer the health check by then is hung")
    context_parallel: int = Field(1, ge=1, description="ranks that split every sequence (Ulysses: attention heads "
                                  "exchanged all-to-all); data-parallel replicas = world size / this")
    data_parallel_replicate: int = Field(1, ge=1, description="fsdp2: replicas that each hold a whole copy of the "
                                         "shards (HSDP: sharded within a replica, all-reduced across; across nodes)")
    data_parallel_shard: int = Field(-1, ge=-1, description="ranks each replica's parameters are sharded over (FSDP2); "
                                     "-1 = what the other axes leave of the world size")
    tensor_parallel: int = Field(1, ge=1, description="ranks every matmul weight is split over (column / row-wise, "
                                 "sequence parallel between them, vocabulary-parallel loss); fsdp2 engine; 1 = off")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline stages: the decoder layers are split over this many ranks "
                                   "(embedding on the first, norm, head and loss on the last); the data ranks left run whole stages (engine "
                                   "auto) or shard each stage with FSDP2 (engine fsdp2); 1 = off")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="pipeline_parallel > 1: how the step's micro-batches (train.grad_accum_steps) flow through "
        "the stages; interleaved_1f1b puts two stages on each rank")


class MetricsConfig(Section):
    """Where the metrics of a run go, and what the MFU is measured against."""

    sinks: list[Literal["jsonl", "console", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl", "console"],
        description="jsonl: <output_dir>/metrics.jsonl; console: a line per record; tensorboard: <output_dir>/tensorboard "
                    "(pip install treadle[tensorboard]); wandb: W&B, the wandb_* keys (pip install treadle[wandb])")
    peak_tflops: float | None = Field(None, gt=0.0, description="one device's peak TFLOP/s for mfu; unset = a known "
                                      "GPU's bf16 / fp32 peak (none on CPU: tflops_per_s only)")
    wandb_project: str = Field("treadle", description="wandb sink: the W&B project")
    wandb_name: str | None = Field(None, description="wandb sink: the run's name; unset = the run directory's name")
    wandb_group: str | None = Field(None, description="wandb sink: the W&B group (e.g. one sweep)")
    wandb_tags: list[str] = Field(default_factory=list, description="wandb sink: the run's tags")
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="wandb sink: offline = written under <output_dir>/wandb for `wandb sync` later (no network)")

    @field_validator("sinks")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        dup = next((s for s in v if v.count(s) > 1), None)
        if dup is not None:
            raise ValueError(f"{dup!r} is listed twice; accepted: each sink once")
        return v


class ProfileConfig(Section):
    """``[profile]``: a torch.profiler window over a few steps (off unless start_step is set)."""

    start_step: int | None = Field(None, ge=1, description="first profiled step (as logged: 1 = the first); unset = off")
    steps: int = Field(1, ge=1, description="steps profiled from start_step on")
    dir: str | None = Field(None, description="trace directory (one Chrome/Perfetto JSON per rank, TensorBoard's "
                            "profiler layout); unset = <output_dir>/profile")
    record_shapes: bool = Field(False, description="record operator input shapes")
    memory: bool = Field(False, description="record tensor allocations (profile_memory)")
    with_stack: bool = Field(False, description="record Python stacks (costly)")


class CallbackConfig(Section):
    """One entry of ``[[callbacks]]``: a user's Callback class, constructed with ``args`` at the start of the run."""

    path: str = Field(description="'package.module:ClassName', or 'path/to/file.py:ClassName'")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the class's constructor")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        module, _, name = v.rpartition(":")
        if not module or not name.isidentifier():
            raise ValueError("accepted: 'package.module:ClassName' or 'path/to/file.py:ClassName'")
        return v


class Config(Section):
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    callbacks: list[CallbackConfig] = Field(default_factory=list, description="user callbacks ([[callbacks]] path, args)")

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.schedule.warmup_steps is not None and self.schedule.warmup_steps >= self.train.max_steps:
            raise ValueError(
                f"schedule.warmup_steps={self.schedule.warmup_steps} is not shorter than "
                f"train.max_steps={self.train.max_steps}; accepted: 0 <= warmup_steps < max_steps (e.g. "
                f"--schedule.warmup_steps={self.train.max_steps // 10}), or schedule.warmup_proportion in the file, "
                "which scales with the run"
            )
        if self.draft.kind is not None and self.draft.target is None:
            raise ValueError("draft.kind is set but draft.target is not; accepted: a Hugging Face model directory or a treadle run directory")
        check_draft(self.draft)  # each kind's own keys and refusals (drafts/settings.py)
        self._check_beside()
        if self.draft.eval_new_tokens <= self.draft.gamma:
            raise ValueError(f"draft.eval_new_tokens={self.draft.eval_new_tokens} must exceed draft.gamma={self.draft.gamma}")
        if not self.data.train:
            raise ValueError("data.train is empty; accepted: 'builtin' or a list of shard directories")
        cp = self.distributed.context_parallel
        if cp > 1 and self.data.seq_len % cp:
            raise ValueError(f"data.seq_len = {self.data.seq_len} cannot be split into distributed.context_parallel = "
                             f"{cp} equal parts; accepted: a multiple of {cp}")
        if cp > 1:
            check_draft_context_parallel(self.draft, cp, self.model.loss_chunk_tokens)
        if cp > 1 and self.distributed.pipeline_parallel > 1:
            raise ValueError(f"distributed.context_parallel = {cp} with distributed.pipeline_parallel = "
                             f"{self.distributed.pipeline_parallel} is not supported yet; accepted: one of them > 1")
        self._check_pipeline()
        self._check_mesh()
        self._check_lora()
        return self

    def _check_beside(self) -> None:
        """A draft trained beside its target (``draft.target = 'self'``): what it cannot run with, one line each."""
        dr, d = self.draft, self.distributed
        if not dr.beside:
            for key, default in (("joint", False), ("lr", None)):
                if getattr(dr, key) != default:
                    raise ValueError(f"draft.{key} is set but draft.target = {dr.target!r}: it sets a draft trained "
                                     "beside its target; accepted: draft.target = 'self' with a draft.kind, or "
                                     f"draft.{key} unset")
            return
        check_draft_beside(dr)  # the kind reads the target's training forward
        if not dr.joint and dr.weight != 0.3:
            raise ValueError(f"draft.weight = {dr.weight:g} with draft.joint = false: a detached draft's loss never "
                             "reaches the target; accepted: draft.joint = true, or draft.weight unset")
        if dr.features is not None:
            raise ValueError(f"draft.features = {dr.features!r} with draft.target = 'self': a draft beside its target "
                             "reads the target's training forward of each step, never a store (the target changes "
                             "every step); accepted: draft.features unset")
        refusals = (
            (d.tensor_parallel > 1, f"distributed.tensor_parallel = {d.tensor_parallel}",
             "the draft reads whole hidden states, not a tensor-parallel shard of them"),
            (d.context_parallel > 1, f"distributed.context_parallel = {d.context_parallel}",
             "the draft reads whole sequences, not a rank's slice of them"),
            (d.pipeline_parallel > 1, f"distributed.pipeline_parallel = {d.pipeline_parallel}",
             "the hidden states the draft reads are made on different pipeline stages"),
            (self.lora.rank is not None, "lora.rank", "a draft beside adapters on its target is not built"),
            (self.model.dtype == "fp8", "model.dtype = 'fp8'", "a draft beside an fp8 target is not built"),
        )
        for refused, what, why in refusals:
            if refused:
                raise ValueError(f"{what} with draft.target = 'self': {why}; accepted: the run without it, or the "
                                 "draft trained afterwards against the exported target")

    def _check_lora(self) -> None:
        """What adapters cannot run with, refused before anything starts (the modules named are checked against the
        model once it is built: models/lora.py)."""
        lora, d = self.lora, self.distributed
        if lora.rank is None:  # the other keys keep their defaults in a resolved config.toml: not an error
            return
        if self.draft.kind is not None:  # adapters on a trained draft: its kind says whether it has them
            check_draft_lora(self.draft)
        if d.tensor_parallel > 1:
            raise ValueError(f"lora.rank with distributed.tensor_parallel = {d.tensor_parallel}: tensor parallelism "
                             "splits nn.Linear weights by name, and PEFT wraps each adapted linear in a LoRA layer it "
                             "has no plan for; accepted: tensor_parallel = 1 (fsdp2 shards the frozen base instead)")
        if d.pipeline_parallel > 1:
            raise ValueError(f"lora.rank with distributed.pipeline_parallel = {d.pipeline_parallel}: the stages are cut "
                             "from the decoder layers before PEFT could wrap them, and the adapter export needs the "
                             "whole model on one rank; accepted: pipeline_parallel = 1 (fsdp2 shards the frozen base)")
        if self.model.dtype == "fp8":
            raise ValueError("lora.rank with model.dtype = 'fp8': torchao's float8 layers replace the nn.Linear "
                             "modules PEFT adapts; accepted: model.dtype = auto, fp32, bf16 or bf16-weights")
        if lora.quantize == "4bit" and self.draft.kind is not None:
            raise ValueError(f"lora.quantize = '4bit' with draft.kind = {self.draft.kind!r}: a draft's adapters train "
                             "on a base draft of a few layers, and the frozen target is not the model adapted; "
                             "accepted: lora.quantize = 'none' in a draft run")
        if lora.quantize == "4bit" and self.model.dtype == "bf16-weights":
            raise ValueError(f"lora.quantize = '4bit' with model.dtype = {self.model.dtype!r}: the base's linears are "
                             "NF4 and its other weights are not cast around them; accepted: model.dtype = auto, fp32 "
                             "or bf16 (autocast)")
        if lora.quantize == "4bit" and d.engine not in ("auto", "local"):
            raise ValueError(f"lora.quantize = '4bit' with distributed.engine = {d.engine!r}: bitsandbytes' 4-bit "
                             "weights are not sharded or replicated by treadle's engines yet; accepted: engine = auto "
                             "or local (one process), or quantize = 'none'")

    def _check_mesh(self) -> None:
        """Axes an engine cannot run, refused before anything starts (their product against the launch's world size
        is checked where the launch is known: engine/mesh.py)."""
        d = self.distributed
        if d.data_parallel_shard == 0:
            raise ValueError("distributed.data_parallel_shard = 0; accepted: -1 (what the other axes leave) or >= 1")
        tp, rep = d.tensor_parallel, d.data_parallel_replicate
        for key, n in (("tensor_parallel", tp), ("data_parallel_replicate", rep)):
            if n > 1 and d.engine not in ("auto", "fsdp2"):
                raise ValueError(f"distributed.{key} = {n} runs on FSDP2's DTensors, not on the {d.engine} engine; "
                                 f"accepted: distributed.engine = auto or fsdp2, or {key} = 1")
            if n > 1 and d.pipeline_parallel > 1:
                raise ValueError(f"distributed.{key} = {n} with pipeline_parallel = {d.pipeline_parallel}: HSDP and "
                                 "tensor parallelism inside pipeline stages are not built (FSDP2 over "
                                 "data_parallel_shard is: engine = fsdp2); accepted: one of them = 1")
        cp = d.context_parallel
        if tp > 1 and cp > 1 and self.draft.kind is not None:
            raise ValueError(f"distributed.tensor_parallel = {tp} with context_parallel = {cp} in a draft run is not "
                             "built (the target's split for a draft keeps whole sequences); accepted: one of them = 1")
        if tp > 1 and cp > 1 and self.data.seq_len % (cp * tp):
            raise ValueError(f"data.seq_len = {self.data.seq_len} cannot be split into distributed.context_parallel "
                             f"x tensor_parallel = {cp * tp} equal parts (sequence parallelism splits each context "
                             f"slice again); accepted: a multiple of {cp * tp}")
        if tp > 1 and self.model.loss_chunk_tokens not in ("auto", 0) and self.draft.kind is None:
            raise ValueError(f"model.loss_chunk_tokens = {self.model.loss_chunk_tokens} with distributed.tensor_parallel"
                             f" = {tp}: the LM head's weight is split over the vocabulary and the loss runs on the "
                             "vocabulary shards (loss_parallel: no rank holds the whole logits), which the chunked loss "
                             "cannot take; accepted: loss_chunk_tokens = 0 or auto (off with tensor parallelism)")
        if tp > 1 and self.data.seq_len % tp and self.draft.kind is None:  # a draft's target: no sequence split
            raise ValueError(f"data.seq_len = {self.data.seq_len} cannot be split into distributed.tensor_parallel = "
                             f"{tp} equal parts (sequence parallelism shards the tokens between blocks); accepted: a "
                             f"multiple of {tp}")

    def _check_pipeline(self) -> None:
        """Layouts torch's pipeline schedules cannot run, refused before anything starts (the layer split and the
        world size are checked where the model and the launch are known)."""
        d, ga = self.distributed, self.train.grad_accum_steps
        if d.pipeline_parallel == 1:
            return
        if d.engine == "deepspeed":
            raise ValueError("distributed.pipeline_parallel > 1 runs on torch's pipeline schedules, not DeepSpeed's "
                             "(its PipelineModule refuses ZeRO-2/3); accepted: distributed.engine = auto, or "
                             "pipeline_parallel = 1 with deepspeed")
        if self.draft.kind is not None:
            raise ValueError("distributed.pipeline_parallel > 1 is not supported for draft runs (the draft is one "
                             "block beside a frozen target); accepted: pipeline_parallel = 1")
        if d.pipeline_schedule == "1f1b" and ga < d.pipeline_parallel:
            raise ValueError(f"distributed.pipeline_schedule = '1f1b' needs at least one micro-batch per stage: "
                             f"train.grad_accum_steps = {ga} < pipeline_parallel = {d.pipeline_parallel}; accepted: "
                             f"grad_accum_steps >= {d.pipeline_parallel}, or pipeline_schedule = 'gpipe'")
        rounds = max(1, ga // d.pipeline_parallel)
        if d.pipeline_schedule == "interleaved_1f1b" and ga % rounds:
            raise ValueError(f"distributed.pipeline_schedule = 'interleaved_1f1b' runs the micro-batches in rounds of "
                             f"pipeline_parallel = {d.pipeline_parallel}: train.grad_accum_steps = {ga} is not a multiple "
                             f"of {rounds} rounds; accepted: a multiple of {d.pipeline_parallel}, or fewer than "
                             f"{2 * d.pipeline_parallel}")

    def warmup_steps(self) -> int:
        s = self.schedule
        if s.warmup_steps is not None:
            return s.warmup_steps
        if s.warmup_proportion is not None:  # floor, robust to 0.1 * 30 = 3.0000000000000004 and 0.29 * 100 = 28.99...
            return math.floor(s.warmup_proportion * self.train.max_steps + 1e-9)
        return 0


Section.config_root = Config
