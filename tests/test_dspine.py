"""DSpine: the walk the drafter takes is the training forward's (float64), lossless greedy and distribution-correct
sampled decoding, the transfer space, the export's SpecForge names and its import, and a run end to end."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import SPEC_EVAL, TARGET, assert_greedy_lossless, draft_args, records
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


@pytest.mark.usefixtures("one_thread")
def test_dspine_sampled_verification_has_the_targets_distribution():
    """tests/test_spec_sampling.py's chi-square test with a DSpine drafter (block 3, 2 candidates per slot)."""
    from tests import test_spec_sampling as ss

    target = ss.tiny(0)
    torch.manual_seed(1)
    model = DSpineModel(target, DSpineDraft(target.config, (1,), 1, 3, 3, 2)).eval()
    model.draft_model.init_transfer(target.get_output_embeddings().weight)
    for name, p in model.draft_model.named_parameters():
        if p.dim() >= 2 or "bias" in name:
            torch.nn.init.normal_(p, std=1.0)
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    exact = ss.exact_distribution(target, sampler)
    counts = ss.speculative_counts(target, DSpineDrafter(model), sampler, ss.RUNS, gamma=2)
    stat, dof = ss.chi_square(counts, exact, ss.RUNS)
    assert stat < ss.critical(dof) and ss.total_variation(counts, exact, ss.RUNS) < 2 * ss.sampling_noise_tv(exact,
                                                                                                             ss.RUNS)


def test_the_drafters_walk_is_the_training_forwards_and_the_injection_matters():
    """float64: the drafter's greedy proposal from the bonus equals tau_sim's guesses (slot_guesses: each slot after
    the text's token before it) on the text it proposed, the injection changes the block's states, and greedy
    speculative decoding is lossless."""
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
    # greedy decoding is the target's own continuation at every gamma; gamma = block_size is refused
    lossless = dspine()
    start, _ = assert_greedy_lossless(lossless, DSpineDrafter)
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        speculative_generate(lossless.target, DSpineDrafter(lossless), start, gamma=6, max_new_tokens=8)


def test_dspine_run_trains_resumes_exports_imports_and_decodes(shards, eagle3_target_dir, tmp_path, capsys):
    """Exact resume; the export is SpecForge's DSpineDraftModel layout (its names, dspine_config, transfer_ready, no
    auto_map); the same directory without treadle's keys (a draft trained elsewhere) is a draft.init whose first
    evaluation is the run's last; spec-eval decodes the export losslessly and sampled."""
    from safetensors.torch import save_file

    target_dir = eagle3_target_dir
    a, b, c = (tmp_path / n for n in "abc")
    common = ("--optim.lr=1e-2", "--draft.anchors=4")
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=4", "--checkpoint.every=2", *BLOCK,
                           *common)) == 0
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=4", *BLOCK, *common,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    la, lb = records(a), records(b)
    assert [la[s] for s in (3, 4)] == [lb[s] for s in (3, 4)]
    assert records(a, "refinement") and records(a, "alignment") and records(a, "eal")
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    config = json.loads((a / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DSpineDraftModel"] and "auto_map" not in config
    dc = config["dspine_config"]
    rank, message, d = dc["transfer_rank"], dc["message_size"], config["hidden_size"]
    assert dc["top_k"] == 4 and config["dflash_config"]["block_size"] == 6
    shapes = {"injection.message.weight": [message, rank], "injection.receiver_gate.weight": [message, rank],
              "injection.predecessor_gate.weight": [message, rank], "injection.bias": [message],
              "transfer_codes": [config["vocab_size"], rank], "transfer_ready": [],
              **{f"injection.readouts.{i}.weight": [rank, d] for i in range(2)},
              **{f"injection.writes.{i}.weight": [d, message] for i in range(2)}}
    assert {n: list(wa[n].shape) for n in shapes} == shapes and bool(wa["transfer_ready"])
    assert {n for n in wa if not n.startswith(("layers.", "fc.", "hidden_norm.", "norm."))} == shapes.keys()
    # Trained elsewhere: SpecForge's save_pretrained writes no treadle keys.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    ours = ("treadle_draft_kind", "target", "target_config", "training")
    (foreign / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in ours}))
    save_file(wa, foreign / "model.safetensors")
    assert main(draft_args(shards, target_dir, c, "--train.max_steps=2", *BLOCK, *common,
                           f"--draft.init={foreign}")) == 0
    assert records(c, "eval_loss")[0] == pytest.approx(records(a, "eval_loss")[4], rel=1e-5)
    out = tmp_path / "spec.json"
    capsys.readouterr()
    for temperature, lossless in (("0", True), ("1", None)):  # greedy: checked against the target's own decode
        args = [*SPEC_EVAL, "--target", str(target_dir), "--draft", str(a), "--gamma", "5", "--temperature",
                temperature, "--num-prompts", "2", "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]
        assert main(args) == 0
        report = json.loads(out.read_text())
        assert (report["drafter"], report["lossless"]) == ("dspine", lossless), report
