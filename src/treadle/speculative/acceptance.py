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

Every start is scored, but a decode visits only the starts its own acceptances lead to:
the first generated token, then one past each round's accepted drafts and bonus. tau_sim
is the tokens per round of that walk (``decoded_rounds``), so on the same prompts at the same
precision it is the tau ``treadle spec-eval`` measures with ``--max-new-tokens`` = new tokens
- gamma + 1 (the rounds whose chains fit in the texts), exactly up to argmax ties.

The mean over every start (``tau_every_start``, what tau_sim was before issue 41) is not that
figure. Where the draft takes whole chains in some stretches (a loop the target repeats) and
nothing in others, a decode crosses an easy stretch of E tokens in E / (gamma + 1) rounds and
a hard one of H tokens in H rounds: tokens per round is (E + H) / (E / (gamma + 1) + H), 1.67 at
gamma 4 with E = H, while the mean over starts gives ((gamma + 1) E + H) / (E + H) = 3. A barely
trained target's greedy text is exactly such a mix, which is how a GPU run read 3.80 here
against spec-eval's 1.80 (docs/drafts.md, "tau_sim and spec-eval").
"""

from __future__ import annotations

import torch


@torch.no_grad()
def chain_acceptance(model, texts: torch.Tensor, prompt_len: int, gamma: int) -> dict:
    """Per-position acceptance and tau_sim of a draft model's (``chain_guesses``) on target-greedy ``texts``.

    Starts are the generated indices s >= prompt_len that leave room for a full chain; the rounds are those a greedy
    decode of each text runs (module docstring). Returns ``tau_sim`` (tokens per round, bonus included: = 1 + sum of
    unconditional rates), ``acceptance_conditional`` (P(step k accepted | steps < k accepted)),
    ``acceptance_unconditional`` (P(n >= k)), ``rounds``, and ``tau_every_start`` (the mean over every start).
    """
    length = texts.shape[1]
    starts = torch.arange(prompt_len, length - gamma, device=texts.device)
    if len(starts) == 0:
        raise ValueError(f"texts of length {length} leave no start after a {prompt_len}-token prompt for gamma {gamma}")
    chain = []
    for k, guess in enumerate(model.chain_guesses(texts, gamma), start=1):  # [N, L]: guess for index i + 1
        hit = guess[:, :-1] == texts[:, 1:]
        chain.append(hit[:, starts + k - 1])  # chain step k from start s predicts token s + k
    accepted = torch.stack(chain).long().cumprod(0).sum(0)  # [N, S]: drafts a round starting at s accepts
    rounds = decoded_rounds(accepted)
    reached = [sum(n >= k for n in rounds) for k in range(gamma + 1)]  # reached[0]: every round
    return {
        "tau_sim": sum(n + 1 for n in rounds) / len(rounds),
        "acceptance_conditional": [reached[k] / reached[k - 1] if reached[k - 1] else 0.0
                                   for k in range(1, gamma + 1)],
        "acceptance_unconditional": [reached[k] / len(rounds) for k in range(1, gamma + 1)],
        "rounds": len(rounds),
        "tau_every_start": 1.0 + float(accepted.float().mean()),
    }


def decoded_rounds(accepted: torch.Tensor) -> list[int]:
    """Drafts accepted per round of a greedy decode of each row, from ``accepted`` [N, S] (what the round whose bonus
    is each start accepts): the first round starts at 0; one that accepts n drafts emits them and the bonus, so the
    next starts n + 1 later."""
    rounds = []
    for row in accepted.tolist():
        s = 0
        while s < len(row):
            rounds.append(row[s])
            s += row[s] + 1
    return rounds


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
