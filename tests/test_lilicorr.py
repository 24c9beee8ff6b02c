"""LiLiCorr: the correlator's training lattice against the drafter's decode-time one (float64), lossless greedy and
distribution-correct sampled decoding, the objective (chunked = whole, frozen vs joint backbone), the export's
contract with vLLM's loader, and a run end to end (train, resume, export, init, spec-eval)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import SPEC_EVAL, TARGET, assert_greedy_lossless, draft_args, records
from treadle.cli import main
from treadle.config import DraftConfig
from treadle.drafts.dflash.model import DFlashDraft
from treadle.drafts.targets import capture_features
from treadle.drafts.glide.model import document_ids
from treadle.drafts.lilicorr.drafter import LiLiCorrDrafter
from treadle.drafts.lilicorr.model import LiLiCorrDraft, LiLiCorrModel, build_draft, greedy_walk
from treadle.drafts.lilicorr.objective import LiLiCorrObjective
from treadle.models.hf import greedy_continuations
from treadle.speculative.decode import TargetState, speculative_generate
from treadle.speculative.sampling import Sampler

BLOCK = ("--draft.kind=lilicorr", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4",
         "--draft.candidates=4")


def lilicorr(seed=1, block_size=6, layers=2, k=4, target=None, vocab=512, conv=0):
    """A LiLiCorr draft on DFlash's backbone, or with ``conv`` (a group size) on DFlash2's without its selector."""
    torch.manual_seed(seed)
    target = target or AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4,
                                                                       "vocab_size": vocab}))
    features = (1, 3) if target.config.num_hidden_layers > 3 else (1,)
    model = LiLiCorrModel(target, LiLiCorrDraft(target.config, features, layers, block_size, target.config.vocab_size - 1,
                                                k, 2, conv_group_size=conv)).eval()
    for name, p in model.draft_model.named_parameters():  # sharp: a wrong slot, anchor or mask changes the walk
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.3)
        elif "bias" in name or "embedding" in name:
            torch.nn.init.normal_(p, std=0.3)
    return model


def batch_of(seed=0, T=24, vocab=8):
    """Two packed rows over a small vocabulary: with 4 candidates of 8 the data's tokens are often in the lattice, so
    the lattice terms are not all masked."""
    torch.manual_seed(seed)
    ids = torch.randint(0, vocab, (2, T))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1)
    labels[0, 5:9] = -100
    positions = torch.cat((torch.arange(T // 2), torch.arange(T // 2)))[None].expand(2, -1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "order_position": torch.tensor([3, 4])}


@pytest.mark.parametrize("conv", [0, 8], ids=["dflash", "dflash2-conv"])
def test_the_training_lattice_is_the_drafters_and_sees_no_later_context(conv):
    """float64: round after round (features handed over incrementally), the drafter's candidates, start and pair
    scores are the training forward's for the block anchored at the bonus (every slot: gamma = block_size - 1), its
    greedy proposal is the walk through them, and tau_sim's guesses are the proposals. Changing every token after
    an anchor moves none of its block's scores. On DFlash's backbone and on DFlash2's convolving one."""
    model, prompt_len = lilicorr(conv=conv).double(), 6
    torch.manual_seed(2)
    text = greedy_continuations(model.target, torch.randint(0, 512, (1, prompt_len)), 10)
    L = text.shape[1]
    positions = torch.arange(L)[None]
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=text, position_ids=positions)
        features = tap.take()

    def train_lattice(ids_, anchors):
        with torch.no_grad():
            out = model(ids_, positions, anchors)
            return out.candidates, out.start, out.pair

    anchors = torch.arange(prompt_len, L)[None]
    cand, start, pair = train_lattice(text, anchors)
    drafter = LiLiCorrDrafter(model)
    drafter.reset(text[:, :prompt_len])
    given, gamma = 0, 5
    for s in range(prompt_len, L):
        n = s - prompt_len
        with torch.no_grad():
            drafter._absorb(text[:, : s + 1], TargetState(None, features[:, given:s]))
            given = s
            ids, d_start, d_pair = drafter.lattice(text[:, : s + 1], gamma)
        assert torch.equal(ids, cand[0, n]), s
        assert torch.allclose(d_start, start[0, n], atol=1e-10, rtol=0), s
        assert torch.allclose(d_pair, pair[0, n], atol=1e-10, rtol=0), s
        proposal = drafter.propose(text[:, : s + 1], TargetState(None, features[:, s:s]), gamma, Sampler()).tokens
        pick = greedy_walk(start[0, n][None], pair[0, n][None])[0]
        assert proposal == cand[0, n].gather(-1, pick[:, None]).squeeze(-1).tolist()
    assert drafter.forwards == 2 * (L - prompt_len)
    with torch.no_grad():
        guesses = model.chain_guesses(text, gamma, chunk=3)
    for s in range(prompt_len, L - gamma):
        n = s - prompt_len
        pick = greedy_walk(start[0, n][None], pair[0, n][None])[0]
        assert [int(guesses[k][0, s + k]) for k in range(gamma)] == cand[0, n].gather(-1, pick[:, None]).flatten().tolist()
    changed = text.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % 512
    a, b = train_lattice(text, torch.tensor([[9]])), train_lattice(changed, torch.tensor([[9]]))
    assert all(torch.allclose(x.double(), y.double(), atol=1e-10) for x, y in zip(a, b))


def test_the_walk_is_not_the_backbones_argmax_and_the_anchor_matters():
    """The reranking changes proposals (a random correlator picks other candidates than top-1 somewhere), and the
    anchor row enters the scores (a zeroed anchor moves them): the test above would pass for a no-op head."""
    model = lilicorr().double()
    torch.manual_seed(4)
    text = torch.randint(0, 512, (1, 20))
    positions = torch.arange(20)[None]
    anchors = torch.arange(4, 19)[None]
    with torch.no_grad():
        slots = model(text, positions, anchors).hidden
        feats = model._target_forward(text, positions, hidden=True)[1]
        cand, lp = model.candidates(slots)
        anchor, valid = model.anchor_rows(feats, anchors, document_ids(positions))
        start, pair = model.lattice(slots, cand, lp, anchor, valid)
        start0, _ = model.lattice(slots, cand, lp, anchor, torch.zeros_like(valid))
    pick = greedy_walk(start.flatten(0, 1), pair.flatten(0, 1))
    assert (pick != 0).any()
    assert not torch.allclose(start, start0)
    assert valid.all() and not model.anchor_rows(feats, torch.tensor([[0, 6]]),
                                                 document_ids(torch.tensor([list(range(6)) + list(range(14))])))[1].any()


def test_lilicorr_speculative_decoding_is_lossless():
    """Greedy: the target's own continuation at every gamma up to block_size - 1 (the lattice cut to gamma slots
    as vLLM serves a shorter draft); gamma = block_size is refused."""
    model = lilicorr()
    prompt, _ = assert_greedy_lossless(model, LiLiCorrDrafter)
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        speculative_generate(model.target, LiLiCorrDrafter(model), prompt, gamma=6, max_new_tokens=8)


@pytest.mark.usefixtures("one_thread")
def test_lilicorr_sampled_verification_has_the_targets_distribution():
    """tests/test_spec_sampling.py's chi-square test with a LiLiCorr drafter (block 3, 2 candidates per slot, each
    slot's token drawn from its lattice row leaving the previous draw)."""
    from tests.test_spec_sampling import (
        RUNS, chi_square, critical, exact_distribution, sampling_noise_tv, speculative_counts, tiny, total_variation,
    )

    target = tiny(0)
    torch.manual_seed(1)
    backbone = DFlashDraft(target.config, (1,), 1, 3, 3)
    model = LiLiCorrModel(target, build_draft(backbone, target.config, 2, 1)).eval()
    for p in model.draft_model.parameters():  # a confident draft and correlator, far from the target and uniform
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=1.0)
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    drafter = LiLiCorrDrafter(model)
    counts = speculative_counts(target, drafter, sampler, RUNS, gamma=2)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)
    prompt = torch.tensor([[0, 1, 2, 3, 1]])
    drafter.reset(prompt)
    with torch.no_grad(), capture_features(target, model.draft_model.feature_layers) as tap:
        target(input_ids=prompt[:, :-1])
        features = tap.take()
    p = drafter.propose(prompt, TargetState(None, features), 2, sampler)
    assert p.q.shape == (2, 4) and torch.allclose(p.q.sum(-1), torch.ones(2), atol=1e-6)
    assert all(float(p.q[i, t]) > 0 for i, t in enumerate(p.tokens)) and int((p.q > 0).sum(-1).max()) <= 2


def objective(**extra):
    return LiLiCorrObjective(DraftConfig(kind="lilicorr", target="t", block_size=6, num_layers=2, loss="mix",
                                         candidates=4, **extra), 24, 512)


def test_the_chunked_lattice_terms_equal_the_whole_logits():
    """model.loss_chunk_tokens: the loss (backbone and lattice), every side sum and the gradients of backbone and
    correlator equal the whole-logits path (float64)."""
    model = lilicorr(vocab=8).double().train()
    batch = batch_of()
    got = {}
    for chunk in (0, 7):
        model.loss_chunk_tokens = chunk
        model.zero_grad()
        loss, side = objective()(model, batch)
        loss.sum().backward()
        got[chunk] = (loss.detach(), side, {n: p.grad.clone() for n, p in model.draft_model.named_parameters()})
    (l0, s0, g0), (l1, s1, g1) = got[0], got[7]
    assert float(s0["lattice_slots"]) > 0 and float(s0["lattice_ce"]) > 0 and float(s0["lattice_penalty"]) > 0
    assert torch.allclose(l0, l1, rtol=1e-10) and s0.keys() == s1.keys()
    assert all(torch.allclose(s0[k].double(), s1[k].double(), rtol=1e-10) for k in s0), s0
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-8, atol=1e-12) for n in g0)
    assert g0["lilicorr.in_head.weight"].abs().sum() > 0 and g0["backbone.fc.weight"].abs().sum() > 0


def test_joint_and_frozen_backbone_training():
    """Joint: loss = the backbone's DFlash loss + the lattice terms, which reach the backbone (its gradient differs
    from the DFlash loss's alone). Frozen: the loss is the lattice terms only and the backbone gets no gradient."""
    from treadle.drafts.dflash.objective import DFlashObjective

    model = lilicorr(vocab=8).double().train()
    batch = batch_of(1)
    joint, side = objective()(model, batch)
    plain = DFlashObjective(DraftConfig(kind="dflash", target="t", block_size=6, num_layers=2, loss="mix"), 24, 512)
    base, _ = plain(model, batch)
    lattice = objective(train_backbone=False, init="x")(model, batch)[0]
    assert torch.allclose(joint, base + lattice, rtol=1e-12)
    joint.sum().backward()
    g_joint = model.draft_model.backbone.fc.weight.grad.clone()
    model.zero_grad()
    base.sum().backward()
    assert not torch.allclose(g_joint, model.draft_model.backbone.fc.weight.grad)
    model.zero_grad()
    model.draft_model.backbone.requires_grad_(False)
    frozen = objective(train_backbone=False, init="x")(model, batch)[0]
    frozen.sum().backward()
    assert all(p.grad is None for p in model.draft_model.backbone.parameters())
    assert model.draft_model.lilicorr.out_head.weight.grad.abs().sum() > 0
    assert side["lattice_top1_hits"] >= 0


def test_config_refusals():
    from treadle.config import load_config
    from treadle.errors import UserError

    base = ["--data.train=x", "--draft.kind=lilicorr", "--draft.target=t"]
    with pytest.raises(UserError, match=r"draft.candidates = 6: vLLM's LiLiCorr head serves a power of two"):
        load_config(None, base + ["--draft.candidates=6"])
    with pytest.raises(UserError, match=r"draft.train_backbone = false without draft.init"):
        load_config(None, base + ["--draft.train_backbone=false"])
    with pytest.raises(UserError, match=r"draft.gamma = 8 with draft.kind = 'lilicorr' and a block of 8"):
        load_config(None, base + ["--draft.block_size=8", "--draft.gamma=8", "--draft.eval_new_tokens=16"])
    with pytest.raises(UserError, match=r"draft.candidates is set but draft.kind = 'dflash'; accepted: draft.kind = "
                                        r"'dspine' or 'lilicorr'"):
        load_config(None, ["--data.train=x", "--draft.kind=dflash", "--draft.target=t", "--draft.candidates=4"])
    assert load_config(None, base + ["--draft.block_size=8"]).draft.kind == "lilicorr"


# vLLM's LiLiCorrForCausalLM (vllm-project/vllm vllm/model_executor/models/lilicorr.py @08f95fe5): the head's
# parameters by name and shape (hidden H, factor F, heads h, block b, top-k k, mlp ratio r), after its load_weights
# strips "lilicorr." and hands them to AutoWeightsLoader(self.model.lilicorr). token_proj is nn.Identity when the
# head is as wide as the draft: no tensor. ReplicatedLinear and NemotronHMLP(bias=True) carry biases.
def vllm_head_parameters(H, F, h, b, k, r, layers):
    def linear(name, i, o):
        return {f"{name}.weight": (o, i), f"{name}.bias": (o,)}

    p = {**linear("pass_hidden_proj", H, H), **linear("context_proj", H, H), "feature_norm.weight": (5,),
         "feature_norm.bias": (5,), **linear("feature_mlp.up_proj", 5, H), **linear("feature_mlp.down_proj", H, H),
         "slot_embedding": (1, 1, b - 1, 1, H), "rank_embedding": (1, 1, 1, k, H),
         "relative_slot_bias": (h, 2 * b - 1), "same_slot_bias": (h,), "output_norm.weight": (H,),
         "anchor_norm.weight": (H,), **linear("factor_input_proj", 3 * H, H), **linear("out_head", H, F),
         **linear("in_head", H, F), **linear("anchor_out_head", H, F)}
    for i in range(layers):
        q = f"layers.{i}."
        p.update({q + "attn_norm.weight": (H,), q + "mlp_norm.weight": (H,), q + "attn.in_proj_weight": (3 * H, H),
                  q + "attn.in_proj_bias": (3 * H,), **linear(q + "attn.out_proj", H, H),
                  **linear(q + "mlp.up_proj", H, int(H * r)), **linear(q + "mlp.down_proj", int(H * r), H)})
    return p


def test_the_export_is_what_vllms_lilicorr_loader_reads(tmp_path):
    """The contract, from vLLM's lilicorr.py: architectures = ["LiLiCorrDraftModel"]; dflash_config carries
    lilicorr_enabled and every lilicorr_* key LiLiCorrHead reads (candidate_topk a power of two <= 16) and the block
    size (1 <= num_speculative_tokens < block_size); no conv keys (both or neither); every lilicorr.* tensor is a
    head parameter of its shape and every head parameter is covered; the backbone is z-lab's DFlash layout (its
    own contract: tests/test_dflash.py); no d2t, embedding or head. Read back: the same draft; ModelOpt's
    nn.Sequential names load too; a stray or missing head tensor is refused."""
    from treadle.drafts.dflash.model import draft_from_layout
    from treadle.drafts.lilicorr.kind import LILICORR
    from treadle.drafts.lilicorr.model import LiLiCorrDraft
    from treadle.errors import UserError

    model = lilicorr()
    draft = model.draft_model
    weights = {k: v.detach() for k, v in draft.state_dict().items()}
    tensors, config = LILICORR.export(draft, weights, model.target.config, torch.float32, "fp32", {})
    assert config["architectures"] == ["LiLiCorrDraftModel"] and config["model_type"] == "qwen3"
    dc = config["dflash_config"]
    geometry = {k: dc[k] for k in dc if k.startswith("lilicorr_")}
    assert dc["lilicorr_enabled"] is True and dc["projector_type"] == "lilicorr"
    assert set(geometry) == {"lilicorr_enabled", "lilicorr_candidate_topk", "lilicorr_hidden_size",
                             "lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim",
                             "lilicorr_vector_eps", "lilicorr_logit_scale"}
    k = dc["lilicorr_candidate_topk"]
    assert k == 4 and k & (k - 1) == 0 and k <= 16
    b = dc.get("block_size", config.get("block_size"))
    assert b == 6 and 1 <= 5 < b
    assert not dc.get("conv_kernel_size", 0) and not dc.get("conv_group_size", 0) and "auto_map" not in config
    H = config["hidden_size"]
    assert (dc["lilicorr_hidden_size"] or H) == H and H % dc["lilicorr_num_heads"] == 0
    want = vllm_head_parameters(H, dc["lilicorr_factor_dim"], dc["lilicorr_num_heads"], b, k,
                                dc["lilicorr_mlp_ratio"], dc["lilicorr_num_layers"])
    head = {n[len("lilicorr."):]: tuple(t.shape) for n, t in tensors.items() if n.startswith("lilicorr.")}
    assert head == want
    assert not [n for n in tensors if n.startswith(("d2t", "t2d", "embed_tokens", "lm_head"))]
    backbone = {n for n in tensors if not n.startswith("lilicorr.")}
    from treadle.drafts.dflash import layout as dflash_layout

    assert backbone == set(dflash_layout.names(2).values())
    # read back
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    again = draft_from_layout(out, model.target, "draft", LiLiCorrDraft)
    assert all(torch.equal(again.state_dict()[n], v) for n, v in weights.items())
    sequential = {(n.replace("feature_norm.", "feature_mlp.0.").replace("feature_mlp.up_proj.", "feature_mlp.1.")
                   .replace("feature_mlp.down_proj.", "feature_mlp.3.").replace(".mlp.up_proj.", ".mlp.0.")
                   .replace(".mlp.down_proj.", ".mlp.2.") if n.startswith("lilicorr.") else n): v
                  for n, v in tensors.items()}
    assert "lilicorr.feature_mlp.0.weight" in sequential and "lilicorr.layers.1.mlp.2.bias" in sequential
    save_file({"model." + n: v for n, v in sequential.items()}, str(out / "model.safetensors"))
    again = draft_from_layout(out, model.target, "draft", LiLiCorrDraft)
    assert all(torch.equal(again.state_dict()[n], v) for n, v in weights.items())
    save_file({n: v for n, v in tensors.items() if n != "lilicorr.same_slot_bias"}, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="missing"):
        draft_from_layout(out, model.target, "draft", LiLiCorrDraft)
    save_file(tensors | {"lilicorr.token_proj.weight": torch.zeros(H, H)}, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="unknown"):
        draft_from_layout(out, model.target, "draft", LiLiCorrDraft)


def test_lilicorr_on_a_convolving_backbone_is_what_vllm_reads_and_takes_a_dflash2_init(eagle3_target_dir, tmp_path):
    """LiLiCorr + conv. vLLM's lilicorr.py (@08f95fe5) builds DFlash2's decoder layers when dflash_config has
    conv_kernel_size and conv_group_size (both or neither) and then requires every .attention_conv. / .mlp_conv.
    tensor; those layers read only the two keys (qwen3_dflash2.py's DFlash2Qwen3DecoderLayer), no selector. The
    export carries both keys, each layer's conv tensors under DFlash2's names and no selector tensor or key, and reads
    back to the same draft; one key alone is refused. A trained DFlash2 draft as draft.init becomes the backbone (its
    selector dropped), byte for byte and frozen; a contradicting conv_group_size is refused."""
    from treadle.drafts.dflash.model import draft_from_layout
    from treadle.drafts.dflash2.kind import DFLASH2
    from treadle.drafts.dflash2.model import DFlash2Draft
    from treadle.drafts.lilicorr.kind import LILICORR
    from treadle.errors import UserError

    def write(directory, tensors, config):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(directory / "model.safetensors"))
        return directory

    model = lilicorr(conv=8)
    draft = model.draft_model
    weights = {k: v.detach() for k, v in draft.state_dict().items()}
    tensors, config = LILICORR.export(draft, weights, model.target.config, torch.float32, "fp32", {})
    dc = config["dflash_config"]
    assert config["architectures"] == ["LiLiCorrDraftModel"] and "auto_map" not in config
    assert (dc["conv_kernel_size"], dc["conv_group_size"]) == (2, 8)
    assert not [k for k in dc if k.startswith("selector")] and not [n for n in tensors if "selector" in n]
    conv = {n for n in tensors if ".attention_conv." in n or ".mlp_conv." in n}
    assert conv == {f"layers.{i}.{c}_conv.{p}" for i in range(2) for c in ("attention", "mlp")
                    for p in ("base_kernel", "kernel_projection.weight")}
    out = write(tmp_path / "conv", tensors, config)
    again = draft_from_layout(out, model.target, "draft", LiLiCorrDraft)
    assert isinstance(again.backbone, DFlash2Draft) and again.backbone.selector is None
    assert all(torch.equal(again.state_dict()[n], v) for n, v in weights.items())
    del config["dflash_config"]["conv_kernel_size"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="conv_kernel_size = 0 and conv_group_size = 8; accepted: both"):
        draft_from_layout(out, model.target, "draft", LiLiCorrDraft)

    shape = dict(target=str(eagle3_target_dir), block_size=6, num_layers=2, conv_group_size=8)
    dflash2, _, _ = DFLASH2.build(DraftConfig(kind="dflash2", selector_top_k=4, selector_rank=16, **shape), 512, None)
    trained = {k: v.detach() for k, v in dflash2.draft_model.state_dict().items()}
    init = write(tmp_path / "dflash2", *DFLASH2.export(dflash2.draft_model, trained, dflash2.target.config,
                                                      torch.float32, "fp32", {}))
    cfg = DraftConfig(kind="lilicorr", init=str(init), candidates=4, train_backbone=False, **shape)
    built, _, _ = LILICORR.build(cfg, 512, None)
    backbone = built.draft_model.backbone
    assert isinstance(backbone, DFlash2Draft) and backbone.selector is None
    assert not any(p.requires_grad for p in backbone.parameters())
    assert backbone.state_dict().keys() == {k for k in trained if not k.startswith("candidate_selector.")}
    assert all(torch.equal(v, trained[k]) for k, v in backbone.state_dict().items())
    with pytest.raises(UserError, match="draft.conv_group_size = 16 but draft.init"):
        LILICORR.build(DraftConfig(**{**cfg.model_dump(), "conv_group_size": 16}), 512, None)


def test_lilicorr_run_trains_resumes_exports_inits_and_decodes(shards, eagle3_target_dir, tmp_path, capsys):
    """A DFlash run, then LiLiCorr from it (frozen backbone: the backbone's tensors leave byte for byte as they came)
    and jointly (exact resume, export, re-export from a checkpoint, init from its own export); spec-eval decodes
    the export losslessly and sampled."""
    target_dir = eagle3_target_dir
    dflash_run, frozen, a, b = (tmp_path / n for n in ("dflash", "frozen", "a", "b"))
    common = ("--draft.loss=mix", "--optim.lr=1e-2", "--draft.anchors=4")
    assert main(draft_args(shards, target_dir, dflash_run, "--train.max_steps=2", "--draft.kind=dflash",
                           "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4", *common)) == 0
    assert main(draft_args(shards, target_dir, frozen, "--train.max_steps=3", *BLOCK, *common,
                           f"--draft.init={dflash_run}", "--draft.train_backbone=false")) == 0
    wd, wf = load_file(dflash_run / "draft" / "model.safetensors"), load_file(frozen / "draft" / "model.safetensors")
    assert all(torch.equal(wd[n], wf[n]) for n in wd) and any(n.startswith("lilicorr.") for n in wf)
    assert records(frozen, "lattice_ce") and records(frozen, "eal")
    assert main(["export", str(frozen), str(tmp_path / "frozen-again")]) == 0  # the backbone rebuilt from draft.init
    again = load_file(tmp_path / "frozen-again" / "model.safetensors")
    assert again.keys() == wf.keys() and all(torch.equal(again[n], wf[n]) for n in wf)
    # joint, with exact resume
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=4", "--checkpoint.every=2", *BLOCK,
                           *common)) == 0
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=4", *BLOCK, *common,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    la, lb = records(a), records(b)
    assert [la[s] for s in (3, 4)] == [lb[s] for s in (3, 4)]
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    config = json.loads((a / "draft" / "config.json").read_text())
    assert config["treadle_draft_kind"] == "lilicorr" and config["architectures"] == ["LiLiCorrDraftModel"]
    assert main(["export", str(a), str(tmp_path / "again")]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == wa.keys() and all(torch.equal(again[n], wa[n]) for n in wa)
    c = tmp_path / "c"
    assert main(draft_args(shards, target_dir, c, "--train.max_steps=2", *BLOCK, *common, f"--draft.init={a}")) == 0
    assert records(c, "eval_loss")[0] == pytest.approx(records(a, "eval_loss")[4], rel=1e-5)
    out = tmp_path / "spec.json"
    capsys.readouterr()
    for extra in ((), ("--temperature", "1")):
        assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(a), "--num-prompts", "2", "--gamma",
                     "5", "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out), *extra]) == 0
        got = json.loads(out.read_text())
        assert got["drafter"] == "lilicorr" and got["lossless"] is (None if extra else True), got
