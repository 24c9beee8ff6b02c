"""Chunked cross-entropy: the LM head and the loss computed a few tokens at a time.

A causal LM's last step, ``logits = lm_head(hidden)`` followed by a cross-entropy, holds
``[tokens, vocab]`` logits and, in backward, their gradient: at a 128k vocabulary that is
the largest tensor of a step by far. ``ChunkedLMHead`` takes the place of ``lm_head``
(the same weight ``Parameter``, so the same state-dict key and the same tie to the input
embedding) and, while labels are set on it (``scoring``), returns each token's
cross-entropy instead of logits. It calls torch's own ``F.linear_cross_entropy`` with
``reduction="none"``: the forward computes ``chunk_tokens`` rows of logits at a time and
keeps only the loss; the backward recomputes them chunk by chunk. That op appeared in torch 2.13; on an older torch
(``treadle.compat.HAS_LINEAR_CROSS_ENTROPY`` false) the head runs ``_ChunkedCrossEntropy``, the same chunking with its
backward written here, which gives the same numbers (tested in float64 on the oldest supported torch).

A model whose forward soft-caps (Gemma 2/3) or scales (Granite) its logits gets a head that applies the same
transform inside each chunk, while its forward is told to skip its own (``scoring`` sets the config field to its
neutral value and restores it): a scale keeps the fused op (its input divided), a soft-cap (a nonlinearity the fused
op cannot apply) runs ``_ChunkedCrossEntropy``.

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

from treadle import compat
from treadle.errors import UserError
from treadle.models.upcast import at_least_fp32

# At and above this vocabulary ``model.loss_chunk_tokens = "auto"`` turns the chunked loss on. Measured
# (docs/benchmarks.md, bench/memory.py): at 32k the chunked step is as fast as the naive one and its loss part
# takes about a quarter of the memory; at 8k (the built-in tokenizer) it is slower and the logits are small.
AUTO_MIN_VOCAB = 32_000
AUTO_CHUNK_TOKENS = 1024  # rows of logits per chunk: 1024 x 128k fp32 = 0.5 GiB, a few % of the naive logits


class ChunkedLMHead(nn.Module):
    """An ``lm_head`` that returns per-token cross-entropy ([B, L], fp32) while ``labels`` is set.

    ``softcap`` / ``scale``: the model's own transform of its logits (Gemma 2/3 ``cap * tanh(logits / cap)``,
    Granite ``logits / logits_scaling``), applied here inside each chunk; while scoring, the model's forward is
    told not to apply it again (``neutral``: the config fields set to what makes its transform the identity).
    """

    def __init__(self, head: nn.Linear, chunk_tokens: int, ignore_index: int = -100, *, softcap: float | None = None,
                 scale: float | None = None, neutral: tuple = ()):
        super().__init__()
        self.weight = head.weight  # the same Parameter: its key, its tie to the embedding and its sharding stay
        self.bias = head.bias
        self.chunk_tokens = chunk_tokens
        self.ignore_index = ignore_index
        self.softcap = softcap
        self.scale = scale  # the divisor of the logits (Granite's logits_scaling)
        self.neutral = neutral  # ((config, field, neutral value), ...): a plain tuple, never a registered module
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
        # The head's matmuls in the precision the model computes in (autocast's dtype, or bf16 parameters), as the
        # plain head runs them: in fp32 they took a third of an H200's 1.1B step (6.6 TFLOP a step at fp32's peak).
        # The softmax and each token's loss in fp32 whatever the model computes in: torch's fused op returns the loss
        # in its input's dtype (bf16 would round every token's loss to 8 bits), so a low-precision matmul runs here.
        device = hidden.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        low = low if low in (torch.bfloat16, torch.float16) else None
        weight = at_least_fp32(self.weight)
        bias = at_least_fp32(self.bias) if self.bias is not None else None
        flat, targets = at_least_fp32(hidden.flatten(0, -2)), labels.flatten()
        with torch.autocast(device, enabled=False):
            # A soft-cap is a nonlinearity after the head that torch's fused op cannot apply; torch < 2.13 has no op.
            if low is not None or self.softcap is not None or not compat.HAS_LINEAR_CROSS_ENTROPY:
                loss = _ChunkedCrossEntropy.apply(flat, weight, bias, targets, self.chunk_tokens,
                                                  self.ignore_index, self.softcap, self.scale, low)
            else:
                if self.scale is not None:  # (h W^T + b) / s = (h / s) W^T + b / s: the fused op stays
                    flat = flat / self.scale
                    bias = bias / self.scale if bias is not None else None
                loss = F.linear_cross_entropy(
                    flat, weight, targets, linear_bias=bias, reduction="none", ignore_index=self.ignore_index,
                    # An explicit size: torch's "auto" sizing is ~3x slower on CPU fp32 (research/scale-apis.md 3.1).
                    options=nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=self.chunk_tokens))
        return loss.view(labels.shape)


def _capped_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None,
                   scale: float | None) -> torch.Tensor:
    """One chunk's logits as the HF models compute them: ``linear`` (in fp32 at least), ``/ scale``, then ``/ cap,
    tanh, * cap``."""
    return transformed_logits(at_least_fp32(F.linear(hidden, weight, bias)), softcap, scale)


def _lowered(low: torch.dtype | None, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The head's operands for its matmuls: cast to ``low`` (autocast's dtype) once per call, or as they are."""
    return [t.to(low) if low is not None and t is not None else t for t in tensors]


def transformed_logits(logits: torch.Tensor, softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """A head's output (consumed: changed in place where autograd records nothing) as the model's forward transforms
    it: ``/ scale``, then ``/ cap, tanh, * cap`` (None: not applied). Out of place where autograd needs the steps."""
    grad = torch.is_grad_enabled() and logits.requires_grad
    if scale is not None:
        logits = logits / scale if grad else logits.div_(scale)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap if grad else logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def model_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """A head's output (consumed) as ``config``'s model's forward transforms it (``_LOGIT_TRANSFORMS_HANDLED``): what
    a draft scoring its hidden states through its target's head (GLIDE) must apply to be scored as the target is."""
    transform = _logit_transform(config)
    return transformed_logits(logits, transform.get("softcap"), transform.get("scale"))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token CE of (optionally scaled, then soft-capped) logits, ``chunk_tokens`` rows at a time, no
    [tokens, vocab] tensor kept.

    The forward keeps each row's log-sum-exp; the backward recomputes each chunk's logits once and writes its
    gradient by hand (softmax - one-hot, times the cap's derivative 1 - tanh^2 when capped): one matmul forward and
    three backward, as torch's fused linear cross-entropy does. (Checkpointing the chunks through autograd took 2.3x the
    fused op's time on CPU: a second forward per chunk and every elementwise op's saved buffers.)
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens: int, ignore_index: int, softcap: float | None,
                scale: float | None, low: torch.dtype | None = None):
        valid = labels != ignore_index
        target = labels.where(valid, 0)
        lse = hidden.new_empty(labels.shape)
        loss = hidden.new_empty(labels.shape)
        h, w, b = _lowered(low, hidden, weight, bias)
        for start in range(0, labels.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            z = _capped_logits(h[rows], w, b, softcap, scale)
            lse[rows] = torch.logsumexp(z, -1)
            loss[rows] = lse[rows] - z.gather(1, target[rows, None]).squeeze(1)
        ctx.save_for_backward(hidden, weight, bias, target, valid, lse)
        ctx.chunk_tokens, ctx.softcap, ctx.scale, ctx.low = chunk_tokens, softcap, scale, low
        return loss.masked_fill_(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, valid, lse = ctx.saved_tensors
        softcap, scale = ctx.softcap, ctx.scale
        g = grad_loss * valid
        if scale is not None:
            g = g / scale  # d(logits / scale) / d(logits)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        hidden, weight, bias = _lowered(ctx.low, hidden, weight, bias)  # the grads stay in the inputs' dtypes
        for start in range(0, target.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h = hidden[rows]
            u = at_least_fp32(F.linear(h, weight, bias))
            if scale is not None:
                u.div_(scale)
            if softcap is None:
                dz = u.sub_(lse[rows, None]).exp_()  # the softmax, in place of the logits
            else:
                t = u.div_(softcap).tanh_()  # in place: the pre-cap logits are no longer needed
                dz = torch.mul(t, softcap).sub_(lse[rows, None]).exp_()  # softmax of the capped logits
            dz[torch.arange(dz.shape[0], device=dz.device), target[rows]] -= 1.0
            dz.mul_(g[rows, None])
            if softcap is not None:
                dz.mul_(t.mul_(t).neg_().add_(1.0))  # d(cap * tanh(u / cap)) / du = 1 - tanh^2
            if grad_b is not None:
                grad_b += dz.sum(0)
            dz = dz.to(weight.dtype)  # the matmuls in the head's compute dtype (fp32 or wider: unchanged)
            if grad_h is not None:
                grad_h[rows] = dz @ weight
            if grad_w is not None:
                if dz.dtype == grad_w.dtype:
                    grad_w.addmm_(dz.t(), h)
                else:  # each chunk's low-precision product summed in the grad's fp32
                    grad_w += dz.t() @ h
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chunked_head(model: nn.Module) -> ChunkedLMHead | None:
    """The model's chunked head, looked up through any wrapper (DDP, DeepSpeed's engine, FSDP2)."""
    return next((m for m in model.modules() if isinstance(m, ChunkedLMHead)), None)


@contextlib.contextmanager
def scoring(head: ChunkedLMHead, labels: torch.Tensor) -> Iterator[ChunkedLMHead]:
    """While inside, the head returns each token's cross-entropy against ``labels`` instead of logits."""
    head.labels = labels
    before = [(obj, field, getattr(obj, field)) for obj, field, _ in head.neutral]
    for obj, field, value in head.neutral:  # the head applies the model's logit transform; its forward must not
        setattr(obj, field, value)
    try:
        yield head
    finally:
        head.labels = None
        for obj, field, value in before:
            setattr(obj, field, value)


def resolve_chunk_tokens(setting: int | str, vocab_size: int) -> int:
    """``model.loss_chunk_tokens`` for a vocabulary: "auto" -> on (AUTO_CHUNK_TOKENS) from AUTO_MIN_VOCAB up; 0 = off."""
    if setting == "auto":
        return AUTO_CHUNK_TOKENS if vocab_size >= AUTO_MIN_VOCAB else 0
    return int(setting)


def use_chunked_loss(model: nn.Module, chunk_tokens: int, ignore_index: int = -100, explicit: bool = True) -> bool:
    """Replace ``model``'s LM head by a ``ChunkedLMHead`` (before any engine wraps it); True if it was.

    A model whose forward soft-caps or scales its logits in a way read here (``_LOGIT_TRANSFORMS_HANDLED``: Gemma 2/3,
    Granite) gets a head that applies that transform inside each chunk. Refused (``UserError`` if ``explicit``, else
    left unchunked) for a model whose forward changes the head's output in any other way (the loss would no longer be
    the model's own), or whose head is not a plain ``nn.Linear``.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    why = None
    if type(head) is not nn.Linear:
        why = f"its output layer is {type(head).__name__}, not a plain Linear"
    elif not _forward_returns_head_output(model):
        unknown = unhandled_logit_transforms(model.config)
        why = ("its forward transforms the LM head's output (a logit soft-cap or scale"
               + (f": {', '.join(unknown)}" if unknown else "") + ") in a way the chunked loss does not apply for "
               f"model_type {getattr(model.config, 'model_type', None)!r}")
    else:
        model.set_output_embeddings(ChunkedLMHead(head, chunk_tokens, ignore_index, **_logit_transform(model.config)))
    if why is None:
        return True
    if explicit:
        raise UserError(f"model.loss_chunk_tokens: {type(model).__name__} cannot use the chunked loss: {why}; "
                        "accepted: model.loss_chunk_tokens = 0 for this model")
    return False


# Config fields of HF models whose forward changes the head's output; read only where no forward can tell.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping")
# The transforms the chunked head applies itself, by model_type, as each family's modeling code (transformers 5.x)
# writes them right after ``logits = self.lm_head(hidden_states)``:
#   softcap: ``logits / config.final_logit_softcapping; tanh; * config.final_logit_softcapping`` (skipped when None)
#   scale:   ``logits / config.logits_scaling``
_LOGIT_TRANSFORMS_HANDLED = {
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma"), ("final_logit_softcapping", "softcap", None)),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
                     "granitemoe_swa"), ("logits_scaling", "scale", 1.0)),
}


def _logit_transform(config) -> dict:
    """The ``ChunkedLMHead`` arguments that apply ``config``'s model's logit transform inside the head."""
    handled = _LOGIT_TRANSFORMS_HANDLED.get(getattr(config, "model_type", None))
    if handled is None:
        return {}
    field, kind, neutral = handled
    value = getattr(config, field, None)
    if value is None or value == neutral:
        return {}
    return {kind: float(value), "neutral": ((config, field, neutral),)}


def unhandled_logit_transforms(config) -> list[str]:
    """The logit-transform fields set in ``config`` that the chunked head does not apply for its model_type."""
    handled = _LOGIT_TRANSFORMS_HANDLED.get(getattr(config, "model_type", None), (None,))[0]
    return [f"{key} = {getattr(config, key)}" for key in _LOGIT_TRANSFORMS
            if key != handled and getattr(config, key, None) not in (None, 0, 1, 1.0, False)]


def _forward_returns_head_output(model: nn.Module) -> bool:
    """Whether the model's forward, its own logit transform turned off while scoring (``ChunkedLMHead.neutral``),
    hands a ``ChunkedLMHead``'s output back as ``logits`` unchanged.

    One 2-token forward with the head replaced: of the model itself when its weights are there (the values compared),
    else (built on the meta device for sharded loading, or partitioned by ZeRO-3) of a meta-device twin of its config,
    which computes shapes only (the same tensor, or a transform the head applies). A twin some op cannot run on meta
    (MoE's grouped matmuls) is judged by its config's fields.
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
    transform = _logit_transform(subject.config)
    chunked = ChunkedLMHead(head, 1, **transform)
    subject.set_output_embeddings(chunked)
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    seen = []
    hook = chunked.register_forward_hook(lambda module, args, output: seen.append(output))
    was_training = subject.training
    subject.eval()
    try:
        with torch.no_grad(), scoring(chunked, torch.zeros_like(ids)):
            out = subject(input_ids=ids, use_cache=False, attention_mask=mask)
        logits = getattr(out, "logits", None)
        if not seen or logits is None:
            return False
        if whole:  # values: a neutralized ``logits / 1.0`` is another tensor holding the same numbers
            return logits is seen[-1] or torch.equal(logits, seen[-1])
        return logits is seen[-1] or (bool(transform) and not unhandled_logit_transforms(model.config))
    except RuntimeError:
        if whole:
            raise
        return not unhandled_logit_transforms(model.config)
    finally:
        hook.remove()
        subject.set_output_embeddings(head)
        subject.train(was_training)


def _chunk_scores(hidden: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  ignore_index: int, softcap: float | None = None, scale: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's per-token CE, KL(teacher || student), the teacher's CE and top-1 agreement (the student's argmax
    is the teacher's, on labelled rows); softmaxes in fp32; both models' logits transformed (``softcap`` /
    ``scale``) inside the chunk as the model's forward transforms its head's output."""
    logp = F.log_softmax(at_least_fp32(_capped_logits(hidden, weight, None, softcap, scale)), -1)
    with torch.no_grad():  # the teacher is fixed: recomputed in backward, never differentiated
        teacher_logp = F.log_softmax(at_least_fp32(_capped_logits(teacher_hidden, weight, None, softcap, scale)), -1)
    valid = labels != ignore_index
    ce = F.nll_loss(logp, labels, ignore_index=ignore_index, reduction="none")
    kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="none").sum(-1) * valid
    teacher_ce = F.nll_loss(teacher_logp, labels, ignore_index=ignore_index, reduction="none")
    hit = (logp.detach().argmax(-1) == teacher_logp.argmax(-1)) & valid
    return ce, kl, teacher_ce, hit


def chunked_distillation_scores(hidden: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor,
                                labels: torch.Tensor, chunk_tokens: int, ignore_index: int = -100, config=None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ([B, L]) CE of the student, KL(teacher || student), CE of the teacher and top-1 agreement (bool:
    the student's argmax is the teacher's, on labelled rows), through one shared head
    ``weight``, ``chunk_tokens`` rows at a time (``chunked_rows``), so neither model's [tokens, vocab] logits exist
    whole. ``config``: the head's model's, whose logit transform (soft-cap, scale: ``_logit_transform``) each chunk
    applies.

    torch's fused ``linear_cross_entropy`` has no KL; this is the same chunking written with ``checkpoint``.
    Call it inside a module's forward (sharded weights are gathered there).
    """
    transform = _logit_transform(config) if config is not None else {}
    cap_scale = (transform.get("softcap"), transform.get("scale"))
    scores = chunked_rows(lambda h, t, y: _chunk_scores(h, t, weight, y, ignore_index, *cap_scale),
                          [hidden.flatten(0, -2), teacher_hidden.flatten(0, -2), labels.flatten()], chunk_tokens)
    return tuple(s.view(labels.shape) for s in scores)


def chunked_rows(fn, rows: list[torch.Tensor], chunk_tokens: int) -> tuple[torch.Tensor, ...]:
    """``fn(*chunk)`` over ``chunk_tokens`` rows of ``rows`` (tensors sharing their first dimension) at a time, its
    per-row results concatenated. While a gradient is wanted each chunk runs under activation checkpointing, so what
    ``fn`` makes inside (a chunk's [rows, vocab] logits) is recomputed in backward, never kept."""
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled() and any(x.requires_grad for x in rows)
    parts = []
    for start in range(0, rows[0].shape[0], chunk_tokens):
        chunk = [x[start:start + chunk_tokens] for x in rows]
        parts.append(checkpoint(fn, *chunk, use_reentrant=False) if grad else fn(*chunk))
    return tuple(torch.cat(p) for p in zip(*parts))
