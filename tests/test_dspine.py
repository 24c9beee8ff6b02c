"""DSpine: the walk the drafter takes is the training forward's (float64), lossless greedy and distribution-correct
sampled decoding, the transfer space, the export's SpecForge names and its import, and a run end to end."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TARGET, assert_greedy_lossless, draft_args, records
from treadle.cli import main
from treadle.drafts.dspine.drafter import DSpineDrafter
from treadle.drafts.dspine.model import DSpineDraft, DSpineModel, transfer_space
from treadle.drafts.targets import capture_features
from treadle.speculative.decode import TargetState, speculative_generate
from treadle.speculative.sampling import Sampler

BLOCK = ("--draft.kind=dspine", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4",
         "--draft.candidates=4")


def dspine(seed=1, block_size=6, layers=2, k=4, target=None, vocab=512):
    torch.manual_seed(seed)
    target = target or AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4,
                                                                       "vocab_size": vocab}))
    features = (1, 3) if target.config.num_hidden_layers > 3 else (1,)
    model = DSpineModel(target, DSpineDraft(target.config, features, layers, block_size, target.config.vocab_size - 1,
                                            k)).eval()
    model.draft_model.init_transfer(target.get_output_embeddings().weight)
    for name, p in model.draft_model.named_parameters():  # sharp, and the injection on (its writes start at zero)
        if p.dim() >= 2 or "bias" in name:
            torch.nn.init.normal_(p, std=0.3)
    return model


def test_the_transfer_space_is_whitened_unit_codes_of_the_head():
    """The codes are unit rows; over the vocabulary their projections are decorrelated (the whitening), and the
    readouts start as the principal directions (orthonormal rows)."""
    torch.manual_seed(0)
    head = torch.randn(300, 32) * torch.linspace(0.1, 3, 32)
    codes, directions = transfer_space(head, 8)
    assert torch.allclose(codes.norm(dim=-1), torch.ones(300, dtype=torch.float64))
    assert torch.allclose(directions @ directions.T, torch.eye(8, dtype=torch.float64), atol=1e-10)
    raw = torch.nn.functional.normalize(head.double(), dim=-1)
    white = (raw - raw.mean(0)) @ directions.T
    cov = white.T @ white
    assert torch.allclose(cov / cov.diagonal().sqrt()[:, None] / cov.diagonal().sqrt()[None], torch.eye(8,
                          dtype=torch.float64), atol=1e-8)


def test_the_drafters_walk_is_the_training_forwards_and_the_injection_matters():
    """float64: the drafter's greedy proposal from the bonus equals tau_sim's guesses (slot_guesses: each slot after
    the text's token before it) on the text it proposed, and the injection changes the block's states."""
    model = dspine().double()
    target = model.target
    prompt = torch.tensor([[5, 17, 3, 99, 42, 7, 250, 11]])
    drafter = DSpineDrafter(model)
    drafter.reset(prompt)
    with torch.no_grad(), capture_features(target, model.draft_model.feature_layers) as tap:
        target(input_ids=prompt[:, :-1])
        features = tap.take()
    proposal = drafter.propose(prompt, TargetState(None, features), 5, Sampler(0.0, 1.0, None))
    text = torch.cat((prompt, torch.tensor([proposal.tokens])), 1)
    guesses = model.chain_guesses(text, 5)
    a = prompt.shape[1] - 1
    assert [int(guesses[k - 1][0, a + k - 1]) for k in range(1, 6)] == proposal.tokens
    hidden = drafter.block_hidden(prompt)
    with torch.no_grad():
        for w in model.draft_model.injection.writes:
            w.weight.zero_()
    assert not torch.allclose(hidden, drafter.block_hidden(prompt))


def test_dspine_speculative_decoding_is_lossless():
    model = dspine()
    prompt, _ = assert_greedy_lossless(model, DSpineDrafter)
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        speculative_generate(model.target, DSpineDrafter(model), prompt, gamma=6, max_new_tokens=8)


@pytest.mark.usefixtures("one_thread")
def test_dspine_sampled_verification_has_the_targets_distribution():
    """tests/test_spec_sampling.py's chi-square test with a DSpine drafter (block 3, 2 candidates per slot)."""
    from tests.test_spec_sampling import (
        RUNS, chi_square, critical, exact_distribution, sampling_noise_tv, speculative_counts, tiny, total_variation,
    )

    target = tiny(0)
    torch.manual_seed(1)
    model = DSpineModel(target, DSpineDraft(target.config, (1,), 1, 3, 3, 2)).eval()
    model.draft_model.init_transfer(target.get_output_embeddings().weight)
    for name, p in model.draft_model.named_parameters():
        if p.dim() >= 2 or "bias" in name:
            torch.nn.init.normal_(p, std=1.0)
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    counts = speculative_counts(target, DSpineDrafter(model), sampler, RUNS, gamma=2)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)
