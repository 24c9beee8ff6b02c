"""DSpark block draft: the training forward against the decode-time drafter (float64), the confidence early stop,
lossless and distribution-exact decoding, chunked scores, the Qwen3DSparkModel layout's contract with vLLM's and
SGLang's loaders, imports of drafts written elsewhere, and a run end to end (train, resume, export, import, decode)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import SPEC_EVAL, TARGET, assert_greedy_lossless, draft_args, records
from treadle.cli import main
from treadle.drafts.dspark import layout
from treadle.drafts.dspark.drafter import DSparkDrafter, kept_drafts
from treadle.drafts.dspark.build import load_dspark
from treadle.drafts.dspark.model import DSparkDraft, DSparkModel
from treadle.drafts.dspark.objective import dspark_slots
from treadle.drafts.targets import capture_features
from treadle.errors import UserError
from treadle.models.hf import greedy_continuations
from treadle.speculative.decode import TargetState, speculative_generate
from treadle.speculative.sampling import Sampler

BLOCK = ("--draft.kind=dspark", "--draft.block_size=5", "--draft.num_layers=2", "--draft.gamma=4",
         "--draft.markov_rank=8")


def dspark(seed=1, block_size=5, layers=2, rank=8):
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4}))
    model = DSparkModel(target, DSparkDraft(target.config, (1, 3), layers, block_size, 511, rank)).eval()
    for p in model.draft_model.parameters():  # sharp attention, logits and Markov bias: a wrong input changes argmaxes
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return model


def test_training_slots_are_what_the_drafter_samples_in_float64():
    """Round after round, the drafter's slot logits and confidence logits (Markov head fed its own drafts) equal the
    training forward's (teacher-forced on the same tokens) in float64, its greedy proposals are the training
    argmaxes, tau_sim's chain guesses are the drafter's proposals, and no slot reads context after its anchor."""
    model = dspark().double()
    prompt_len = 6
    torch.manual_seed(2)
    text = greedy_continuations(model.target, torch.randint(0, 512, (1, prompt_len)), 10)
    L = text.shape[1]
    positions = torch.arange(L)[None]
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=text, position_ids=positions)
        features = tap.take()
    anchors = torch.arange(prompt_len, L - 5)[None]
    draft = model.draft_model
    with torch.no_grad():
        hidden = model._blocks(text, positions, model._target_forward(text, positions, hidden=True)[1], anchors,
                               torch.ones_like(text))[0]  # [N, 5, d]
        rows = (anchors[0, :, None] + torch.arange(5)).clamp_max(L - 1)
        embed = draft.markov_w1(text[0, rows])
        train_logits = model.slot_logits(hidden, embed)
        train_conf = draft.confidence_logit(hidden, embed)
    drafter = DSparkDrafter(model)
    drafter.reset(text[:, :prompt_len])
    given = 0
    for i, s in enumerate(range(prompt_len, L - 5)):
        drafter._absorb(text[:, : s + 1], TargetState(None, features[:, given:s]))
        given = s
        with torch.no_grad():
            h = drafter.block_hidden(text[:, : s + 1])
        assert torch.allclose(h, hidden[i], atol=1e-12, rtol=0)
        # the drafter's own per-slot computation, fed the text's tokens as its previous drafts
        prev = text[0, s : s + 5]
        with torch.no_grad():
            got = torch.stack([model.slot_logits(h[k], draft.markov_w1(prev[k])) for k in range(5)])
        assert torch.allclose(got, train_logits[i], atol=1e-12, rtol=0), s
        proposal = drafter.propose(text[:, : s + 1], TargetState(None, features[:, s:s]), 5, Sampler())
        greedy = [int(train_logits[i, 0].argmax())]
        for k in range(1, 5):  # the Markov head reads the drafter's own previous draft
            with torch.no_grad():
                greedy.append(int(model.slot_logits(h[k], draft.markov_w1(torch.tensor(greedy[-1]))).argmax()))
        assert proposal.tokens == greedy
        assert torch.allclose(drafter.last_confidence[0].double(), train_conf[i, 0], atol=1e-6)
    with torch.no_grad():
        guesses = model.chain_guesses(text, 4, chunk=3)
    for i, s in enumerate(range(prompt_len, L - 5)):
        assert [int(guesses[k][0, s + k]) for k in range(4)] == train_logits[i, :4].argmax(-1).tolist()
    changed = text.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % 512  # every token after anchor 9
    with torch.no_grad():
        h = [model._blocks(t, positions, model._target_forward(t, positions, hidden=True)[1], torch.tensor([[9]]),
                           torch.ones_like(t)) for t in (text, changed)]
        kl = [model(t, positions, torch.tensor([[9]])).kl[0, 0, 0] for t in (text, changed)]
    assert torch.allclose(h[0], h[1], atol=1e-12) and torch.allclose(kl[0], kl[1], atol=1e-12) and kl[0] > 0


def test_dspark_slots_are_dflash_slots_shifted_and_contiguous():
    labels = torch.tensor([[5, 6, -100, 8, 9, 10, -100, -100]])
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    anchors, valid = torch.tensor([[0, 3]]), torch.tensor([[True, True]])
    scored, tokens = dspark_slots(labels, doc, anchors, valid, 3)
    # anchor 0: slots read labels[0], labels[1], labels[2] (-100): the third and after unscored
    assert scored[0, 0].tolist() == [True, True, False]
    # anchor 3: labels[3], labels[4] set; labels[5] is in document 1: not scored
    assert scored[0, 1].tolist() == [True, True, False] and tokens[0, 1, :2].tolist() == [8, 9]


def test_confidence_rules_are_the_engines():
    c = torch.tensor([2.0, 0.1, 3.0, -1.0])  # sigmoid: .881 .525 .953 .269
    assert kept_drafts(c, 0.0, "sglang") == 4 == kept_drafts(c, 0.0, "vllm")  # both engines' default
    assert kept_drafts(c, 0.5, "sglang") == 3  # SGLang: up to the first slot below the threshold
    assert kept_drafts(c, 0.5, "vllm") == 1  # vLLM: prefix survival .881, .463, ...
    assert kept_drafts(c, 0.9, "sglang") == 0


def test_dspark_speculative_decoding_is_lossless_with_and_without_the_early_stop():
    model = dspark()
    prompt, want = assert_greedy_lossless(model, DSparkDrafter)
    with pytest.raises(ValueError, match="block_size = 5"):
        speculative_generate(model.target, DSparkDrafter(model), prompt, gamma=6, max_new_tokens=8)
    cut = DSparkDrafter(model, confidence_threshold=0.5, confidence_rule="sglang")
    with torch.no_grad():
        torch.nn.init.normal_(model.draft_model.confidence.weight, std=2.0)  # confidences spread around 0.5
    got = speculative_generate(model.target, cut, prompt, gamma=5, max_new_tokens=24)
    assert got.tokens == want
    assert len(got.accepted_per_call) > 0


@pytest.mark.usefixtures("one_thread")
def test_dspark_sampled_verification_has_the_targets_distribution():
    """tests/test_spec_sampling.py's test with a DSpark drafter (its Markov head conditions each draft on the
    previous one, and a confidence threshold cuts blocks): the first 3 tokens of 600 seeded runs pass the chi-square
    test against the target's exact distribution."""
    from tests.test_spec_sampling import (
        RUNS, chi_square, critical, exact_distribution, sampling_noise_tv, speculative_counts, tiny, total_variation,
    )

    target = tiny(0)
    torch.manual_seed(1)
    model = DSparkModel(target, DSparkDraft(target.config, (1,), 1, 3, 3, 4)).eval()
    for p in model.draft_model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=1.0)
    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    drafter = DSparkDrafter(model, confidence_threshold=0.3)
    counts = speculative_counts(target, drafter, sampler, RUNS, gamma=2)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)


def test_the_chunked_slot_scores_equal_the_whole_logits():
    """model.loss_chunk_tokens: the loss, every side sum and the draft's gradients (Markov and confidence heads
    included) equal the unchunked path in float64."""
    from treadle.config import DraftConfig
    from treadle.drafts.dspark.objective import DSparkObjective

    model = dspark().double().train()
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 24))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), 1)
    labels[0, 5:9] = -100
    batch = {"input_ids": ids, "position_ids": torch.cat((torch.arange(12), torch.arange(12)))[None].expand(2, -1),
             "labels": labels, "order_position": torch.tensor([3, 4])}
    objective = DSparkObjective(DraftConfig(kind="dspark", target="t", block_size=5, num_layers=2, loss="mix",
                                            markov_rank=8), 24, 512)
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
    assert g0["markov_w2.weight"].abs().sum() > 0 and g0["confidence.bias"].abs().sum() > 0
    assert s0["ttt_rows_5"] > 0 and "confidence_bce" in s0


def _vllm_and_sglang_params(d=32, hd=8, kv=2, layers=2, rank=8, vocab=512, inter=64):
    """The parameters vLLM's Qwen3DSparkForCausalLM (vllm/model_executor/models/qwen3_dspark.py @0302ff40: the
    DFlash Qwen3 model's stacked qkv/gate_up, ``markov_head.markov_w{1,2}``, ``confidence_head.proj`` with bias,
    input dim hidden + rank) and SGLang's DSparkDraftMixin (python/sglang/srt/models/dspark.py @01f47623) build,
    after their ``model.``-less name mapping; embed_tokens / lm_head are the target's in both."""
    params = {"fc.weight": (d, 2 * d), "hidden_norm.weight": (d,), "norm.weight": (d,),
              "markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank),
              "confidence_head.proj.weight": (1, d + rank), "confidence_head.proj.bias": (1,)}
    for i in range(layers):
        p = f"layers.{i}."
        params.update({p + "self_attn.qkv_proj.weight": (d + 2 * kv * hd, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_up_proj.weight": (2 * inter, d), p + "mlp.down_proj.weight": (d, inter),
                       p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    return params


def test_the_export_is_what_vllm_and_sglang_load(tmp_path):
    """The contract, from the engines' loaders: the architecture vLLM's registry maps to Qwen3DSparkForCausalLM,
    every tensor onto one of their parameters and every parameter covered, the slot convention both read
    (dspark_bonus_anchor false, sample_from_anchor true; SGLang refuses speculators_model_type), markov_rank > 0 and
    markov_head_type (SGLang requires both), draft_vocab_size = vocab_size = the target's with no d2t (vLLM: d2t only
    for a reduced vocabulary, PR #55133), layer ids z-lab's (engines capture id + 1); read back, the same draft."""
    from treadle.drafts.dspark.kind import DSPARK

    model = dspark()
    draft = model.draft_model
    weights = {k: v.detach() for k, v in draft.state_dict().items()}
    tensors, config = DSPARK.export(draft, weights, model.target.config, torch.float32, "fp32", {})
    assert config["architectures"] == ["Qwen3DSparkModel"] and "auto_map" not in config
    assert config["dspark_bonus_anchor"] is False and config["sample_from_anchor"] is True
    assert "speculators_model_type" not in config and "transformer_layer_config" not in config
    assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["draft_vocab_size"] == config["vocab_size"] == model.target.config.vocab_size
    assert "d2t" not in tensors and "t2d" not in tensors
    assert config["target_layer_ids"] == config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert config["block_size"] == config["dflash_config"]["block_size"] == 5  # SGLang: gamma = block_size
    assert config["mask_token_id"] == config["dflash_config"]["mask_token_id"] == 511 < config["vocab_size"]
    assert config["layer_types"] == ["full_attention"] * 2 and config["num_target_layers"] == 4
    params = _vllm_and_sglang_params()
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
               ".up_proj": ".gate_up_proj"}
    loaded: dict[str, int] = {}
    for name, t in tensors.items():
        assert not name.startswith(("model.", "embed_tokens", "lm_head"))
        for old, new in stacked.items():
            if old + "." in name:
                name = name.replace(old, new)
                break
        assert name in params, name
        loaded[name] = loaded.get(name, 0) + t.shape[0]
        assert t.shape[1:] == params[name][1:], name
    assert {k: v[0] for k, v in params.items()} == loaded
    save_dir = tmp_path / "exported"
    save_dir.mkdir()
    (save_dir / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(save_dir / "model.safetensors"))
    again = load_dspark(save_dir, model.target).draft_model
    assert again.feature_layers == (1, 3) and again.block_size == 5 and again.markov_rank == 8
    assert all(torch.equal(again.state_dict()[k], v) for k, v in weights.items())


# DeepSpec's Qwen3DSparkModel (deepseek-ai/DeepSpec @afdfa7c, deepspec/modeling/dspark/qwen3/modeling.py), the
# class its evaluator loads a draft with (``from_pretrained``). DeepSpec is not on PyPI, so its constructor is stated
# here as read there: the config fields it asserts, then its modules under their names and shapes. Its attention's
# parameters are transformers' Qwen3Attention's (q/k/v/o_proj, q_norm, k_norm), and it builds Qwen3MLP, Qwen3RMSNorm
# and Qwen3RotaryEmbedding itself; its Markov head is markov_head.markov_w1 (Embedding vocab x rank) and markov_w2
# (Linear rank -> vocab, no bias, the vanilla type), its confidence head confidence_head.proj (Linear hidden + rank
# -> 1 with bias, when it reads the Markov embedding).
DEEPSPEC_REQUIRED = ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank")


def _deepspec_model_class():
    from torch import nn
    from transformers.models.qwen3.modeling_qwen3 import (Qwen3Attention, Qwen3MLP, Qwen3PreTrainedModel,
                                                          Qwen3RMSNorm, Qwen3RotaryEmbedding)

    class Layer(nn.Module):
        def __init__(self, config, index):
            super().__init__()
            self.self_attn = Qwen3Attention(config, index)
            self.mlp = Qwen3MLP(config)
            self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    class DeepSpecQwen3DSparkModel(Qwen3PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            for field in DEEPSPEC_REQUIRED:
                assert hasattr(config, field), f"config.{field} must be provided."
            if int(config.markov_rank) > 0:
                assert hasattr(config, "markov_head_type"), "markov_head_type when markov_rank > 0"
            if bool(config.enable_confidence_head):
                assert hasattr(config, "confidence_head_with_markov"), "confidence_head_with_markov when enabled"
            d, vocab, rank = config.hidden_size, config.vocab_size, int(config.markov_rank)
            self.target_layer_ids = config.target_layer_ids
            self.embed_tokens = nn.Embedding(vocab, d, padding_idx=getattr(config, "pad_token_id", None))
            self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
            self.norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
            self.rotary_emb = Qwen3RotaryEmbedding(config)
            self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
            self.hidden_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.block_size, self.num_anchors = int(config.block_size), int(config.num_anchors)
            assert str(config.markov_head_type).lower() == "vanilla"  # the gated and rnn heads have other tensors
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(vocab, rank)
            self.markov_head.markov_w2 = nn.Linear(rank, vocab, bias=False)
            with_markov = bool(config.confidence_head_with_markov)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(d + (rank if with_markov else 0), 1)
            self.post_init()

    return DeepSpecQwen3DSparkModel


def test_deepspecs_own_model_class_loads_the_export(tmp_path):
    """DeepSpec's Qwen3DSparkModel.from_pretrained on treadle's export: every field its constructor asserts is there
    (num_anchors was not: "config.num_anchors must be provided"), every tensor lands on one of its parameters with
    the same values and shape, and the only ones missing are the embedding and head it copies from the target;
    its target_layer_ids index output_hidden_states at id + 1 (extract_context_feature), never the final layer."""
    from treadle.drafts.dspark.kind import DSPARK

    model = dspark()
    draft = model.draft_model
    weights = {k: v.detach() for k, v in draft.state_dict().items()}
    training = {"training": {"draft": {"anchors": None}, "data": {"seq_len": 32}}}
    tensors, config = DSPARK.export(draft, weights, model.target.config, torch.float32, "fp32", training)
    assert config["num_anchors"] == 32 // 5  # the run's default: data.seq_len // block_size
    save_dir = tmp_path / "exported"
    save_dir.mkdir()
    save_file(tensors, str(save_dir / "model.safetensors"))
    cls = _deepspec_model_class()
    (save_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_anchors"}))
    with pytest.raises(AssertionError, match="config.num_anchors must be provided"):
        cls.from_pretrained(save_dir)
    (save_dir / "config.json").write_text(json.dumps(config))
    loaded, info = cls.from_pretrained(save_dir, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["embed_tokens.weight", "lm_head.weight"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in tensors.items())
    assert loaded.block_size == 5 and loaded.num_anchors == 6 and loaded.config.mask_token_id == 511
    ids = list(loaded.target_layer_ids)
    assert [i + 1 for i in ids] == list(draft.feature_layers) and model.target.config.num_hidden_layers - 1 not in ids
    _, anchors = DSPARK.export(draft, weights, model.target.config, torch.float32, "fp32",
                               {"training": {"draft": {"anchors": 3}, "data": {"seq_len": 32}}})
    assert anchors["num_anchors"] == 3 and DSPARK.export(draft, weights, model.target.config, torch.float32, "fp32",
                                                         {})[1]["num_anchors"] > 0


def test_draft_init_imports_deepspec_and_speculators_drafts_and_refuses_the_others(tmp_path):
    """A DeepSpec checkpoint (top-level target_layer_ids, shipped copies of the target's embedding and head, no
    dflash_config) and a speculators-format one (fields nested in transformer_layer_config, layers named
    aux_hidden_state_layer_ids, sglang PR #40630) import as the same draft; the bonus-anchor slot convention, a reduced
    vocabulary's d2t, a padded vocabulary and a gated Markov head are refused in one line each."""
    from treadle.drafts.dspark.kind import DSPARK

    model = dspark()
    draft = model.draft_model
    weights = {k: v.detach() for k, v in draft.state_dict().items()}
    tensors, config = DSPARK.export(draft, weights, model.target.config, torch.float32, "fp32", {})
    deepspec = {k: v for k, v in config.items() if k not in ("dflash_config", "treadle_draft_kind")}
    deepspec["architectures"] = ["Qwen3DSparkModel"]
    shipped = tensors | {"embed_tokens.weight": torch.zeros(512, 32), "lm_head.weight": torch.zeros(512, 32),
                         "d2t": torch.zeros(512, dtype=torch.long), "t2d": torch.ones(512, dtype=torch.bool)}
    nested = {k: v for k, v in deepspec.items() if k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim", "intermediate_size",
                                                            "rms_norm_eps", "vocab_size", "rope_theta")}
    speculators = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
                   "transformer_layer_config": nested, "aux_hidden_state_layer_ids": [1, 3], "block_size": 5,
                   "mask_token_id": 511, "markov_rank": 8, "sample_from_anchor": True,
                   "enable_confidence_head": True, "confidence_head_with_markov": True}
    for i, cfg in enumerate((deepspec, speculators)):
        d = tmp_path / f"ok{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        save_file({("model." + k if i else k): v for k, v in shipped.items()}, str(d / "model.safetensors"))
        got = load_dspark(d, model.target).draft_model
        assert got.feature_layers == (1, 3) and got.block_size == 5 and got.mask_token_id == 511
        assert all(torch.equal(got.state_dict()[k], v) for k, v in weights.items())
    bad = [({**deepspec, "dspark_bonus_anchor": True}, tensors, "dspark_bonus_anchor"),
           ({**speculators, "sample_from_anchor": False}, tensors, "sample_from_anchor"),
           (deepspec, tensors | {"d2t": torch.arange(512)}, "reduced draft vocabulary"),
           ({**deepspec, "vocab_size": 520}, tensors, "vocab_size = 520"),
           ({**deepspec, "markov_head_type": "gated"}, tensors, "markov_head_type"),
           ({**deepspec, "confidence_head_with_markov": False}, tensors, "confidence head")]
    for i, (cfg, t, match) in enumerate(bad):
        d = tmp_path / f"bad{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(t, str(d / "model.safetensors"))
        with pytest.raises(UserError, match=match):
            load_dspark(d, model.target)


def test_dspark_run_trains_resumes_exports_imports_and_decodes(shards, eagle3_target_dir, tmp_path, capsys):
    target_dir = eagle3_target_dir
    a, b = tmp_path / "a", tmp_path / "b"
    common = (*BLOCK, "--draft.loss=mix", "--optim.lr=1e-2", "--draft.anchors=4")
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=6", "--checkpoint.every=3", *common)) == 0
    loss = records(a)
    assert loss[6] < loss[1]
    for key in ("acc_1", "acc_5", "eal", "draft_kl", "confidence_bce", "target_loss", "eval_loss", "tau_sim",
                "eval_acc_1", "eval_acc_5", "eval_eal", "acceptance_rounds"):
        assert records(a, key), key
    assert not records(a, "acc_6") and 0.0 <= records(a, "eal")[6] <= 5.0
    # Issue 48: every slot's top-1 agreement in the evals, and no perplexity of a loss that is no model's CE.
    assert not records(a, "eval_acc_6") and not records(a, "eval_ppl") and not records(a, "eval_ttt_rows_1")
    assert 0.0 <= records(a, "eval_eal")[6] <= 5.0 and all(0.0 <= records(a, "eval_acc_5")[s] <= 1.0 for s in (0, 6))
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=6", *common,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_3'}")) == 0
    lb = records(b)
    assert [loss[s] for s in (4, 5, 6)] == [lb[s] for s in (4, 5, 6)]
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    config = json.loads((a / "draft" / "config.json").read_text())
    assert config["treadle_draft_kind"] == "dspark" and config["architectures"] == ["Qwen3DSparkModel"]
    assert "markov_head.markov_w1.weight" in wa and not [k for k in wa if "embed" in k or "lm_head" in k]
    assert main(["export", str(a), str(tmp_path / "again")]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == wa.keys() and all(torch.equal(again[k], wa[k]) for k in wa)
    spec = tmp_path / "speculators"  # the speculators format (tests/test_speculators_block_kinds.py), same tensors
    assert main(["export", str(a), "--to", "speculators", str(spec)]) == 0
    assert json.loads((spec / "config.json").read_text())["speculators_model_type"] == "dspark"
    assert all(torch.equal(t, wa[k]) for k, t in load_file(spec / "model.safetensors").items())
    c = tmp_path / "c"
    assert main(draft_args(shards, target_dir, c, "--train.max_steps=2", *common, f"--draft.init={a}")) == 0
    assert records(c, "eval_loss")[0] == pytest.approx(records(a, "eval_loss")[6], rel=1e-5)
    assert main(draft_args(shards, target_dir, tmp_path / "d", "--train.max_steps=2", *common, f"--draft.init={a}",
                           "--draft.markov_rank=4")) == 2
    out = tmp_path / "spec.json"
    capsys.readouterr()
    base = [*SPEC_EVAL, "--target", str(target_dir), "--draft", str(a), "--num-prompts", "2", "--gamma", "5",
            "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]
    assert main(base) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "dspark" and 1.0 <= got["tau"] <= 6.0
    assert got["draft_forwards_per_round"] == 1.0
    assert main([*base, "--confidence-threshold", "0.5", "--confidence-rule", "vllm"]) == 0
    assert json.loads(out.read_text())["lossless"] is True
    assert main([*base, "--temperature", "1"]) == 0
    assert json.loads(out.read_text())["lossless"] is None
    at = base.index("--draft") + 1  # spec-eval reads the speculators export as the same draft
    assert main([*base[:at], str(spec), *base[at + 1:]]) == 0
    assert json.loads(out.read_text())["lossless"] is True and json.loads(out.read_text())["tau"] == got["tau"]
    assert main(["spec-eval", "--target", str(target_dir), "--draft", "prompt-lookup", "--num-prompts", "1",
                 "--confidence-threshold", "0.5"]) == 2
