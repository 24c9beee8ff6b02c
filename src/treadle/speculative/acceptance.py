"""Acceptance of a draft (GLIDE, EAGLE-3) measured without running the decode loop.

On text the target itself generated greedily, the target's greedy token at every
position is, by construction, the next token of the text. A greedy speculative step
that starts with the bonus token at index s proposes, at chain step k, the draft's
argmax at index s + k - 1 with lag k (the target has processed indices < s) and
accepts it iff it equals token s + k. With one forward of the draft per lag over the
whole text (``model.chain_guesses``: per lag for GLIDE, per training-time-test step for
EAGLE-3), every start s is scored at once; because the draft's one layer makes its
self-attention state depend only on the tokens and the target, this is what the decode loop would do
from each start, not an approximation of it (up to ties in the argmax).

tau_sim averages over every start, whereas a real decode visits only the starts its
own acceptances lead to, so the two differ a little on short texts. ``tau_decode`` walks
the starts a decode visits (the first generated token, then one past each round's
accepted drafts and bonus): on the same prompts, at the same precision, it is the tau
``treadle spec-eval`` measures with ``--max-new-tokens`` = new tokens - gamma + 1 (the
rounds whose chains fit in the texts), exactly up to argmax ties.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def chain_acceptance(model, texts: torch.Tensor, prompt_len: int, gamma: int) -> dict:
    """Per-position acceptance and tau_sim of a draft model's (``chain_guesses``) on target-greedy ``texts``.

    Starts are the generated indices s >= prompt_len that leave room for a full chain.
    Returns ``tau_sim`` (= 1 + sum of unconditional rates), ``acceptance_conditional``
    (P(step k accepted | steps < k accepted)), ``acceptance_unconditional`` and ``tau_decode``
    (the starts a greedy decode of each text visits; module docstring).
    """
    length = texts.shape[1]
    starts = torch.arange(prompt_len, length - gamma, device=texts.device)
    if len(starts) == 0:
        raise ValueError(f"texts of length {length} leave no start after a {prompt_len}-token prompt for gamma {gamma}")
    chain = []
    for k, guess in enumerate(model.chain_guesses(texts, gamma), start=1):  # [N, L]: guess for index i + 1
        hit = guess[:, :-1] == texts[:, 1:]
        chain.append(hit[:, starts + k - 1])  # chain step k from start s predicts token s + k
    accepted = torch.stack(chain).long().cumprod(0)  # [gamma, N, S]: 1 while every step so far was accepted
    reach = accepted.float().mean(dim=(1, 2))  # P(n >= k)
    previous = torch.cat([reach.new_ones(1), reach[:-1]])
    conditional = torch.where(previous > 0, reach / previous.clamp_min(1e-12), torch.zeros_like(reach))
    return {
        "tau_sim": 1.0 + float(reach.sum()),
        "acceptance_conditional": conditional.tolist(),
        "acceptance_unconditional": reach.tolist(),
        "starts": int(accepted.shape[1] * accepted.shape[2]),
        "tau_decode": decoded_tau(accepted.sum(0)),
    }


def decoded_tau(accepted: torch.Tensor) -> float:
    """tau of the rounds a greedy decode runs, from ``accepted`` [N, S]: drafts accepted by the round whose bonus is
    each start. A round at start s emits its accepted drafts and the bonus, so the next starts s + n + 1."""
    tokens = rounds = 0
    for row in accepted.tolist():
        s = 0
        while s < len(row):
            tokens += row[s] + 1
            rounds += 1
            s += row[s] + 1
    return tokens / rounds


def lookup_tau(texts, prompt_len, gamma: int) -> float | None:
    """tau of prompt lookup (no model: the continuation of the latest earlier n-gram match) on the same texts and
    starts as ``chain_acceptance``. Near gamma + 1 the texts repeat themselves: the target that wrote them loops,
    and any draft reaches the ceiling on it without having learnt much.

    ``texts``: [N, L] ids, or rows of ids of any lengths (spec-eval's prompts and continuations); ``prompt_len``: one
    length for all rows or one per row. None when no row leaves room for a chain after its prompt."""
    from treadle.speculative.decode import leading_matches
    from treadle.speculative.drafters import PromptLookupDrafter

    rows = texts.tolist() if isinstance(texts, torch.Tensor) else [list(row) for row in texts]
    prompt_lens = [prompt_len] * len(rows) if isinstance(prompt_len, int) else list(prompt_len)
    lookup = PromptLookupDrafter()
    steps = []
    for row, start in zip(rows, prompt_lens, strict=True):
        for s in range(start, len(row) - gamma):
            steps.append(1 + leading_matches(lookup.lookup(row[: s + 1], gamma), row[s + 1 : s + 1 + gamma]))
    return sum(steps) / len(steps) if steps else None


# Prompt lookup (no model) gaining half of what a perfect draft gains on the target's own text means that text
# loops. Natural text is far below: the built-in corpus's held-out Python gives tau 1.7 of 5 at gamma 4, an
# under-trained demo target that writes "the the the ..." 3.7.
DEGENERATE_LOOKUP_SHARE = 0.5


def degenerate_target_warning(lookup: float | None, gamma: int, figure: str = "tau_sim",
                              draft_tau: float | None = None, continuations: str = "greedy continuations") -> str | None:
    """One line when prompt lookup's tau (``lookup_tau``) on the target's own continuations of the eval prompts says
    they repeat themselves, else None: the draft run's warning about its ``tau_sim``, and spec-eval's about its
    ``tau`` (``draft_tau``, said beside prompt lookup's; ``continuations``: "sampled continuations" when sampled)."""
    if lookup is None or lookup - 1 < DEGENERATE_LOOKUP_SHARE * gamma:
        return None
    draft = "" if draft_tau is None else f"; the draft's {figure}: {draft_tau:.2f}"
    return (f"treadle: warning: the target looks degenerate: its {continuations} of the eval prompts repeat "
            f"themselves (prompt lookup, with no model, reaches tau {lookup:.2f} of at most {gamma + 1} on them"
            f"{draft}), so a {figure} near its ceiling says little about the draft; use a target that writes varied "
            "text (trained longer, or a real model)")
