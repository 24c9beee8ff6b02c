"""Tensor parallelism (``distributed.tensor_parallel``): every matmul weight split over the ranks of the "tp" mesh
dimension, on torch's own DTensor styles (``parallelize_module``); a model transform applied before FSDP2 wraps
the model (engine/fsdp2.py shards the TP-sharded parameters again over the data-parallel dims: 2-D DTensors).

The plan (one, for the decoder families whose blocks have the Llama shape; ``plan_for`` refuses the others in
one line):

* attention q/k/v column-wise (each rank computes ``heads / tp`` query heads and ``kv_heads / tp`` key/value heads:
  transformers' attention views its projections with ``-1`` heads, so it runs on the local heads unchanged),
  o row-wise; MLP gate/up column-wise, down row-wise.
* Sequence parallel between them: the residual stream is sharded on the sequence (dim 1), the norms run on each
  rank's tokens (``SequenceParallel``: their weights replicated, their gradients summed over "tp" by DTensor);
  entering attention / the MLP the sequence is all-gathered, leaving it the row-wise output is reduce-scattered.
* The residual stream stays a DTensor of the whole sequence's shape between blocks (``use_local_output=False``):
  transformers builds the attention mask and the rotary table from ``inputs_embeds``' shape, which must be the
  whole sequence's (a local [B, T/tp, H] tensor would give a mask of T/tp positions).
* The embedding is vocabulary-parallel (row-wise: each rank holds ``vocab / tp`` rows and masks the ids it does
  not own) and the LM head column-wise with its logits left sharded on the vocabulary: the cross-entropy runs under
  torch's ``loss_parallel`` (a distributed log-sum-exp), so no rank ever holds the whole [tokens, vocab] logits.
  This replaces the chunked loss (``model.loss_chunk_tokens``), which cannot take a vocabulary-sharded weight.
* The head's output never leaves it whole while a loss is taken: ``VocabParallelHead`` returns each token's loss
  (the chunked head's protocol, ``chunked_ce.scoring``), so the step and the evaluation see plain tensors.
* Per-head norms (Qwen3 / Gemma 3 ``q_norm`` / ``k_norm`` over ``head_dim``) run on the local heads with their
  weight replicated; viewed as ``SequenceParallel`` over the heads dimension (2), their gradient is summed over
  "tp" as every replicated weight's is.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from treadle.errors import UserError
from treadle.models.chunked_ce import ChunkedLMHead, _logit_transform, transformed_logits
from treadle.models.hf import decoder_layers
from treadle.models.upcast import at_least_fp32

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _why_not(model: nn.Module, tp: int) -> str | None:
    """Why ``model`` cannot take the Llama-shaped plan at ``tp`` ranks (None: it can)."""
    config = model.config
    base = getattr(model, "model", None)
    kind = getattr(config, "model_type", type(model).__name__)
    if base is None or not isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        return f"{kind} has no model.embed_tokens embedding"
    if type(model.get_output_embeddings()) is not nn.Linear or not _is_norm(getattr(base, "norm", nn.Identity())):
        return f"{kind} has no final norm and plain Linear LM head"
    for layer in decoder_layers(model):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if mlp is not None and any("expert" in n for n, _ in mlp.named_modules()):
            return (f"{kind} has mixture-of-experts layers (experts are not split by tensor parallelism here: "
                    "expert parallelism is not built)")
        if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in _ATTENTION):
            return f"{kind}'s attention has no separate q/k/v/o projections (fused or latent attention)"
        if mlp is None or not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in _MLP):
            return f"{kind}'s MLP has no separate gate/up/down projections (fused)"
        head_dim = getattr(attn, "head_dim", None)
        for name, child in attn.named_children():
            if name in _ATTENTION:
                continue
            if not (_is_norm(child) and getattr(child, "weight", torch.empty(0)).shape == (head_dim,)):
                return f"{kind}'s attention has a {name} ({type(child).__name__}) over more than one head"
        others = [n for n, c in layer.named_children() if n not in ("self_attn", "mlp") and not _is_norm(c)]
        if others:
            return f"{kind}'s decoder layer has {', '.join(others)}, which the plan does not place"
    return None


def check_model(model: nn.Module, tp: int, seq_len: int) -> None:
    """A one-line UserError when ``tp`` ranks cannot split ``model`` (or ``seq_len``-token sequences) this way."""
    why = _why_not(model, tp)
    if why is not None:
        raise UserError(f"distributed.tensor_parallel = {tp}: {why}; accepted: tensor_parallel = 1 for this model, "
                        "or a Llama-shaped family (llama, mistral, qwen2, qwen3, gemma2, granite, smollm3, ...)")
    c = model.config
    for field in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
        value = getattr(c, field, None) or c.num_attention_heads
        if value % tp:
            raise UserError(f"distributed.tensor_parallel = {tp} does not divide the model's {field} = {value} "
                            f"(each rank takes an equal share); accepted: a divisor of {value}")
    if seq_len % tp:
        raise UserError(f"data.seq_len = {seq_len} cannot be split into distributed.tensor_parallel = {tp} equal parts "
                        f"(sequence parallelism shards the tokens between blocks); accepted: a multiple of {tp}")


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``model`` (checked by ``check_model``) over the 1-D "tp" ``mesh``, in place, before FSDP2 wraps it."""
    base = model.model
    tied = model.get_output_embeddings().weight is base.embed_tokens.weight
    for layer in decoder_layers(model):
        plan = {name: SequenceParallel(use_local_output=False)
                for name, child in layer.named_children() if _is_norm(child)}
        # Into attention and the MLP the tokens are gathered (Replicate), out of them reduce-scattered (Shard(1)).
        gather = dict(input_kwarg_layouts={"hidden_states": Shard(1)},
                      desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan["self_attn"] = PrepareModuleInput(**gather)
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"self_attn.{name}"] = ColwiseParallel()
        plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        for name, child in layer.self_attn.named_children():
            if _is_norm(child):  # per head, on [B, T, heads / tp, head_dim]: the heads are the sharded dim
                plan[f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["mlp.gate_proj"] = ColwiseParallel()
        plan["mlp.up_proj"] = ColwiseParallel()
        plan["mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        parallelize_module(layer, mesh, plan)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_children() if m is head)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(use_local_output=False),
        head_name: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    if tied:  # each style distributed its own copy: one Parameter again (same placement, Shard(0) of [V, H])
        head.weight = base.embed_tokens.weight
    # The head's weight is now split on the vocabulary (Shard(0)); the scoring head takes that Parameter over.
    model.set_output_embeddings(VocabParallelHead(head, **_logit_transform(model.config)))


def check_target(model: nn.Module, tp: int, draft_kind: str) -> None:
    """A one-line UserError when a draft run's frozen target cannot be split over ``tp`` ranks for its forward."""
    if draft_kind == "glide":
        raise UserError(f"distributed.tensor_parallel = {tp} with draft.kind = 'glide': GLIDE reads the target's "
                        "per-head K/V, which tensor parallelism splits over the ranks; accepted: tensor_parallel = 1, "
                        "or draft.kind = 'eagle3', 'dflash', 'dflash2', 'dspark', 'lilicorr' or 'xpress' (they read "
                        "hidden states, whole on every rank)")
    why = _why_not(model, tp)
    if why is not None:
        raise UserError(f"distributed.tensor_parallel = {tp}: the target: {why}; accepted: tensor_parallel = 1 for "
                        "this target, or a Llama-shaped family (llama, mistral, qwen2, qwen3, gemma2, granite, ...)")
    c = model.config
    for field in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(c, field, None) or c.num_attention_heads
        if value % tp:
            raise UserError(f"distributed.tensor_parallel = {tp} does not divide the target's {field} = {value}; "
                            f"accepted: a divisor of {value}")


def apply_target_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split a draft run's frozen target (``model``: its HF causal LM) over the "tp" ``mesh`` for its forward, in
    place: the decoder layers' q/k/v and gate/up column-wise, o and down row-wise with their output all-reduced
    (replicated), so every block's input and output, the hidden states a draft reads and the logits stay whole
    tensors on every rank. No sequence parallelism: the acceptance evaluation decodes one token at a time, which
    cannot be split on the sequence. The embedding, final norm and LM head stay whole (the draft shares them)."""
    for layer in decoder_layers(model):
        plan = {f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
        plan["self_attn.o_proj"] = RowwiseParallel()
        for name, child in layer.self_attn.named_children():
            if _is_norm(child):  # per head, on [B, T, heads / tp, head_dim]: local heads, the weight whole
                plan[f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                     "mlp.down_proj": RowwiseParallel()})
        parallelize_module(layer, mesh, plan)


class VocabParallelHead(ChunkedLMHead):
    """The LM head on vocabulary shards: while scoring (``chunked_ce.scoring`` sets labels, as for the chunked head,
    so the step and evaluation need no other path) it returns each token's cross-entropy as a plain [B, L] tensor,
    computed on logits that stay split over "tp" (under ``loss_parallel``: each rank its vocabulary columns, a
    distributed log-sum-exp). Without labels it returns the whole logits (generation, tests), gathered."""

    def __init__(self, head: nn.Linear, **transform):
        super().__init__(head, chunk_tokens=0, **transform)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The sequence is gathered (its tokens were sharded between blocks); the logits come out Shard(-1).
        hidden = hidden.redistribute(placements=[Replicate()]) if isinstance(hidden, DTensor) else hidden
        logits = F.linear(hidden, self.weight, self.bias)
        if self.labels is None:  # the model's forward applies its own logit transform (scoring turns it off)
            return logits.full_tensor()
        logits = transformed_logits(logits, self.softcap, self.scale)
        labels = self.labels
        ce = F.cross_entropy(at_least_fp32(logits).flatten(0, 1), labels.flatten(), ignore_index=self.ignore_index,
                             reduction="none")
        # Replicated on every rank of "tp" (each holds the same rows): its local value is the loss, and autograd
        # through to_local hands the same gradient to every rank, as one process's. A copy, not a view: FSDP2's
        # root would warn that an in-place op on a returned view skips its backward hook ([B, L]: small).
        return (ce.to_local() if isinstance(ce, DTensor) else ce).reshape(labels.shape).clone()


@contextlib.contextmanager
def vocabulary_parallel_loss() -> Iterator[None]:
    """Around forward and backward: cross-entropy on vocabulary-sharded logits (loss_parallel's forward and its
    backward both dispatch through it)."""
    with loss_parallel():
        yield
