"""DFlash block draft: the block mask, training forward against the decode-time drafter, lossless decoding, the
z-lab layout's contract with vLLM's and SGLang's loaders, and runs end to end (train, resume, export, import)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import SPEC_EVAL, TARGET, assert_greedy_lossless, draft_args, records
from treadle.cli import main
from treadle.drafts.dflash import layout
from treadle.drafts.dflash.drafter import DFlashDrafter
from treadle.drafts.dflash.model import DFlashDraft, DFlashModel, block_mask, default_feature_layers, load_dflash
from treadle.drafts.dflash.objective import dpace_weights, sample_anchors, scored_slots, slot_weights
from treadle.drafts.targets import capture_features
from treadle.drafts.glide.model import document_ids
from treadle.models.hf import greedy_continuations
from treadle.speculative.decode import TargetState, crop_cache, speculative_generate, target_generate
from treadle.speculative.sampling import Sampler

BLOCK = ("--draft.kind=dflash", "--draft.block_size=6", "--draft.num_layers=2", "--draft.gamma=4")


def dflash(seed=1, block_size=6, layers=2):
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4}))
    model = DFlashModel(target, DFlashDraft(target.config, (1, 3), layers, block_size, 511)).eval()
    for p in model.draft_model.parameters():  # sharp attention and logits: a wrong position or mask changes argmaxes
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return model


def test_default_feature_layers_are_zlabs_plus_one():
    # z-lab's build_target_layer_ids: Qwen3-8B [1, 9, 17, 25, 33], Llama-3.1-8B [1, 8, 15, 22, 29]; treadle holds +1.
    assert default_feature_layers(36, 5) == (2, 10, 18, 26, 34)
    assert default_feature_layers(32, 5) == (2, 9, 16, 23, 30)
    assert default_feature_layers(32, 1) == (17,)
    assert default_feature_layers(4, 5) == (1, 2, 3) and default_feature_layers(2, 5) == (1,)  # shallow targets
    from treadle.drafts.dflash.model import default_mask_token

    assert default_mask_token(151936, 151669) == 151669 and default_mask_token(512, 512) == 511  # Qwen3's; the last
    assert layout.to_zlab((2, 10, 18)) == [1, 9, 17] and layout.from_zlab([1, 9, 17]) == (2, 10, 18)


def test_block_mask_matches_a_naive_reference():
    """Block j reads context t iff t < its anchor in the anchor's document, and its own block: by position, so
    overlapping anchors (5 and 6 here) never see each other's later context."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]])
    doc = document_ids(pos)
    anchors = torch.tensor([[0, 3, 5, 6, 10]])
    bs, T, N = 3, 11, 5
    got = block_mask(doc, anchors, bs)[0, 0]
    assert got.shape == (N * bs, T + N * bs)
    for q in range(N * bs):
        j, a = q // bs, int(anchors[0, q // bs])
        for key in range(T + N * bs):
            want = (key < a and doc[0, key] == doc[0, a]) if key < T else (key - T) // bs == j
            assert bool(got[q, key]) == want, (q, key)


def test_anchors_and_scored_slots():
    labels = torch.tensor([[5, 6, 7, -100, 8, 9, 10, 11, -100, -100]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0]])
    anchors, valid = sample_anchors(labels, 8, [3])
    picked = anchors[valid].tolist()
    assert picked == sorted(picked) and len(picked) == 7 and all(labels[0, a] != -100 for a in picked)
    assert not valid[0, 7] and torch.equal(sample_anchors(labels, 8, [3])[0], anchors)  # seeded: the same again
    scored, tokens = scored_slots(labels, document_ids(pos), torch.tensor([[1, 5, 6, 2]]),
                                  torch.tensor([[True, True, True, False]]), 4)
    # anchor 1: slots 1, 2 (tokens 2, 3 = labels[1], labels[2]); slot 3 would be token 4, another document
    assert scored[0, 0].tolist() == [True, True, False] and tokens[0, 0, :2].tolist() == [6, 7]
    # anchor 5: tokens 6, 7, 8 in its document; anchor 6: token 9 is the next document's
    assert scored[0, 1].tolist() == [True, True, True] and tokens[0, 1].tolist() == [9, 10, 11]
    assert scored[0, 2].tolist() == [True, True, False] and not scored[0, 3].any()  # padding anchors: nothing
    assert slot_weights(4, 7.0)[0] == 1.0 and slot_weights(4, 7.0)[2] == pytest.approx(2.718281828 ** (-2 / 7))


def test_dpace_weights_match_a_naive_reference_and_need_ce():
    import math

    from treadle.config import load_config
    from treadle.errors import UserError

    ce = torch.tensor([[0.1, 2.0, 0.5, 0.3]], requires_grad=True)
    scored = torch.tensor([[True, True, True, False]])
    got = dpace_weights(ce, scored)
    q = [0.5 * math.exp(-float(c)) + 0.5 for c in ce[0].tolist()][:3] + [0.0]
    want = [sum(math.prod(q[: m + 1]) for m in range(j, 4)) for j in range(4)]
    assert got[0].tolist() == pytest.approx(want) and not got.requires_grad and got[0, 3] == 0
    # Through the objective: D-PACE's loss equals the per-slot CE weighted by dpace_weights, and trains the draft.
    from treadle.config import DraftConfig
    from treadle.drafts.dflash.objective import DFlashObjective

    model = dflash()
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 24))
    batch = {"input_ids": ids, "position_ids": torch.arange(24).expand(2, -1),
             "labels": torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1), "order_position": torch.tensor([0, 1])}
    cfg = dict(kind="dflash", target="t", block_size=6, num_layers=2, loss="ce")
    decay = DFlashObjective(DraftConfig(**cfg), 24, 512)(model, batch)[0]
    dpace = DFlashObjective(DraftConfig(**cfg, slot_weighting="dpace"), 24, 512)(model, batch)[0]
    assert decay.shape == dpace.shape == (2,) and not torch.allclose(decay, dpace)
    dpace.sum().backward()
    assert model.draft_model.fc.weight.grad.abs().sum() > 0
    with pytest.raises(UserError, match="slot_weighting = 'dpace' with draft.loss = 'kl'"):
        load_config(None, ["--data.train=x", "--draft.kind=dflash", "--draft.target=t", "--draft.loss=kl",
                           "--draft.slot_weighting=dpace"])


def test_training_blocks_are_what_the_drafter_proposes_and_see_no_later_context():
    """Round after round (features handed over incrementally, the context cache kept), the drafter's block is the
    training forward's block anchored at the bonus; and the training block's slots do not move when every token
    after its anchor changes (no context leak)."""
    model, prompt_len = dflash(), 6
    torch.manual_seed(2)
    text = greedy_continuations(model.target, torch.randint(0, 512, (1, prompt_len)), 10)
    L = text.shape[1]
    positions = torch.arange(L)[None]
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=text, position_ids=positions)
        features = tap.take()
    anchors = torch.arange(prompt_len, L)[None]
    with torch.no_grad():
        train_logits = model(text, positions, anchors).logits[0]  # [N, K, V]
    drafter = DFlashDrafter(model)
    drafter.reset(text[:, :prompt_len])
    given = 0
    for s in range(prompt_len, L):  # the bonus at s: the target has processed tokens < s
        state = TargetState(None, features[:, given:s])
        given = s
        with torch.no_grad():
            drafter._absorb(text[:, : s + 1], state)
            logits = drafter.block_logits(text[:, : s + 1])
        assert torch.allclose(logits, train_logits[s - prompt_len], atol=1e-4), s
        proposals = drafter.propose(text[:, : s + 1], TargetState(None, features[:, s:s]), 4, Sampler()).tokens
        assert proposals == train_logits[s - prompt_len, :4].argmax(-1).tolist()
    assert drafter.forwards == 2 * (L - prompt_len)  # one forward per block
    # tau_sim's chain guesses (every anchor of the text at once) are the drafter's proposals too.
    with torch.no_grad():
        guesses = model.chain_guesses(text, 4, chunk=3)
    for s in range(prompt_len, L - 4):
        assert [int(guesses[k][0, s + k]) for k in range(4)] == train_logits[s - prompt_len, :4].argmax(-1).tolist()
    assert int(guesses[2][0, 1]) == -1  # step 3's entry 1 would need a block anchored at index -1
    from treadle.speculative.acceptance import chain_acceptance

    acc = chain_acceptance(model, text, prompt_len, 4)
    assert acc["tau_sim"] == pytest.approx(1 + sum(acc["acceptance_unconditional"]))
    changed = text.clone()
    changed[:, 9:] = (changed[:, 9:] + 7) % 512
    with torch.no_grad():
        a = model(text, positions, torch.tensor([[8]])).logits
        b = model(changed, positions, torch.tensor([[8]])).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_dflash_speculative_decoding_is_lossless():
    """Greedy: the target's own greedy continuation, token for token, at every gamma up to block_size - 1; a draft
    whose slots are the target itself (the head reading a copy) gets drafts accepted, so partial acceptance and
    the context hand-over are exercised. Sampled: each q row sums to one and gives its token mass."""
    model = dflash()
    prompt, want = assert_greedy_lossless(model, DFlashDrafter)
    with pytest.raises(ValueError, match="block_size - 1 = 5"):
        speculative_generate(model.target, DFlashDrafter(model), prompt, gamma=6, max_new_tokens=8)

    class Oracle(DFlashDrafter):  # slot k says the target's greedy token: every draft accepted, rounds of 1 + gamma
        def block_logits(self, context_ids):
            done = context_ids.shape[1] - prompt.shape[1]
            cont = torch.tensor((want + [0] * 8)[done : done + self.block_size - 1])
            return torch.nn.functional.one_hot(cont, 512).float() * 10

    got = speculative_generate(model.target, Oracle(model), prompt, gamma=5, max_new_tokens=24)
    assert got.tokens == want and min(got.accepted_per_call[:-1]) == 5
    drafter = DFlashDrafter(model)
    drafter.reset(prompt)
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=prompt[:, :-1])
        features = tap.take()
    p = drafter.propose(prompt, TargetState(None, features), 5, Sampler(1.0, generator=torch.Generator().manual_seed(0)))
    assert p.q.shape == (5, 512) and torch.allclose(p.q.sum(-1), torch.ones(5))
    assert all(float(p.q[i, t]) > 0 for i, t in enumerate(p.tokens))


def test_the_export_is_what_vllm_and_sglang_load(tmp_path):
    """The contract, written from vLLM's ``qwen3_dflash.py`` and SGLang's ``models/dflash.py`` /
    ``dflash_utils.py`` loaders: the layer ids they capture (z-lab id + 1) are the draft's feature layers; every
    tensor name maps onto a parameter of their module (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and every
    parameter is covered; no embedding or head; block size, mask token and rotary base explicit."""
    from treadle.drafts.dflash.kind import DFLASH

    model = dflash(layers=3)
    draft = model.draft_model
    weights = {k: v.detach() for k, v in draft.state_dict().items()}
    tensors, config = DFLASH.export(draft, weights, model.target.config, torch.float32, "fp32", {})
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    dc = config["dflash_config"]
    # vLLM: aux layers = target_layer_ids + 1; SGLang: ids in [0, num_target_layers), its hook captures id + 1.
    assert [i + 1 for i in dc["target_layer_ids"]] == [1, 3]
    assert all(0 <= i < config["num_target_layers"] for i in dc["target_layer_ids"])
    assert config["num_target_layers"] == 4 and config["num_hidden_layers"] == 3
    # SGLang reads block_size from dflash_config first, then top-level; vLLM's / z-lab's from the top level.
    assert dc.get("block_size", config.get("block_size")) == 6 == config["block_size"]
    assert isinstance(dc["mask_token_id"], int) and 0 <= dc["mask_token_id"] < config["vocab_size"] == 512
    assert config["hidden_act"] == "silu" and not config["attention_bias"]  # SGLang: silu only
    assert config["layer_types"] == ["full_attention"] * 3 and "causal" not in dc  # bidirectional in both engines
    assert config["rope_theta"] == 10000.0  # vLLM assumes 1e6 for a DFlash config without one
    assert config["tie_word_embeddings"] is False and not config.get("is_neox_style", True) is False
    # SGLang's module parameters, after its stacked mapping (it ignores any other name without a word).
    d, hd, kv = 32, 8, 2
    sglang = {"fc.weight": (d, 2 * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(3):
        p = f"layers.{i}."
        sglang.update({p + "self_attn.qkv_proj.weight": (d + 2 * kv * hd, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_up_proj.weight": (2 * 64, d), p + "mlp.down_proj.weight": (d, 64),
                       p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
               ".up_proj": ".gate_up_proj"}
    loaded: dict[str, int] = {}
    for name, t in tensors.items():
        assert "embed_tokens" not in name and "lm_head" not in name
        for old, new in stacked.items():
            if old + "." in name:
                name = name.replace(old, new)
                break
        assert name in sglang, name
        loaded[name] = loaded.get(name, 0) + t.shape[0]
        assert t.shape[1:] == sglang[name][1:]
    assert {k: v[0] for k, v in sglang.items()} == loaded
    # Read back, the same draft; an engine's "model." prefix and a shipped head are accepted, a stray name is not.
    save_dir = tmp_path / "zlab"
    save_dir.mkdir()
    (save_dir / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({"model." + k: v for k, v in tensors.items()} | {"lm_head.weight": torch.zeros(512, 32)},
              str(save_dir / "model.safetensors"))
    again = load_dflash(save_dir, model.target).draft_model
    assert again.feature_layers == (1, 3) and again.block_size == 6 and again.mask_token_id == 511
    assert all(torch.equal(again.state_dict()[k], v) for k, v in weights.items())
    from treadle.errors import UserError

    save_file(tensors | {"layers.0.self_attn.sinks": torch.zeros(4)}, str(save_dir / "model.safetensors"))
    with pytest.raises(UserError, match="unknown"):
        load_dflash(save_dir, model.target)


def test_dflash_run_trains_resumes_exports_imports_and_decodes(shards, eagle3_target_dir, tmp_path, capsys):
    target_dir = eagle3_target_dir
    a, b = tmp_path / "a", tmp_path / "b"
    common = (*BLOCK, "--draft.loss=mix", "--optim.lr=1e-2", "--draft.anchors=4")
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=6", "--checkpoint.every=3", *common)) == 0
    loss = records(a)
    assert loss[6] < loss[1]
    for key in ("acc_1", "acc_5", "eal", "draft_kl", "draft_ce", "target_loss", "eval_loss", "tau_sim"):
        assert records(a, key), key
    assert not records(a, "ttt_rows_1") and not records(a, "block_rows_1") and not records(a, "acc_6")
    assert 0.0 <= records(a, "eal")[6] <= 5.0
    # Exact resume from step 3.
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=6", *common,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_3'}")) == 0
    lb = records(b)
    assert [loss[s] for s in (4, 5, 6)] == [lb[s] for s in (4, 5, 6)]
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # The export: z-lab's layout, no target tensor.
    config = json.loads((a / "draft" / "config.json").read_text())
    assert config["treadle_draft_kind"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [0, 2] and config["block_size"] == 6
    assert config["dflash_config"]["mask_token_id"] == 511  # the data's tokenizer fills all 512 rows: the last
    # the tokenizer's ids (<|endoftext|> = 0), not the target config's (LlamaConfig's defaults: bos 1, eos 2)
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 0)
    assert "fc.weight" in wa and not [k for k in wa if "embed" in k or "lm_head" in k]
    assert (a / "draft" / "dflash.py").read_bytes() == layout.remote_code()  # what auto_map names
    # treadle export rebuilds the same export from the last checkpoint.
    assert main(["export", str(a), str(tmp_path / "again")]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == wa.keys() and all(torch.equal(again[k], wa[k]) for k in wa)
    assert (tmp_path / "again" / "dflash.py").is_file()
    # A draft.init run starts from the export: its first eval loss is the trained draft's last.
    c = tmp_path / "c"
    assert main(draft_args(shards, target_dir, c, "--train.max_steps=2", *common, f"--draft.init={a}")) == 0
    assert records(c, "eval_loss")[0] == pytest.approx(records(a, "eval_loss")[6], rel=1e-5)
    assert main(draft_args(shards, target_dir, tmp_path / "d", "--train.max_steps=2", *common, f"--draft.init={a}",
                           "--draft.block_size=8")) == 2
    # spec-eval decodes losslessly with the export; sampled verification runs.
    out = tmp_path / "spec.json"
    capsys.readouterr()
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(a), "--num-prompts", "2", "--gamma", "5",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "dflash" and 1.0 <= got["tau"] <= 6.0
    assert got["draft_forwards_per_round"] == 1.0 and got["device"] == "cpu"  # one forward drafts the block
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(a), "--num-prompts", "2", "--gamma", "5",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--temperature", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["lossless"] is None


@pytest.mark.usefixtures("one_thread")
def test_dflash_sampled_verification_has_the_targets_distribution():
    """tests/test_spec_sampling.py's test with a DFlash drafter (block 3, its slots drawn from their own q rows):
    the first 3 tokens of 600 seeded runs pass the chi-square test against the target's exact distribution and stay
    within twice sampling noise in total variation."""
    from tests.test_spec_sampling import (
        RUNS, chi_square, critical, exact_distribution, sampling_noise_tv, speculative_counts, tiny, total_variation,
    )

    target = tiny(0)
    torch.manual_seed(1)
    model = DFlashModel(target, DFlashDraft(target.config, (1,), 1, 3, 3)).eval()
    for p in model.draft_model.parameters():  # a confident draft, far from the target and from uniform
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=1.0)
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    drafter = DFlashDrafter(model)
    counts = speculative_counts(target, drafter, sampler, RUNS, gamma=2)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)
    assert drafter.forwards >= RUNS  # at least one block per run


def test_a_tied_embedding_target_scores_through_its_embedding():
    """SpecForge #473: a tied target's head is its embedding, never a random matrix."""
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "tie_word_embeddings": True}))
    model = DFlashModel(target, DFlashDraft(target.config, (1,), 1, 4, 511)).eval()
    assert model.target.get_output_embeddings().weight is model.target.get_input_embeddings().weight
    hidden = torch.randn(3, 32)
    want = hidden @ model.target.get_input_embeddings().weight.T
    assert torch.allclose(model.draft_logits(hidden), want, atol=1e-5)


def test_the_chunked_slot_scores_equal_the_whole_logits():
    """model.loss_chunk_tokens: the loss, every side sum and the draft's gradients equal the whole-logits path
    (float64), with no [slots, V] logits kept."""
    from treadle.config import DraftConfig
    from treadle.drafts.dflash.objective import DFlashObjective

    model = dflash().double().train()
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 24))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1)
    labels[0, 5:9] = -100
    batch = {"input_ids": ids, "position_ids": torch.cat((torch.arange(12), torch.arange(12)))[None].expand(2, -1),
             "labels": labels, "order_position": torch.tensor([3, 4])}
    objective = DFlashObjective(DraftConfig(kind="dflash", target="t", block_size=6, num_layers=2, loss="mix"), 24, 512)
    got = {}
    for chunk in (0, 7):
        model.loss_chunk_tokens = chunk
        model.zero_grad()
        loss, side = objective(model, batch)
        loss.sum().backward()
        got[chunk] = (loss.detach(), side, {n: p.grad.clone() for n, p in model.draft_model.named_parameters()})
    (l0, s0, g0), (l1, s1, g1) = got[0], got[7]
    assert torch.allclose(l0, l1, rtol=1e-10) and s0.keys() == s1.keys()
    assert all(torch.allclose(s0[k].double(), s1[k].double(), rtol=1e-10) for k in s0), s0
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-8, atol=1e-12) for n in g0)


def test_the_export_opens_as_zlabs_drafts_do_and_drafts_as_treadle(eagle3_target_dir, tmp_path):
    """Issue 39.3: the export's config.json names ``dflash.DFlashDraftModel`` in ``auto_map``, and the export carries
    that dflash.py (treadle's, z-lab's class, config and weight names), so ``AutoModel.from_pretrained(dir,
    trust_remote_code=True)`` opens it as z-lab's drafts open. Loaded that way in float64 it gives treadle's block
    logits at every anchor, its context fed once and then one token per round through the draft's KV cache as a
    decode does; and its ``spec_generate`` writes the target's own greedy output and stops at a stop token."""
    from transformers import AutoModel, DynamicCache

    from treadle.checkpoint.export import export_draft
    from treadle.config import DraftConfig
    from treadle.drafts.targets import target_identity

    model = dflash()
    out = export_draft(model, model.state_dict(), tmp_path / "export", eagle3_target_dir,
                       target_identity(eagle3_target_dir, model.target), DraftConfig(kind="dflash", target="t"))
    assert json.loads((out / "config.json").read_text())["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert (out / "dflash.py").read_bytes() == layout.remote_code()
    assert "treadle" not in "".join(line for line in (out / "dflash.py").read_text().splitlines()
                                    if line.startswith(("import", "from")))  # a user needs no treadle to load it
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float64).eval()
    assert type(hf).__name__ == "DFlashDraftModel"
    assert hf.target_layer_ids == [0, 2] and hf.block_size == 6 and hf.mask_token_id == 511
    assert set(hf.state_dict()) == set(load_file(out / "model.safetensors"))  # every weight by z-lab's name

    model.double()  # the export is fp32: both sides now hold the same weights, in float64
    torch.manual_seed(3)
    text, prompt_len, bs = torch.randint(0, 510, (1, 14)), 6, 6
    L = text.shape[1]
    with torch.no_grad():
        want = model(text, torch.arange(L)[None], torch.arange(prompt_len, L)[None]).logits[0]  # [N, bs - 1, V]
        features = hf.context_features(model.target(input_ids=text, output_hidden_states=True).hidden_states)
        cache, cached = DynamicCache(), 0
        for s in range(prompt_len, L):  # the anchor at s: context rows cached..s - 1 are new to the draft
            block = torch.tensor([[int(text[0, s])] + [hf.mask_token_id] * (bs - 1)])
            hidden = hf(position_ids=torch.arange(cached, s + bs)[None],
                        noise_embedding=model.target.get_input_embeddings()(block),
                        target_hidden=features[:, cached:s], past_key_values=cache, use_cache=True)
            crop_cache(cache, s)  # the block's rows dropped, as a decode does
            cached = s
            got = model.target.lm_head(hidden[0, 1:])
            assert torch.allclose(got, want[s - prompt_len], atol=1e-10, rtol=0), s
    prompt = text[:, :prompt_len]
    greedy, _ = target_generate(model.target, prompt, 20)
    ids = hf.spec_generate(target=model.target, input_ids=prompt, max_new_tokens=20, stop_token_ids=None,
                           temperature=0.0)
    assert ids[0, :prompt_len].tolist() == prompt[0].tolist() and ids[0, prompt_len:].tolist() == greedy
    stop = greedy[7]
    ids = hf.spec_generate(target=model.target, input_ids=prompt, max_new_tokens=20, stop_token_ids=[stop],
                           temperature=0.0)
    assert ids[0, prompt_len:].tolist() == greedy[: greedy.index(stop) + 1]
    torch.manual_seed(0)  # sampled: the target's own sample at every position, so any length-20 continuation
    ids = hf.spec_generate(target=model.target, input_ids=prompt, max_new_tokens=20, temperature=1.0)
    assert ids.shape == (1, prompt_len + 20) and int(ids.max()) < 512
