"""DFlash2: the in-block convolutions and the selector against naive references, the training forward against the
decode-time drafter (float64), lossless and distribution-correct decoding, the chunked loss, z-lab's layout as vLLM's
DFlash2 loader reads it, and a run end to end (train, resume, export, import, spec-eval)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import SPEC_EVAL, TARGET, assert_greedy_lossless, draft_args, records
from treadle.cli import main
from treadle.drafts.dflash.model import DFlashDraft, DFlashModel
from treadle.drafts.dflash2 import layout
from treadle.drafts.dflash2.drafter import DFlash2Drafter
from treadle.drafts.dflash2.kind import DFLASH2
from treadle.drafts.dflash2.model import DFlash2Draft, DFlash2Model
from treadle.drafts.targets import capture_features
from treadle.errors import UserError
from treadle.models.hf import greedy_continuations
from treadle.speculative.decode import TargetState, speculative_generate
from treadle.speculative.sampling import Sampler

BLOCK = ("--draft.kind=dflash2", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4",
         "--draft.conv_group_size=8", "--draft.selector_rank=16", "--draft.selector_top_k=4")


def randomize(module, std=0.3):
    """Every weight drawn (the convolutions and the selector off their identity start): a wrong tap, position, mask or
    predecessor changes argmaxes."""
    for name, p in module.named_parameters():
        if p.dim() >= 2 or "base_kernel" in name:
            torch.nn.init.normal_(p, std=std)


def dflash2(seed=1, block_size=6, layers=2, top_k=4, fresh=False):
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4}))
    draft = DFlash2Draft(target.config, (1, 3), layers, block_size, 511, conv_group_size=8, selector_rank=16,
                         selector_top_k=top_k)
    if not fresh:
        randomize(draft)
    return DFlash2Model(target, draft).eval()


def test_a_new_dflash2_is_its_dflash_and_the_taps_stay_in_their_block():
    """NeMo's identity start: a new DFlash2 draft computes what DFlash does with its backbone's weights. Trained taps
    never reach across blocks: a block drafted with two others beside it equals the block drafted alone."""
    model = dflash2(fresh=True)
    plain = DFlashDraft(model.target.config, (1, 3), 2, 6, 511)
    plain.load_state_dict(model.draft_model.state_dict(), strict=False)
    torch.manual_seed(0)
    ids, positions = torch.randint(0, 512, (2, 20)), torch.arange(20).expand(2, -1)
    anchors = torch.tensor([[2, 7, 11], [0, 5, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids, positions, anchors).logits, DFlashModel(model.target, plain)(ids, positions,
                                                                                                  anchors).logits)
    randomize(model.draft_model)
    with torch.no_grad():
        together = model(ids, positions, anchors).logits
        alone = torch.stack([model(ids, positions, anchors[:, j : j + 1]).logits[:, 0] for j in range(3)], 1)
        before = DFlashModel(model.target, plain)(ids, positions, anchors).logits
    assert torch.allclose(together, alone, atol=1e-5) and not torch.allclose(together, before, atol=1e-2)


def test_the_convolution_and_the_selector_match_naive_references():
    """y_t = sum_j (base[j] + correction_t[j, group]) * x_{t-j} within the block, correction from the sublayer's input
    (vLLM's _grouped_conv); S_t(a, b) = U_t(b) + sum_r P[a, r] (W h_t)[r] S[b, r] (vLLM's _score_edges)."""
    model = dflash2()
    conv = model.draft_model.layers[0].attention_conv.double()
    bs, taps, groups, gs = 6, conv.taps, conv.groups, conv.group_size
    torch.manual_seed(3)
    x = torch.randn(2, 2 * bs, 32, dtype=torch.float64)
    got, after = conv.prepare(x)
    correction = (x @ conv.kernel_projection.weight.T).view(2, 2 * bs, 2, taps, groups)
    want = torch.zeros_like(x)
    for b in range(2):
        for q in range(2 * bs):
            for c in range(32):
                for j in range(taps):
                    if q % bs >= j:  # slot t - j in the same block
                        k = conv.base_kernel[0, j, c] + correction[b, q, 0, j, c // gs]
                        want[b, q, c] += k * x[b, q - j, c]
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(after, correction[:, :, 1], atol=1e-12)
    selector = model.draft_model.selector.double()
    hidden, unary = torch.randn(3, 32, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    ids, prev = torch.randint(0, 512, (3, 4)), torch.randint(0, 512, (3,))
    got = selector.scores(hidden, unary, ids, prev)
    gate = selector.hidden_projection.weight @ hidden.T  # [rank, 3]
    for t in range(3):
        for i in range(4):
            s = unary[t, i] + sum(selector.predecessor_codebook[prev[t], r] * gate[r, t]
                                  * selector.successor_codebook[ids[t, i], r] for r in range(16))
            assert abs(float(got[t, i].detach() - s.detach())) < 1e-12


def test_the_training_forward_is_what_the_drafter_proposes():
    """float64, round after round (features handed over incrementally, the context cache kept): the drafter's block
    hidden states equal the training forward's at the bonus's anchor, its greedy walk is the training forward's
    selector pick at every slot once the text holds the walk's own tokens (the teacher-forced predecessor is the token
    the walk picked), and tau_sim's chain guesses are the proposals."""
    model = dflash2().double()
    prompt_len = 6
    torch.manual_seed(2)
    text = greedy_continuations(model.target, torch.randint(0, 512, (1, prompt_len)), 10)
    L = text.shape[1]
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=text, position_ids=torch.arange(L)[None])
        features = tap.take()
    drafter = DFlash2Drafter(model)
    drafter.reset(text[:, :prompt_len])
    given, walks_differ = 0, False
    for s in range(prompt_len, L):
        drafter._absorb(text[:, : s + 1], TargetState(None, features[:, given:s]))
        given = s
        with torch.no_grad():
            hidden = drafter.block_hidden(text[:, : s + 1])[0]
            train = model(text, torch.arange(L)[None], torch.tensor([[s]])).hidden[0, 0]
        assert torch.allclose(hidden, train, atol=1e-12, rtol=0), s
        walk = drafter.propose(text[:, : s + 1], TargetState(None, features[:, s:s]), 5, Sampler()).tokens
        walks_differ |= walk != model.draft_logits(hidden).argmax(-1).tolist()
        forced = torch.cat((text[:, : s + 1], torch.tensor([walk])), 1)  # the walk's tokens after the anchor
        with torch.no_grad():
            picks = model.slot_guesses(forced, torch.tensor([[s]]), hidden[None, None], None, None)[0, 0]
        assert picks.tolist() == walk, s
    assert walks_differ  # the selector, not the slots' argmaxes, chose somewhere
    with torch.no_grad():
        guesses = model.chain_guesses(text, 4, chunk=3)
    drafter.reset(text[:, :prompt_len])
    for s in range(prompt_len, L - 4):
        drafter.reset(text[:, :prompt_len])
        walk = drafter.propose(text[:, : s + 1], TargetState(None, features[:, :s]), 4, Sampler()).tokens
        chain = [int(guesses[k][0, s + k]) for k in range(4)]
        n = next((k for k in range(4) if chain[k] != int(text[0, s + k + 1])), 4)  # the accepted stretch
        assert chain[: n + 1] == walk[: n + 1], s  # identical while the chain is accepted, and at its first miss


def test_dflash2_speculative_decoding_is_lossless_and_its_q_rows_are_the_walks():
    """Greedy: the target's own greedy continuation at every gamma. Sampled: row i is the distribution slot i's token
    was drawn from: it sums to one over at most top_k candidates and gives the drawn token mass."""
    model = dflash2()
    prompt, _ = assert_greedy_lossless(model, DFlash2Drafter)
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        speculative_generate(model.target, DFlash2Drafter(model), prompt, gamma=6, max_new_tokens=8)
    drafter = DFlash2Drafter(model)
    drafter.reset(prompt)
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=prompt[:, :-1])
        features = tap.take()
    p = drafter.propose(prompt, TargetState(None, features), 5, Sampler(1.0, generator=torch.Generator().manual_seed(0)))
    assert p.q.shape == (5, 512) and torch.allclose(p.q.sum(-1), torch.ones(5))
    assert ((p.q > 0).sum(-1) <= 4).all() and all(float(p.q[i, t]) > 0 for i, t in enumerate(p.tokens))


@pytest.mark.usefixtures("one_thread")
def test_dflash2_sampled_verification_has_the_targets_distribution():
    """tests/test_spec_sampling.py's test with a DFlash2 drafter whose selector reranks (a confident draft, 2 of the
    4 tokens per slot): 600 seeded runs pass the chi-square test against the target's exact distribution."""
    from tests.test_spec_sampling import (
        RUNS, chi_square, critical, exact_distribution, sampling_noise_tv, speculative_counts, tiny, total_variation,
    )

    target = tiny(0)
    torch.manual_seed(1)
    draft = DFlash2Draft(target.config, (1,), 1, 3, 3, conv_group_size=8, selector_rank=4, selector_top_k=2)
    randomize(draft, std=1.0)
    model = DFlash2Model(target, draft).eval()
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    drafter = DFlash2Drafter(model)
    counts = speculative_counts(target, drafter, sampler, RUNS, gamma=2)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)


def test_the_chunked_loss_equals_the_whole_logits_and_trains_the_selector():
    """model.loss_chunk_tokens: loss, side sums (selector_ce among them) and every gradient equal the whole-logits path
    (float64); the selector term reaches the selector; selector_weight = 0 leaves the DFlash loss."""
    from treadle.config import DraftConfig
    from treadle.drafts.dflash.objective import DFlashObjective
    from treadle.drafts.dflash2.objective import DFlash2Objective

    model = dflash2(top_k=128).double().train()  # a quarter of the vocabulary: many data tokens among the candidates
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 24))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1)
    labels[0, 5:9] = -100
    batch = {"input_ids": ids, "position_ids": torch.cat((torch.arange(12), torch.arange(12)))[None].expand(2, -1),
             "labels": labels, "order_position": torch.tensor([3, 4])}
    cfg = dict(kind="dflash2", target="t", block_size=6, num_layers=2, loss="mix", selector_top_k=128)
    objective = DFlash2Objective(DraftConfig(**cfg), 24, 512)
    got = {}
    for chunk in (0, 7):
        model.loss_chunk_tokens = chunk
        model.zero_grad()
        loss, side = objective(model, batch)
        loss.sum().backward()
        got[chunk] = (loss.detach(), side, {n: p.grad.clone() for n, p in model.draft_model.named_parameters()})
    (l0, s0, g0), (l1, s1, g1) = got[0], got[7]
    assert torch.allclose(l0, l1, rtol=1e-10) and s0.keys() == s1.keys() and s0["selector_ce"] > 0
    assert all(torch.allclose(s0[k].double(), s1[k].double(), rtol=1e-10) for k in s0), s0
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-8, atol=1e-12) for n in g0)
    assert g0["candidate_selector.successor_codebook"].abs().sum() > 0
    model.loss_chunk_tokens = 0
    with torch.no_grad():
        off = DFlash2Objective(DraftConfig(**cfg, selector_weight=0.0), 24, 512)(model, batch)[0]
        dflash = DFlashObjective(DraftConfig(**{**cfg, "kind": "dflash", "selector_top_k": None}), 24, 512)
        assert torch.equal(off, dflash(model, batch)[0]) and (l0 > off).all()


def test_the_export_is_what_vllms_dflash2_loader_reads(tmp_path):
    """The contract, from vLLM's qwen3_dflash2.py (DFlash2Qwen3DecoderLayer, CandidateSelector, the registry's
    "DFlash2DraftModel") and z-lab's released config and tensor table (z-lab/dflash tests/fixtures/dflash2-*.json):
    dflash_config's four required keys; per layer attention_conv / mlp_conv base_kernel [2, taps, d] and
    kernel_projection [2 * taps * d / conv_group_size, d]; the selector's codebooks [vocab, rank] and
    hidden_projection [rank, d]; DFlash's names otherwise; no embedding, head or auto_map. Read back: the same draft;
    a tensor missing, a required key missing or another logit transform is refused in one line."""

    model = dflash2(layers=3)
    draft = model.draft_model
    weights = {k: v.detach() for k, v in draft.state_dict().items()}
    tensors, config = DFLASH2.export(draft, weights, model.target.config, torch.float32, "fp32", {})
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["is_causal"] is False and "auto_map" not in config and config["layer_types"] == ["full_attention"] * 3
    dc = config["dflash_config"]
    assert {k: dc[k] for k in layout.KEYS} == {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 16,
                                               "selector_top_k": 4}
    assert dc["target_layer_ids"] == [0, 2] and dc["block_size"] == 6 and dc["mask_token_id"] == 511
    assert "final_logit_softcapping" not in dc and "output_multiplier" not in dc  # Llama: no logit transform
    d, taps, group, rank, vocab = 32, 2, 8, 16, 512
    want = {"candidate_selector.hidden_projection.weight": (rank, d),
            "candidate_selector.predecessor_codebook": (vocab, rank),
            "candidate_selector.successor_codebook": (vocab, rank), "fc.weight": (d, 2 * d),
            "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(3):
        for conv in ("attention_conv", "mlp_conv"):
            want[f"layers.{i}.{conv}.base_kernel"] = (2, taps, d)
            want[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (d // group), d)
        want |= {f"layers.{i}.{n}.weight": s for n, s in (
            ("input_layernorm", (d,)), ("post_attention_layernorm", (d,)), ("self_attn.q_proj", (d, d)),
            ("self_attn.k_proj", (16, d)), ("self_attn.v_proj", (16, d)), ("self_attn.o_proj", (d, d)),
            ("self_attn.q_norm", (8,)), ("self_attn.k_norm", (8,)), ("mlp.gate_proj", (64, d)),
            ("mlp.up_proj", (64, d)), ("mlp.down_proj", (d, 64)))}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    directory = tmp_path / "zlab"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file({"model." + k: v for k, v in tensors.items()}, str(directory / "model.safetensors"))
    again = DFLASH2.load(directory, model.target).draft_model
    assert again.conv_shape == (2, 8) and again.selector.top_k == 4 and again.block_size == 6
    assert all(torch.equal(again.state_dict()[k], v) for k, v in weights.items())
    for bad, match in ((dict(dc, selector_rank=None), "dflash_config.selector_rank = None"),
                       (dict(dc, output_multiplier=0.5), "output_multiplier = 0.5 but the target's")):
        (directory / "config.json").write_text(json.dumps({**config, "dflash_config": bad}))
        with pytest.raises(UserError, match=match):
            DFLASH2.load(directory, model.target)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in tensors.items() if "mlp_conv" not in k}, str(directory / "model.safetensors"))
    with pytest.raises(UserError, match="missing"):
        DFLASH2.load(directory, model.target)


def test_a_softcapped_targets_transform_is_written_where_vllm_reads_it():
    """vLLM applies dflash_config.final_logit_softcapping / output_multiplier to the candidates' logits; treadle's
    draft scores through the target's transform (Gemma 2's cap, Granite's logits_scaling), so the export says so."""
    from transformers import Gemma2Config, GraniteConfig

    assert layout.logit_keys(Gemma2Config(final_logit_softcapping=30.0)) == {"final_logit_softcapping": 30.0}
    assert layout.logit_keys(GraniteConfig(logits_scaling=4.0)) == {"output_multiplier": 0.25}
    assert layout.logit_keys(LlamaConfig()) == {}


def test_dflash2_run_trains_resumes_exports_imports_and_decodes(shards, eagle3_target_dir, tmp_path, capsys):
    target_dir = eagle3_target_dir
    a, b = tmp_path / "a", tmp_path / "b"
    common = (*BLOCK, "--draft.loss=mix", "--optim.lr=1e-2", "--draft.anchors=4")
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=4", "--checkpoint.every=2", *common)) == 0
    loss = records(a)
    assert loss[4] < loss[1]
    for key in ("acc_1", "acc_5", "eal", "selector_ce", "draft_ce", "eval_loss", "tau_sim"):
        assert records(a, key), key
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=4", *common,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    assert [loss[s] for s in (3, 4)] == [records(b)[s] for s in (3, 4)]
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    config = json.loads((a / "draft" / "config.json").read_text())
    assert config["treadle_draft_kind"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert "candidate_selector.successor_codebook" in wa and not [k for k in wa if "embed" in k or "lm_head" in k]
    assert wa["candidate_selector.successor_codebook"].abs().sum() > 0  # trained off its zero start
    # draft.init: the export again, its first eval loss the trained draft's last; a contradicting key refused.
    c = tmp_path / "c"
    assert main(draft_args(shards, target_dir, c, "--train.max_steps=2", *common, f"--draft.init={a}")) == 0
    assert records(c, "eval_loss")[0] == pytest.approx(records(a, "eval_loss")[4], rel=1e-5)
    assert main(draft_args(shards, target_dir, tmp_path / "d", "--train.max_steps=2", *BLOCK[:-1],
                           "--draft.selector_top_k=8", f"--draft.init={a}")) == 2
    assert "draft.selector_top_k = 8 but draft.init" in capsys.readouterr().err
    out = tmp_path / "spec.json"
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(a), "--num-prompts", "2", "--gamma", "5",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "dflash2" and got["draft_forwards_per_round"] == 1.0
