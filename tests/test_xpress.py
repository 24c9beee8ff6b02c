"""XPress: the refiner's Jacobi passes in training, tau_sim and the drafter agree (float64), lossless greedy and
distribution-correct sampled decoding, the objective (its terms, chunked = whole), the speculators layout both ways
(and speculators' own loader at the oldest end), and a run end to end (train, resume, export, init, spec-eval)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TARGET, assert_greedy_lossless, draft_args, records
from tests.test_speculators_format import SPECULATORS, _runnable
from treadle.cli import main
from treadle.config import DraftConfig
from treadle.drafts.targets import capture_features
from treadle.drafts.xpress import settings
from treadle.drafts.xpress import speculators as xpress_layout
from treadle.drafts.xpress.drafter import XPressDrafter
from treadle.drafts.xpress.model import XPressDraft, XPressModel, jacobi
from treadle.drafts.xpress.objective import XPressObjective
from treadle.errors import UserError
from treadle.models.hf import greedy_continuations
from treadle.speculative.decode import TargetState, speculative_generate
from treadle.speculative.sampling import Sampler

BLOCK = ("--draft.kind=xpress", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4")


def xpress(seed=1, block_size=6, layers=2, vocab=512, target=None, std=0.3):
    """An XPress draft with sharp random weights (the mixer too: at its zero init the refiner would not mix)."""
    torch.manual_seed(seed)
    target = target or AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4,
                                                                       "vocab_size": vocab}))
    features = (1, 3) if target.config.num_hidden_layers > 3 else (1,)
    model = XPressModel(target, XPressDraft(target.config, features, layers, block_size,
                                            target.config.vocab_size - 1, rank=16)).eval()
    for p in model.draft_model.parameters():
        torch.nn.init.normal_(p, std=std)
    return model


def test_training_tau_sim_and_the_drafter_run_the_same_jacobi_passes():
    """float64: block after block (features handed over incrementally), the drafter's served logits are the last of
    the refiner's Jacobi passes over the training forward's block anchored at the bonus, its greedy proposal their
    argmax, tau_sim's guesses the same; the passes change the proposal somewhere (the refiner is not a no-op), and
    changing tokens after an anchor moves nothing of its block."""
    model, prompt_len = xpress().double(), 6
    torch.manual_seed(2)
    text = greedy_continuations(model.target, torch.randint(0, 512, (1, prompt_len)), 10)
    L = text.shape[1]
    positions = torch.arange(L)[None]
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=text, position_ids=positions)
        features = tap.take()
    anchors = torch.arange(prompt_len, L)[None]
    with torch.no_grad():
        out = model(text, positions, anchors)
        blocks = torch.cat((out.anchor_hidden[:, :, None], out.hidden), 2)
        served = model.served(blocks, text[:, prompt_len:], text[:, prompt_len - 1:-1])
        guesses = model.chain_guesses(text, 5, chunk=3)
    assert not torch.equal(served.argmax(-1), model.draft_logits(blocks).argmax(-1))
    drafter = XPressDrafter(model)
    drafter.reset(text[:, :prompt_len])
    given, gamma = 0, 5
    for s in range(prompt_len, L):
        n = s - prompt_len
        with torch.no_grad():
            drafter._absorb(text[:, : s + 1], TargetState(None, features[:, given:s]))
            given = s
            logits = drafter.block_logits(text[:, : s + 1])
        torch.testing.assert_close(logits.double(), served[0, n, 1:].float().double(), atol=1e-5, rtol=0)
        proposal = drafter.propose(text[:, : s + 1], TargetState(None, features[:, s:s]), gamma, Sampler()).tokens
        assert proposal == served[0, n, 1 : gamma + 1].argmax(-1).tolist()
        if s < L - gamma:
            assert [int(guesses[k][0, s + k]) for k in range(gamma)] == proposal
    changed = text.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % 512
    with torch.no_grad():
        a, b = (model(t, positions, torch.tensor([[9]])) for t in (text, changed))
    assert torch.allclose(a.logits, b.logits, atol=1e-10) and torch.equal(a.hit, b.hit)


def test_the_mixer_is_causal_and_the_passes_reach_a_fixed_point_by_the_block():
    """Slot k's bias reads the previous tokens of slots <= k only (the tril mixer; the block summary is the same for
    every pass), so block_size Jacobi passes leave the argmax where the left-to-right greedy decode puts it."""
    model = xpress(block_size=5).double()
    refiner = model.draft_model.refiner_head
    torch.manual_seed(3)
    hidden = torch.randn(2, 5, TARGET["hidden_size"], dtype=torch.float64)
    summary = refiner.summary(hidden)
    prev = torch.randint(0, 512, (2, 5))
    bias = refiner(summary, prev)
    later = prev.clone()
    later[:, 3:] = (later[:, 3:] + 1) % 512
    moved = refiner(summary, later)
    assert torch.equal(bias[:, :3], moved[:, :3]) and not torch.equal(bias[:, 3], moved[:, 3])
    base = model.draft_logits(hidden)
    anchor, before = torch.tensor([5, 6]), torch.tensor([7, 8])
    passes = [r.argmax(-1) for r in jacobi(refiner, base, summary, anchor, before, 6)]
    seq = torch.zeros(2, 5, dtype=torch.long)
    for k in range(1, 5):
        prev = torch.cat((before[:, None], anchor[:, None], seq[:, 1:-1]), -1)
        seq[:, k] = (base + refiner(summary, prev))[:, k].argmax(-1)
    assert torch.equal(passes[-1][:, 1:], seq[:, 1:]) and torch.equal(passes[4], passes[5])


def test_xpress_speculative_decoding_is_lossless():
    """Greedy: the target's own continuation at every gamma up to block_size - 1; gamma = block_size is refused."""
    model = xpress()
    prompt, _ = assert_greedy_lossless(model, XPressDrafter)
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        speculative_generate(model.target, XPressDrafter(model), prompt, gamma=6, max_new_tokens=8)


@pytest.mark.usefixtures("one_thread")
def test_xpress_sampled_verification_has_the_targets_distribution():
    """tests/test_spec_sampling.py's chi-square test with an XPress drafter (block 3, every slot drawn from the last
    Jacobi pass's row)."""
    from tests.test_spec_sampling import (
        RUNS, chi_square, critical, exact_distribution, sampling_noise_tv, speculative_counts, tiny, total_variation,
    )

    target = tiny(0)
    torch.manual_seed(1)
    model = XPressModel(target, XPressDraft(target.config, (1,), 1, 3, 3, rank=4)).eval()
    for p in model.draft_model.parameters():  # a confident draft and refiner, far from the target and uniform
        torch.nn.init.normal_(p, std=1.0)
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    counts = speculative_counts(target, XPressDrafter(model), sampler, RUNS, gamma=2)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)


def batch_of(seed=0, T=24, vocab=8):
    torch.manual_seed(seed)
    ids = torch.randint(0, vocab, (2, T))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1)
    labels[0, 5:9] = -100
    positions = torch.cat((torch.arange(T // 2), torch.arange(T // 2)))[None].expand(2, -1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "order_position": torch.tensor([3, 4])}


def test_the_objective_is_the_recipes_terms_and_chunked_equals_whole():
    """loss = BASE_WEIGHT x DFlash's loss + the refiner's teacher-forced and consistency terms (recomputed here from
    the model's pieces); with model.loss_chunk_tokens the loss, side sums and gradients are the whole path's
    (float64), and the refiner's terms reach the backbone."""
    from treadle.drafts.dflash.objective import DFlashObjective

    model = xpress(vocab=8, std=0.5).double().train()
    batch = batch_of()
    cfg = DraftConfig(kind="xpress", target="t", block_size=6, num_layers=2, loss="mix")
    got = {}
    for chunk in (0, 7):
        model.loss_chunk_tokens = chunk
        model.zero_grad()
        loss, side = XPressObjective(cfg, 24, 512)(model, batch)
        loss.sum().backward()
        got[chunk] = (loss.detach(), side, {n: p.grad.clone() for n, p in model.draft_model.named_parameters()})
    (l0, s0, g0), (l1, s1, g1) = got[0], got[7]
    assert torch.allclose(l0, l1, rtol=1e-10) and s0.keys() == s1.keys()
    assert all(torch.allclose(s0[k].double(), s1[k].double(), rtol=1e-10) for k in s0), s0
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-8, atol=1e-12) for n in g0)
    assert g0["refiner_head.readout.weight"].abs().sum() > 0 and g0["refiner_head.mix_l"].abs().sum() > 0
    model.loss_chunk_tokens = 0
    base, _ = DFlashObjective(cfg.model_copy(update={"kind": "dflash"}), 24, 512)(model, batch)
    refiner = s0["refined_loss"] + s0["consistency_loss"]
    assert float(s0["refined_loss"]) > 0 and float(s0["consistency_loss"]) > 0
    assert torch.allclose(l0.sum(), settings.BASE_WEIGHT * base.sum() + refiner, rtol=1e-10)


def test_config_refusals():
    from treadle.config import load_config

    base = ["--data.train=x", "--draft.kind=xpress", "--draft.target=t"]
    with pytest.raises(UserError, match=r"draft.gamma = 8 with draft.kind = 'xpress' and a block of 8"):
        load_config(None, base + ["--draft.block_size=8", "--draft.gamma=8", "--draft.eval_new_tokens=16"])
    with pytest.raises(UserError, match=r"draft.markov_rank is set but draft.kind = 'xpress'"):
        load_config(None, base + ["--draft.markov_rank=8"])
    with pytest.raises(UserError, match=r"lora.rank with draft.kind = 'xpress': adapters on its refiner"):
        load_config(None, base + ["--draft.init=x", "--lora.rank=4"])
    assert load_config(None, base).draft.kind == "xpress"
