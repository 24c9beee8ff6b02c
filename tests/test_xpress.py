"""XPress: the refiner's Jacobi passes in training, tau_sim and the drafter agree (float64), lossless greedy and
distribution-correct sampled decoding, the objective (its terms, chunked = whole), the speculators layout both ways
(and speculators' own loader at the oldest end), and a run end to end (train, resume, export, init, spec-eval)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import (
    TARGET, assert_greedy_lossless, assert_sampling_exact, assert_spec_eval_decodes, block_draft_rounds,
    chunked_and_whole, draft_args, records,
)
from tests.test_lilicorr import batch_of  # two packed rows over 8 tokens, a gap in the labels
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
from treadle.speculative.decode import TargetState, speculative_generate
from treadle.speculative.sampling import Sampler

# vLLM's xpress_head.* names (qwen3_xpress.py @15ba199f: XPressRefinerHead.HYBRID_KEY_MAP's checkpoint side).
VLLM_HEAD = {"w1.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix.L", "mlp.gate_proj.weight",
             "mlp.up_proj.weight", "mlp.down_proj.weight", "w2.weight"}
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
    model, prompt_len, gamma = xpress().double(), 6, 5
    drafter = XPressDrafter(model)
    (text, positions, features), rounds = block_draft_rounds(model, drafter, prompt_len)
    L = text.shape[1]
    with torch.no_grad():
        out = model(text, positions, torch.arange(prompt_len, L)[None])
        blocks = torch.cat((out.anchor_hidden[:, :, None], out.hidden), 2)
        served = model.served(blocks, text[:, prompt_len:])
        guesses = model.chain_guesses(text, gamma, chunk=3)
    assert not torch.equal(served.argmax(-1), model.draft_logits(blocks).argmax(-1))
    for s, n in rounds:
        with torch.no_grad():
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
    anchor = torch.tensor([5, 6])
    passes = [r.argmax(-1) for r in jacobi(refiner, base, summary, anchor, 6)]
    seq = torch.zeros(2, 5, dtype=torch.long)
    for k in range(1, 5):
        prev = torch.cat((anchor[:, None], anchor[:, None], seq[:, 1:-1]), -1)
        seq[:, k] = (base + refiner(summary, prev))[:, k].argmax(-1)
    assert torch.equal(passes[-1][:, 1:], seq[:, 1:]) and torch.equal(passes[4], passes[5])


@pytest.mark.usefixtures("one_thread")
def test_xpress_decoding_is_exact_greedy_and_sampled():
    """Greedy: the target's own continuation at every gamma up to block_size - 1 (gamma = block_size refused).
    Sampled (block 3, a confident draft and refiner far from the target and from uniform, every slot drawn from the
    last Jacobi pass's row): the chi-square test against the target's exact distribution."""
    model = xpress()
    prompt, _ = assert_greedy_lossless(model, XPressDrafter)
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        speculative_generate(model.target, XPressDrafter(model), prompt, gamma=6, max_new_tokens=8)
    from tests.test_spec_sampling import tiny

    target = tiny(0)
    torch.manual_seed(1)
    sampled = XPressModel(target, XPressDraft(target.config, (1,), 1, 3, 3, rank=4)).eval()
    for p in sampled.draft_model.parameters():
        torch.nn.init.normal_(p, std=1.0)
    assert_sampling_exact(target, XPressDrafter(sampled))


def test_the_objective_is_the_recipes_terms_and_chunked_equals_whole():
    """loss = BASE_WEIGHT x DFlash's loss + the refiner's teacher-forced and consistency terms (recomputed here from
    the model's pieces); with model.loss_chunk_tokens the loss, side sums and gradients are the whole path's
    (float64), and the refiner's terms reach the backbone."""
    from treadle.drafts.dflash.objective import DFlashObjective

    model = xpress(vocab=8, std=0.5).double().train()
    batch = batch_of()
    cfg = DraftConfig(kind="xpress", target="t", block_size=6, num_layers=2, loss="mix")
    l0, s0, g0 = chunked_and_whole(model, XPressObjective(cfg, 24, 512), batch)
    assert g0["refiner_head.readout.weight"].abs().sum() > 0 and g0["refiner_head.mix_l"].abs().sum() > 0
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


def test_xpress_run_trains_resumes_exports_inits_and_decodes(shards, eagle3_target_dir, tmp_path, capsys):
    """A run (exact resume) exporting vLLM's Qwen3XPressModel layout (the names and keys its loader reads), the same
    draft in speculators' layout (``--to speculators``), a run from that export (draft.init), and spec-eval decoding
    the run's export losslessly, greedy and sampled."""
    target_dir = eagle3_target_dir
    a, b, c = (tmp_path / n for n in "abc")
    common = ("--draft.loss=mix", "--optim.lr=1e-2", "--draft.anchors=4", *BLOCK)
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=4", "--checkpoint.every=2", *common)) == 0
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=4", *common,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    la, lb = records(a), records(b)
    assert [la[s] for s in (3, 4)] == [lb[s] for s in (3, 4)]
    assert records(a, "refined_loss") and records(a, "consistency_loss") and records(a, "eal")
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    config = json.loads((a / "draft" / "config.json").read_text())  # vLLM's Qwen3XPressModel layout
    assert config["treadle_draft_kind"] == "xpress" and config["architectures"] == ["Qwen3XPressModel"]
    assert config["dflash_config"]["target_layer_ids"] == [0, 2] and "auto_map" not in config
    assert {k: config[k] for k in config if k.startswith("xpress_")} == {
        "xpress_block_size": 6, "xpress_rank": 256, "xpress_mlp_hidden": 512, "xpress_num_passes": 6}
    assert {n[len("xpress_head."):] for n in wa if n.startswith("xpress_head.")} == VLLM_HEAD
    assert not wa.keys() & {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"}
    assert main(["export", str(a), "--to", "speculators", str(tmp_path / "spec")]) == 0
    spec = load_file(tmp_path / "spec" / "model.safetensors")
    sconfig = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert sconfig["speculators_model_type"] == "xpress" and sconfig["architectures"] == ["XPressSpeculator"]
    assert (sconfig["block_size"], sconfig["aux_hidden_state_layer_ids"], sconfig["sample_from_anchor"]) == (
        6, [1, 3], False)
    assert sconfig["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5}]
    assert len(spec) == len(wa) and torch.equal(spec["refiner_head.mix_l"], wa["xpress_head.mix.L"])
    assert torch.equal(spec["refiner_head.readout.weight"], wa["xpress_head.w2.weight"])
    assert main(draft_args(shards, target_dir, c, "--train.max_steps=2", *common,
                           f"--draft.init={tmp_path / 'spec'}")) == 0
    assert records(c, "eval_loss")[0] == pytest.approx(records(a, "eval_loss")[4], rel=1e-5)
    capsys.readouterr()
    assert_spec_eval_decodes(target_dir, a, "xpress", tmp_path / "spec.json")


@pytest.fixture
def exported(tmp_path, request):
    """(XPressModel, target dir, export dir): a sharp random XPress draft of a saved 4-layer target, exported in
    speculators' layout or (``draft``) vLLM's, as treadle's export writes them."""
    from treadle.checkpoint.export import export_draft
    from treadle.drafts.targets import target_identity

    model = xpress(block_size=5)
    target_dir = tmp_path / "target"
    model.target.save_pretrained(target_dir)
    out = tmp_path / "export"
    export_draft(model, model.state_dict(), out, target_dir, target_identity(target_dir, model.target),
                 DraftConfig(kind="xpress", target=str(target_dir)), step=0,
                 to=getattr(request, "param", "speculators"))
    return model, target_dir, out


@pytest.mark.parametrize("exported", ["speculators", "draft"], indirect=True)
def test_a_draft_trained_elsewhere_imports_and_bad_ones_are_refused(exported, tmp_path):
    """An XPress directory in speculators' or vLLM's layout without treadle's keys (as the trainer saves one, copies
    of the verifier's embedding and head beside) loads as the draft it was; a reduced vocabulary, the other slot
    convention, a missing refiner tensor, a missing mask token or an MLP width off the rank are refused in one
    line."""
    model, target_dir, out = exported
    config = json.loads((out / "config.json").read_text())
    foreign = {k: v for k, v in config.items() if k not in ("treadle_draft_kind", "target", "target_config",
                                                            "training")}
    tensors = load_file(out / "model.safetensors")
    H, V = TARGET["hidden_size"], model.target.config.vocab_size
    head = "verifier_lm_head.weight" if "speculators_model_type" in config else "lm_head.weight"
    shipped = {**tensors, "embed_tokens.weight": torch.zeros(V, H), head: torch.zeros(V, H)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps(foreign))
    save_file(shipped, str(elsewhere / "model.safetensors"))
    from treadle.drafts.registry import load_draft, read_draft_config

    assert read_draft_config(elsewhere)["treadle_draft_kind"] == "xpress"
    loaded = load_draft(elsewhere, model.target).draft_model
    assert loaded.jacobi_passes == 6 and loaded.refiner_head.rank == 16
    for (name, want), (_, got) in zip(model.draft_model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(want, got), name
    mixer = next(n for n in tensors if n.endswith(("mix_l", "mix.L")))
    bad = [(foreign, {k: v for k, v in shipped.items() if k != mixer}, rf"missing \['{re.escape(mixer)}'"),
           (foreign, {**shipped, "d2t": torch.zeros(V, dtype=torch.long)}, "reduced draft vocabulary")]
    if "speculators_model_type" in foreign:
        bad += [({**foreign, "draft_vocab_size": 256}, shipped, "draft_vocab_size = 256"),
                ({**foreign, "sample_from_anchor": True}, shipped, "sample_from_anchor = true"),
                ({k: v for k, v in foreign.items() if k != "mask_token_id"}, shipped, "no mask_token_id")]
    else:
        bad += [({**foreign, "xpress_mlp_hidden": 20}, shipped, "xpress_mlp_hidden = 20 is not a multiple"),
                ({**foreign, "vocab_size": 256}, shipped, "vocab_size = 256 does not fit")]
    for cfg, weights, message in bad:
        (elsewhere / "config.json").write_text(json.dumps(cfg))
        save_file(weights, str(elsewhere / "model.safetensors"))
        with pytest.raises(UserError, match=message) as got:
            load_draft(elsewhere, model.target)
        assert "\n" not in str(got.value)


# speculators' side, run in its own process: its loader on the export, then one block anchored at the last input
# token through its modules (eager attention, the whole context visible) and its refiner's Jacobi passes.
LOADER = """
import sys, torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
out, inputs = sys.argv[1], load_file(sys.argv[2])
config = SpeculatorModelConfig.from_pretrained(out)
config.transformer_layer_config._attn_implementation = "eager"  # its flex-attention default compiles on the CPU
model = SpeculatorModel.from_pretrained(out, config=config).eval()
block, positions = inputs["block"], inputs["positions"]
with torch.no_grad():
    context = model.hidden_norm(model.fc(inputs["aux"]))
    x = model.embed_tokens(block)
    rope = model.rotary_emb(x, positions)
    for layer in model.layers:
        x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_ids=positions,
                  position_embeddings=rope)
    hidden = model.norm(x)
    base = model.lm_head(hidden)
    head = model.refiner_head
    # speculators 0.9.0's from_pretrained leaves this non-persistent buffer uninitialized (transformers 5 builds the
    # model on the meta device and fills what the file holds; no file can hold it): set it as its constructor does
    head.causal_tril.copy_(torch.ones_like(head.causal_tril).tril())
    cache = head.hidden_cache(hidden)
    pick = base.argmax(-1)
    for _ in range(config.num_jacobi_passes):
        pick[:, 0] = block[:, 0]
        # the anchor stands in for its own predecessor at slot 0, as vLLM serves XPress
        refined = base + head.block_bias(torch.cat([block[:, :1], pick[:, :-1]], 1), hcache=cache)
        pick = refined.argmax(-1)
save_file({"logits": refined[0].contiguous()}, sys.argv[3])
print(type(model).__name__, type(config).__name__)
"""


@pytest.mark.skipif(_runnable() is not None, reason=_runnable() or "")
def test_speculators_own_loader_loads_the_export_and_its_jacobi_block_agrees(exported, tmp_path):
    """speculators 0.9.0's ``from_pretrained`` opens the export as ``XPressDraftModel`` (the backbone and refiner from
    the file, embedding and head from the verifier it names) and its modules' block, refined by its head over the
    recorded number of Jacobi passes, gives the served logits treadle's drafter proposes from."""
    model, target_dir, out = exported
    T, draft = 9, model.draft_model
    ids = torch.randint(0, 500, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), capture_features(model.target, draft.feature_layers) as tap:
        model.target(input_ids=ids[:, :-1])
        features = tap.take()
    drafter = XPressDrafter(model)
    drafter.reset(ids[:, :-1])
    with torch.no_grad():
        drafter._absorb(ids, TargetState(None, features))
        ours = drafter.block_logits(ids)
    block = torch.full((1, draft.block_size), draft.mask_token_id)
    block[0, 0] = ids[0, -1]
    inputs = {"aux": features.contiguous(), "block": block, "positions": torch.arange(T - 1 + draft.block_size)[None]}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    env = {**os.environ, "PYTHONPATH": str(SPECULATORS)}
    run = subprocess.run([sys.executable, "-c", LOADER, str(out), str(tmp_path / "inputs.safetensors"),
                          str(tmp_path / "theirs.safetensors")], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["XPressDraftModel", "XPressSpeculatorConfig"]
    theirs = load_file(str(tmp_path / "theirs.safetensors"))["logits"]
    torch.testing.assert_close(theirs[1:], ours, rtol=0, atol=1e-4)
    assert not torch.equal(theirs[1:].argmax(-1), model.draft_logits(drafter.block_states(ids))[0, 1:].argmax(-1))
