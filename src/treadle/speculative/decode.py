"""Greedy chain speculative decoding (batch size 1) and the plain greedy baseline.

One round: the drafter proposes ``gamma`` tokens after the accepted sequence;
the target scores ``[bonus, d1..d_gamma]`` in one forward; the leading drafts
that equal the target's argmax are kept, followed by the target's own token at
the first mismatch (or after the last draft). The output is therefore exactly
the target's greedy output, whatever the drafter proposes.

Cache invariant (target and ``ModelDrafter`` alike): the KV cache covers the
accepted sequence minus its last token, the newest "bonus" token, which no
model has processed yet.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache


class Drafter(Protocol):
    """Proposes tokens for the target to verify. One instance serves one sequence at a time."""

    name: str

    def reset(self, prompt_ids: torch.LongTensor) -> None:
        """Start a new sequence; ``prompt_ids`` is [1, P]."""

    def propose(
        self, context_ids: torch.LongTensor, target_kv: tuple[torch.Tensor, torch.Tensor] | None, gamma: int
    ) -> list[int]:
        """Exactly ``gamma`` token ids to follow ``context_ids`` ([1, L], the accepted sequence).

        ``target_kv`` is the target's last decoder layer's post-RoPE keys and
        values for positions 0..L-2 ([1, H_kv, L-1, D] each): the last context
        token (the bonus) has not been through the target yet.
        """

    def accept(self, n_context: int) -> None:
        """The accepted sequence is now ``n_context`` tokens long; drop state beyond that prefix."""


@dataclass
class TargetState:
    """What a drafter that declares ``feature_layers`` (EAGLE-3) gets in place of the bare ``target_kv``."""

    kv: tuple[torch.Tensor, torch.Tensor]
    # [1, n, len(feature_layers) * d]: those output_hidden_states entries for the n tokens the target processed in
    # its latest forward (prefill: the prompt; a verification: the bonus and the accepted drafts).
    hidden: torch.Tensor


@dataclass
class SpecResult:
    """One speculatively decoded sequence."""

    tokens: list[int]  # generated tokens, prompt excluded
    verify_calls: int
    accepted_per_call: list[int]  # accepted drafts per verification call, each in 0..gamma
    gamma: int
    seconds: float  # wall time, prefill included

    @property
    def tau(self) -> float | None:
        """Tokens per verification call, bonus token included (each call adds the target's own token); None without calls."""
        if not self.verify_calls:
            return None
        return sum(n + 1 for n in self.accepted_per_call) / self.verify_calls

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer.

    transformers 5.x's ``DynamicCache.crop`` takes minus the number of tokens
    to remove (a positive argument, the old "final length", raises).
    """
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if extra:
        cache.crop(-extra)


def forward_logits(model: torch.nn.Module, input_ids: torch.LongTensor, cache: DynamicCache) -> torch.Tensor:
    """Logits [T, V] for ``input_ids`` [1, T], appending their K/V to ``cache``.

    Models are built with ``config.use_cache=False`` (packed training needs
    it), so the cache must be asked for explicitly.
    """
    return model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[0]


def _last_layer_kv(cache: DynamicCache, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[-1]
    if layer.keys.shape[-2] != length:
        raise RuntimeError(f"target cache holds {layer.keys.shape[-2]} positions, expected {length}")
    return layer.keys, layer.values


def _check_args(prompt_ids: torch.Tensor, max_new_tokens: int, gamma: int = 1) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [1, P] with P >= 1, got {tuple(prompt_ids.shape)}")
    if max_new_tokens < 1 or gamma < 1:
        raise ValueError(f"max_new_tokens and gamma must be >= 1, got {max_new_tokens} and {gamma}")


def _finished(tokens: list[int], max_new_tokens: int, eos_id: int | None) -> bool:
    # eos may arrive among accepted drafts, not only as a round's last token.
    return len(tokens) >= max_new_tokens or (eos_id is not None and eos_id in tokens)


def _clip(tokens: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Cut at the first eos (kept) and at ``max_new_tokens``: a round may overshoot both."""
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    return tokens[:max_new_tokens]


def leading_matches(draft: list[int], target: list[int]) -> int:
    """How many draft tokens the target accepts: the length of their common prefix."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


def speculative_generate(
    target: torch.nn.Module,
    drafter: Drafter,
    prompt_ids: torch.LongTensor,
    gamma: int,
    max_new_tokens: int,
    eos_id: int | None = None,
) -> SpecResult:
    """Greedy speculative decoding of one prompt; the tokens equal ``target_generate``'s."""
    _check_args(prompt_ids, max_new_tokens, gamma)
    target.eval()
    prompt = prompt_ids[0].tolist()
    accepted: list[int] = []
    start = time.perf_counter()
    layers = getattr(drafter, "feature_layers", None)
    if layers:
        from treadle.models.eagle3 import capture_features
    with torch.inference_mode(), capture_features(target, layers) if layers else contextlib.nullcontext() as tap:
        # A bare DynamicCache holds full (croppable) layers even for models with
        # sliding-window layers, so layers[-1] always covers the whole prefix.
        cache = DynamicCache()
        drafter.reset(prompt_ids)
        # The prefill's token is the first bonus; it is not a verification call.
        tokens = [int(forward_logits(target, prompt_ids, cache)[-1].argmax())]
        fresh = tap.take() if tap else None  # features of the tokens the last target forward processed
        while not _finished(tokens, max_new_tokens, eos_id):
            context = prompt + tokens
            target_kv = _last_layer_kv(cache, len(context) - 1)
            state = TargetState(target_kv, fresh) if tap else target_kv
            draft = drafter.propose(torch.tensor([context]), state, gamma)
            if len(draft) != gamma:
                raise RuntimeError(f"drafter {drafter.name!r} proposed {len(draft)} tokens, expected {gamma}")
            verify = torch.tensor([[tokens[-1], *draft]])
            # choice[i] is the target's greedy token after verify[:i+1].
            choice = forward_logits(target, verify, cache).argmax(-1).tolist()
            n = leading_matches(draft, choice)
            fresh = tap.take()[:, : n + 1] if tap else None  # the bonus and the accepted drafts
            tokens += draft[:n] + [choice[n]]
            accepted.append(n)
            # The target has now processed the accepted sequence minus the new bonus.
            crop_cache(cache, len(context) + n)
            drafter.accept(len(context) + n + 1)
    seconds = time.perf_counter() - start
    return SpecResult(_clip(tokens, max_new_tokens, eos_id), len(accepted), accepted, gamma, seconds)


def target_generate(
    target: torch.nn.Module, prompt_ids: torch.LongTensor, max_new_tokens: int, eos_id: int | None = None
) -> tuple[list[int], float]:
    """Plain greedy decoding, one token per forward with a KV cache: (tokens, wall seconds)."""
    _check_args(prompt_ids, max_new_tokens)
    target.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        tokens = [int(forward_logits(target, prompt_ids, cache)[-1].argmax())]
        while not _finished(tokens, max_new_tokens, eos_id):
            tokens.append(int(forward_logits(target, torch.tensor([[tokens[-1]]]), cache)[-1].argmax()))
    return tokens, time.perf_counter() - start


def summarize(results: list[SpecResult], gamma: int) -> dict:
    """Acceptance statistics over all verification calls of ``results``.

    ``tau`` is tokens per verification call, bonus token included, so
    ``tau == 1 + sum(acceptance_unconditional)`` (E[n+1] = 1 + sum_k P(n >= k)).
    Rates that are undefined (no calls, or no call reached position k-1) are None.
    """
    accepted = [n for r in results for n in r.accepted_per_call]
    calls = len(accepted)
    reached = [sum(n >= k for n in accepted) for k in range(gamma + 1)]  # reached[0] == calls
    return {
        "gamma": gamma,
        "tau": sum(n + 1 for n in accepted) / calls if calls else None,
        "acceptance_conditional": [reached[k] / reached[k - 1] if reached[k - 1] else None for k in range(1, gamma + 1)],
        "acceptance_unconditional": [reached[k] / calls if calls else None for k in range(1, gamma + 1)],
        "verify_calls": calls,
        "generated_tokens": sum(len(r.tokens) for r in results),
    }
