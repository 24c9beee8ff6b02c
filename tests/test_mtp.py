"""MTP heads (draft.kind = "mtp"): the unroll against the decode-time drafter, a treadle run end to end (train, resume,
both exports, import), and the stitched export run by transformers' own ``generate(..., use_mtp=True)``.

The target is a random DeepSeek-V3 64 wide but with the released model's 61 layers: transformers finds a family's MTP
weights only at the released layer index (``DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected`` =
``model\\.layers\\.61.*``, which ``MtpModel.get_mtp_weights_regex`` reads), so a shallower test target would have its
MTP layer silently not found. The Qwen3-Next (``mtp.*``) layout's own tests are in tests/test_mtp_qwen3_next.py;
the unroll test below runs on it too (a hybrid target, the normed output carried between steps)."""

import json

import pytest
import torch
from safetensors import safe_open

from tests.helpers import (SPEC_EVAL, assert_chunked_unroll_equals_whole, draft_args, record_accepted_rounds,
                           records, save_target)
from treadle.cli import main
from treadle.drafts.mtp import layout
from treadle.drafts.mtp.model import MtpDraft, MtpModel, draft_from_dir, load_mtp
from treadle.errors import UserError
from treadle.models.checkpoint_files import safetensors_files

N_LAYERS = 61  # DeepSeek-V3's: the index transformers looks for MTP weights at
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=N_LAYERS,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=N_LAYERS, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=512,
            num_nextn_predict_layers=1, use_cache=False)
RUN = ("--draft.kind=mtp", "--draft.ttt_steps=2", "--draft.gamma=2", "--draft.loss=mix", "--optim.lr=1e-2",
       "--train.micro_batch_size=2", "--train.eval_at_start=false", "--train.eval_batches=1",
       "--model.loss_chunk_tokens=48")  # the chunked unroll end to end (equal to whole logits: the float64 test)


# GLM-4-MoE (GQA, partial rotary, its own MoE): the same module code, 2 layers (no transformers contract run here).
GLM = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
           n_group=1, topk_group=1, first_k_dense_replace=2, max_position_embeddings=512, use_cache=False)


def tiny_target(seed=0, family="deepseek_v3"):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

    if family == "qwen3_next":  # mtp.* layout, a Gated-DeltaNet layer beside the full-attention one
        from tests.test_mtp_qwen3_next import HYBRID, qwen3_next

        return qwen3_next(HYBRID, seed)
    torch.manual_seed(seed)
    config = DeepseekV3Config(**TINY) if family == "deepseek_v3" else Glm4MoeConfig(**GLM)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def ds_target(shards, tmp_path_factory):
    """The tiny DeepSeek-V3 target with the shards' tokenizer, no MTP layer in its checkpoint."""
    return save_target(tiny_target(), shards, tmp_path_factory.mktemp("ds-target"))


def tensors_of(model_dir):
    out = {}
    for f, names in safetensors_files(model_dir).items():
        with safe_open(str(model_dir / f), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in names})
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_names_round_trip_and_refuse_a_renamed_weight(family):
    target = tiny_target(family=family)
    draft = MtpDraft(target)
    weights = draft.state_dict()
    ckpt = layout.to_checkpoint(weights)
    # The checkpoint's names: per-expert MLPs, shared_head.norm, the block flat under the layer (vLLM adds mtp_block.)
    attention = "self_attn.kv_b_proj.weight" if family == "deepseek_v3" else "self_attn.k_proj.weight"
    assert "mlp.experts.3.up_proj.weight" in ckpt and "shared_head.norm.weight" in ckpt and attention in ckpt
    assert not [k for k in ckpt if k.startswith("mtp_block.") or "gate_up_proj" in k]
    back = layout.from_checkpoint(ckpt)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    renamed = dict(weights)
    renamed["mtp_block.mlp.gate.weigth"] = renamed.pop("mtp_block.mlp.gate.weight")
    with pytest.raises(UserError, match="unknown"):
        layout.check_names(renamed, weights, "mtp export")


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_next"])
def test_the_unroll_is_what_the_drafter_proposes(family):
    """Step k of the training unroll (teacher-forced on a text) gives, at every start, the guess the decode-time
    drafter's chain makes from that start: the same module replayed, the same attention."""
    from treadle.drafts.mtp.drafter import MtpDrafter
    from treadle.speculative.decode import TargetState
    from treadle.speculative.sampling import Sampler

    target = tiny_target(1, family)
    model = MtpModel(target, MtpDraft(target)).eval()
    for p in model.draft_model.parameters():  # sharp logits: a wrong position or mask changes argmaxes
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.3)
    # fp32: the experts run through torch._grouped_mm, which has no float64 kernel; argmaxes of sharp logits only
    text = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = target(text, output_hidden_states=True).hidden_states[-1]
    drafter = MtpDrafter(model)
    drafter.reset(text[:, :3])
    done = 0
    for start in (3, 9):  # the bonus token is text[start]; the target has processed tokens < start
        # the first propose absorbs the prompt's rows, the second the rows verified since (after its chain is cut)
        got = drafter.propose(text[:, : start + 1], TargetState(None, hidden[:, done:start]), 3, Sampler()).tokens
        done = start
        # Teacher forcing feeds the text's tokens: on a text that continues with the drafter's own guesses, chain
        # step k from ``start`` (entry start + k - 1 of step k's guesses) is the drafter's k-th token.
        chained = torch.cat((text[:, : start + 1], torch.tensor([got]), text[:, start + 4:]), dim=1)
        guesses = model.chain_guesses(chained, 3)
        assert [int(guesses[k][0, start + k]) for k in range(3)] == got, start


def test_mtp_run_trains_resumes_exports_and_runs_in_transformers_generate(shards, ds_target, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    a, b = tmp_path / "a", tmp_path / "b"
    assert main(draft_args(shards, ds_target, a, "--train.max_steps=4", "--checkpoint.every=2", *RUN)) == 0
    loss = records(a)
    for key in ("acc_1", "acc_2", "eal", "draft_kl", "draft_ce", "target_loss", "eval_loss", "tau_sim",
                "eval_acc_1", "eval_acc_2", "eval_eal"):  # issue 48: the eval's agreement at every unroll step
        assert records(a, key), key
    assert 0.0 <= records(a, "eal")[4] <= 2.0 and not records(a, "acc_3") and not records(a, "eval_acc_3")
    # Exact resume from step 2.
    assert main(draft_args(shards, ds_target, b, "--train.max_steps=4", *RUN,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    assert [loss[s] for s in (3, 4)] == [records(b)[s] for s in (3, 4)]

    # The layer alone: SGLang's NextN layout, no embedding or head.
    alone = tensors_of(a / "draft")
    config = json.loads((a / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLMNextN"] and config["num_hidden_layers"] == 1
    assert all(k.startswith("model.layers.0.") for k in alone) and not [k for k in alone if "embed" in k or ".head." in k]
    # Stitched: the target's tensors byte-identical, the layer at model.layers.61 with the embedding and head copied.
    stitched = a / "draft" / "stitched"
    theirs, ours = tensors_of(ds_target), tensors_of(stitched)
    mtp = {k for k in ours if k.startswith(f"model.layers.{N_LAYERS}.")}
    assert ours.keys() - mtp == theirs.keys()
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and ours[k].shape == t.shape
        assert ours[k].contiguous().view(torch.uint8).equal(t.contiguous().view(torch.uint8)), k
    assert {f"model.layers.{N_LAYERS}." + k[len("model.layers.0."):] for k in alone} | {
        f"model.layers.{N_LAYERS}.{s}" for s in layout.shared_names(layout.DEEPSEEK)} == mtp
    assert torch.equal(ours[f"model.layers.{N_LAYERS}.shared_head.head.weight"], theirs["lm_head.weight"])
    assert json.loads((stitched / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # The layer's config states the ids of the tokenizer beside it (<|endoftext|> = 0), not the target config's
    # (DeepSeek-V3's defaults: eos 1); the stitched copy keeps the target's config, the identity its draft checks.
    c = json.loads((a / "draft" / "config.json").read_text())
    assert (c["bos_token_id"], c["eos_token_id"]) == (0, 0)
    assert json.loads((stitched / "config.json").read_text())["eos_token_id"] == 1

    # transformers' own classes: the stitched checkpoint's greedy generate with use_mtp equals plain greedy.
    main_model = AutoModelForCausalLM.from_pretrained(stitched).eval()
    rounds = record_accepted_rounds(monkeypatch, MTPCandidateGenerator)
    treadle_model = load_mtp(a / "draft", main_model)
    # transformers' MtpModel loaded the same weights treadle trained (its loader raises on a missing one)
    from transformers.modeling_layers import MtpModel as HFMtpModel

    hf = HFMtpModel.from_pretrained(main_model).layers[0].state_dict()
    mine = treadle_model.draft_model.state_dict()
    assert hf.keys() == mine.keys() and all(torch.equal(hf[k], mine[k]) for k in mine)

    prompts = torch.randint(0, 512, (3, 8), generator=torch.Generator().manual_seed(5))
    new = 24
    for i, prompt in enumerate(prompts):
        rounds.clear()
        kw = dict(max_new_tokens=new, do_sample=False, use_cache=True, attention_mask=torch.ones(1, 8, dtype=torch.long))
        plain = main_model.generate(prompt[None], **kw)
        spec = main_model.generate(prompt[None], use_mtp=True, **kw)
        assert torch.equal(spec, plain), i
        assert rounds[0] == 0 and len(rounds) > 1  # the first round is the prefill: nothing drafted
        # treadle's own measure on the same text: the module's guess at each start a gamma-1 decode visits. Its
        # first row pairs h_0 with token 1 at position 0, which vLLM zeroes and transformers does not: off here.
        treadle_model.draft_model.zero_first_embedding = False
        guess = treadle_model.chain_guesses(plain, 1)[0][0]
        walk, s = [], 8  # the bonus token of the next round is at index s; its draft guesses token s + 1
        while s + 1 < plain.shape[1]:
            hit = int(guess[s]) == int(plain[0, s + 1])
            walk.append(int(hit))
            s += 1 + hit
        # Every round but the last agrees exactly (the last is cut by max_new_tokens differently in the two loops:
        # transformers recounts an accepted draft whose bonus token falls past the end as 0).
        assert rounds[1:-1] == walk[: len(rounds) - 2], (i, rounds, walk)
        assert abs(sum(rounds[1:]) - sum(walk)) <= 1
        print(f"prompt {i}: transformers accepted {sum(rounds[1:])} of {len(rounds) - 1} drafts, treadle's walk "
              f"{sum(walk)} of {len(walk)}")
    treadle_model.draft_model.zero_first_embedding = True

    # treadle export rebuilds both exports from the last checkpoint.
    assert main(["export", str(a), str(tmp_path / "again")]) == 0
    again = tensors_of(tmp_path / "again")
    assert again.keys() == alone.keys() and all(torch.equal(again[k], alone[k]) for k in alone)
    assert tensors_of(tmp_path / "again" / "stitched").keys() == ours.keys()
    # draft.init takes either export: the run starts from the trained layer.
    for init in (a / "draft", stitched):
        got = draft_from_dir(init, main_model, "draft.init")
        assert all(torch.equal(got.state_dict()[k], mine[k]) for k in mine)
    # spec-eval decodes losslessly with the stand-alone export (the drafter replays the module along the chain).
    out = tmp_path / "spec.json"
    assert main([*SPEC_EVAL, "--target", str(ds_target), "--draft", str(a / "draft"), "--num-prompts", "2",
                 "--gamma", "2", "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "mtp" and 1.0 <= got["tau"] <= 3.0


def test_a_renamed_weight_is_refused_at_export_and_nothing_is_written(ds_target, tmp_path):
    from treadle.checkpoint.export import export_draft
    target = tiny_target()
    model = MtpModel(target, MtpDraft(target))
    state = {"draft_model." + k: v for k, v in model.draft_model.state_dict().items()}
    # a name inside the decoder block: the per-name conversion passes it through, the name check must catch it
    state["draft_model.mtp_block.mlp.gate.weigth"] = state.pop("draft_model.mtp_block.mlp.gate.weight")
    ident = {"config_fingerprint": "x", "tokenizer_fingerprint": None}
    out = tmp_path / "export"
    with pytest.raises(UserError, match="mlp.gate.weigth"):
        export_draft(model, state, out, ds_target, ident, _Cfg())
    assert not out.exists()


class _Cfg:
    def model_dump(self, mode="json"):
        return {}


def test_a_shipped_layer_is_where_the_run_starts(ds_target, tmp_path):
    """A target checkpoint that carries its MTP layer (model.layers.61.*, as DeepSeek-V3 ships it): the run's module
    is that layer, read from the safetensors (transformers drops it when it loads the target)."""
    from transformers import AutoModelForCausalLM

    from treadle.drafts.mtp.model import build_mtp

    target = tiny_target()
    shipped = MtpDraft(target)
    for p in shipped.parameters():
        torch.nn.init.normal_(p, std=0.05)
    layer = layout.to_checkpoint(shipped.state_dict())
    layer["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
    layer["shared_head.head.weight"] = target.lm_head.weight.detach()
    with_mtp = tmp_path / "with-mtp"
    layout.stitch(ds_target, with_mtp, layer, f"model.layers.{N_LAYERS}.")
    assert not [k for k in AutoModelForCausalLM.from_pretrained(with_mtp).state_dict() if f"layers.{N_LAYERS}." in k]

    class Cfg:
        target, init = str(with_mtp), None

    model, _, _ = build_mtp(Cfg, 512, None)
    got, want = model.draft_model.state_dict(), shipped.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.origin == "MTP module: the layer the target ships"  # what the run's start line says
    # Another family's module (GLM-4-MoE: GQA attention, no MLA) does not take this layer: refused, not half loaded.
    with pytest.raises(UserError, match="do not match the MTP layer"):
        draft_from_dir(with_mtp, tiny_target(family="glm4_moe"), "draft.init")
    # A target family without an MTP layout is refused in one line.
    from transformers import LlamaConfig

    from treadle.drafts.mtp.model import mtp_config

    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(UserError, match="without an MTP layout"):
        mtp_config(llama, "draft.target x")
    # Issue 39: a shipped layer written from an uninitialised module (NaN in an expert) was loaded without a word,
    # and the run's NaN guard later blamed the learning rate. Refused at load, naming the file and the tensor.
    from safetensors.torch import load_file, save_file

    shard = with_mtp / layout.MTP_SHARD
    tensors = load_file(str(shard))
    expert = next(k for k in sorted(tensors) if ".experts." in k and tensors[k].is_floating_point())
    tensors[expert] = tensors[expert].clone().fill_(1e15)
    tensors[expert].view(-1)[3] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"^draft.target {shard}: tensor {expert} holds 1 NaN of"):
        build_mtp(Cfg, 512, None)


def test_a_new_module_copies_the_same_tensors_from_a_target_built_empty(ds_target):
    """Under FSDP2 / ZeRO-3 the target is built on the meta device and filled after the draft exists: a new module
    then reads the target's last layer and final norm from its files, and starts where it would from a live target."""
    from transformers import AutoModelForCausalLM

    from treadle.drafts.mtp.model import build_mtp

    class Cfg:
        target, init = str(ds_target), None

    live, _, _ = build_mtp(Cfg, 512, None)
    empty, _, _ = build_mtp(Cfg, 512, None, empty=True)
    assert empty.target.model.norm.weight.is_meta and empty.origin == live.origin
    assert "block tensors from the target's last layer" in empty.origin
    last = AutoModelForCausalLM.from_pretrained(ds_target).model.layers[-1].state_dict()
    got = empty.draft_model.mtp_block.state_dict()
    copied = [k for k in last if k in got and got[k].shape == last[k].shape]
    assert copied and all(torch.equal(got[k], last[k]) for k in copied)
    assert torch.equal(empty.draft_model.post_norm.weight, live.draft_model.post_norm.weight)


@pytest.mark.parametrize("loss", ["ce", "kl", "mix"])
def test_the_chunked_unroll_loss_equals_the_whole_logits_one(loss):
    """model.loss_chunk_tokens for mtp: every step and the teacher through the target's head a few rows at a time,
    never a whole [tokens, vocab] logits tensor, gives the whole-logits loss, side sums (acc_k's and eal's counts)
    and draft gradients, in float64 (the experts run eagerly: torch._grouped_mm has no float64 kernel)."""
    target = tiny_target(1)
    target.config._experts_implementation = "eager"
    assert_chunked_unroll_equals_whole(MtpModel(target, MtpDraft(target)).double().train(), "mtp", loss)
