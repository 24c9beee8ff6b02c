"""Chunked cross-entropy: the LM head and the loss computed a few tokens at a time.

A causal LM's last step, ``logits = lm_head(hidden)`` followed by a cross-entropy, holds
``[tokens, vocab]`` logits and, in backward, their gradient: at a 128k vocabulary that is
the largest tensor of a step by far. ``ChunkedLMHead`` takes the place of ``lm_head``
(the same weight ``Parameter``, so the same state-dict key and the same tie to the input
embedding) and, while labels are set on it (``scoring``), returns each token's
cross-entropy instead of logits. It calls torch's own ``F.linear_cross_entropy`` with
``reduction="none"``: the forward computes ``chunk_tokens`` rows of logits at a time and
keeps only the loss; the backward recomputes them chunk by chunk (torch >= 2.13).

Why a replacement head and not a loss after the model: every engine gathers a sharded
weight only inside a module's forward (FSDP2 around the root's forward, ZeRO-3 around
each module's, DDP prepares its reducer in its forward), so the head must run inside the
model's ordinary forward. Without labels the head is a plain linear layer: generation,
export and evaluation of logits are unchanged.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from treadle.errors import UserError
from treadle.models.upcast import at_least_fp32

# At and above this vocabulary ``model.loss_chunk_tokens = "auto"`` turns the chunked loss on. Measured
# (docs/benchmarks.md, bench/memory.py): at 32k the chunked step is as fast as the naive one and its loss part
# takes about a quarter of the memory; at 8k (the built-in tokenizer) it is slower and the logits are small.
AUTO_MIN_VOCAB = 32_000
AUTO_CHUNK_TOKENS = 1024  # rows of logits per chunk: 1024 x 128k fp32 = 0.5 GiB, a few % of the naive logits


class ChunkedLMHead(nn.Module):
    """An ``lm_head`` that returns per-token cross-entropy ([B, L], fp32) while ``labels`` is set."""

    def __init__(self, head: nn.Linear, chunk_tokens: int, ignore_index: int = -100):
        super().__init__()
        self.weight = head.weight  # the same Parameter: its key, its tie to the embedding and its sharding stay
        self.bias = head.bias
        self.chunk_tokens = chunk_tokens
        self.ignore_index = ignore_index
        self.labels: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return F.linear(hidden, self.weight, self.bias)
        labels = self.labels
        if hidden.shape[:-1] != labels.shape:
            raise RuntimeError(f"chunked loss: hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
        # fp32 whatever the model computes in: torch's chunked op returns the loss in its input's dtype
        # (bf16 would round every token's loss to 8 bits), and autocast must not lower it again.
        weight = at_least_fp32(self.weight)
        bias = at_least_fp32(self.bias) if self.bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            loss = F.linear_cross_entropy(
                at_least_fp32(hidden.flatten(0, -2)), weight, labels.flatten(), linear_bias=bias, reduction="none",
                ignore_index=self.ignore_index,
                # An explicit size: torch's "auto" sizing is ~3x slower on CPU fp32 (research/scale-apis.md 3.1).
                options=nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=self.chunk_tokens))
        return loss.view(labels.shape)


def chunked_head(model: nn.Module) -> ChunkedLMHead | None:
    """The model's chunked head, looked up through any wrapper (DDP, DeepSpeed's engine, FSDP2)."""
    return next((m for m in model.modules() if isinstance(m, ChunkedLMHead)), None)


@contextlib.contextmanager
def scoring(head: ChunkedLMHead, labels: torch.Tensor) -> Iterator[ChunkedLMHead]:
    """While inside, the head returns each token's cross-entropy against ``labels`` instead of logits."""
    head.labels = labels
    try:
        yield head
    finally:
        head.labels = None


def resolve_chunk_tokens(setting: int | str, vocab_size: int) -> int:
    """``model.loss_chunk_tokens`` for a vocabulary: "auto" -> on (AUTO_CHUNK_TOKENS) from AUTO_MIN_VOCAB up; 0 = off."""
    if setting == "auto":
        return AUTO_CHUNK_TOKENS if vocab_size >= AUTO_MIN_VOCAB else 0
    return int(setting)


def use_chunked_loss(model: nn.Module, chunk_tokens: int, ignore_index: int = -100, explicit: bool = True) -> bool:
    """Replace ``model``'s LM head by a ``ChunkedLMHead`` (before any engine wraps it); True if it was.

    Refused (``UserError`` if ``explicit``, else left unchunked) for a model whose forward changes the
    head's output (a logit soft-cap or scale: the loss is no longer a cross-entropy of a linear layer),
    or whose head is not a plain ``nn.Linear``.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    why = None
    if type(head) is not nn.Linear:
        why = f"its output layer is {type(head).__name__}, not a plain Linear"
    elif not _forward_returns_head_output(model):
        why = "its forward transforms the LM head's output (e.g. a logit soft-cap or scale)"
    else:
        model.set_output_embeddings(ChunkedLMHead(head, chunk_tokens, ignore_index))
    if why is None:
        return True
    if explicit:
        raise UserError(f"model.loss_chunk_tokens: {type(model).__name__} cannot use the chunked loss: {why}; "
                        "accepted: model.loss_chunk_tokens = 0 for this model")
    return False


# Config fields of HF models whose forward changes the head's output; read only where no forward can tell.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping")


def _forward_returns_head_output(model: nn.Module) -> bool:
    """Whether the model's forward hands a ``ChunkedLMHead``'s output back as ``logits`` untouched.

    One 2-token forward with the head replaced: of the model itself when its weights are there, else (built on the
    meta device for sharded loading, or partitioned by ZeRO-3) of a meta-device twin of its config, which computes
    shapes only. A twin some op cannot run on meta (MoE's grouped matmuls) is judged by its config's fields.
    """
    weight = model.get_output_embeddings().weight
    whole = not weight.is_meta and not hasattr(weight, "ds_id")  # ds_id: a ZeRO-3 partition, not the weight
    if whole:
        subject, device, mask = model, weight.device, None
    else:
        with torch.device("meta"):
            subject = type(model)(copy.deepcopy(model.config))
        # A 4-D mask: HF builds a 2-D one by reading values (packed-sequence detection), which meta tensors lack.
        device, mask = torch.device("meta"), torch.zeros(1, 1, 2, 2, device="meta")
    head = subject.get_output_embeddings()
    chunked = ChunkedLMHead(head, 1)
    subject.set_output_embeddings(chunked)
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    seen = []
    hook = chunked.register_forward_hook(lambda module, args, output: seen.append(output))
    was_training = subject.training
    subject.eval()
    try:
        with torch.no_grad(), scoring(chunked, torch.zeros_like(ids)):
            out = subject(input_ids=ids, use_cache=False, attention_mask=mask)
        return bool(seen) and getattr(out, "logits", None) is seen[-1]
    except RuntimeError:
        if whole:
            raise
        return not any(getattr(model.config, key, None) for key in _LOGIT_TRANSFORMS)
    finally:
        hook.remove()
        subject.set_output_embeddings(head)
        subject.train(was_training)


def _chunk_scores(hidden: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's per-token CE, KL(teacher || student) and the teacher's CE; softmaxes in fp32."""
    logp = F.log_softmax(at_least_fp32(F.linear(hidden, weight)), -1)
    with torch.no_grad():  # the teacher is fixed: recomputed in backward, never differentiated
        teacher_logp = F.log_softmax(at_least_fp32(F.linear(teacher_hidden, weight)), -1)
    valid = labels != ignore_index
    ce = F.nll_loss(logp, labels, ignore_index=ignore_index, reduction="none")
    kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="none").sum(-1) * valid
    teacher_ce = F.nll_loss(teacher_logp, labels, ignore_index=ignore_index, reduction="none")
    return ce, kl, teacher_ce


def chunked_distillation_scores(hidden: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor,
                                labels: torch.Tensor, chunk_tokens: int, ignore_index: int = -100
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ([B, L]) CE of the student, KL(teacher || student) and CE of the teacher, through one shared head
    ``weight``, ``chunk_tokens`` rows at a time: each chunk's logits (student's and teacher's) are recomputed in
    backward (activation checkpointing per chunk), so neither model's [tokens, vocab] logits exist whole.

    torch's fused ``linear_cross_entropy`` has no KL; this is the same chunking written with ``checkpoint``.
    Call it inside a module's forward (sharded weights are gathered there).
    """
    from torch.utils.checkpoint import checkpoint

    flat = [hidden.flatten(0, -2), teacher_hidden.flatten(0, -2), labels.flatten()]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, flat[2].shape[0], chunk_tokens):
        h, t, y = (x[start:start + chunk_tokens] for x in flat)
        parts.append(checkpoint(_chunk_scores, h, t, weight, y, ignore_index, use_reentrant=False) if grad
                     else _chunk_scores(h, t, weight, y, ignore_index))
    return tuple(torch.cat(p).view(labels.shape) for p in zip(*parts))
