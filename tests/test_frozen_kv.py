"""Frozen-KV drafts (draft.kind = "frozen_kv"): Gemma 4's assistant trained against its frozen Gemma 4 target.

The training unroll against the decode-time drafter (which runs the assistant's own forward and masks), causality
across rows and documents, a treadle run end to end (train, resume, export, draft.init from the export), and the
export run by transformers' own ``generate(..., assistant_model=...)``, its acceptance compared with treadle's
spec-eval loop on the same prompts."""

import json

import pytest
import torch

from tests.helpers import (SPEC_EVAL, assert_chunked_unroll_equals_whole, draft_args, record_accepted_rounds,
                           records, save_target)
from treadle.cli import main
from treadle.drafts.frozen_kv.model import FrozenKvDraft, FrozenKvModel, new_assistant, store_layers
from treadle.errors import UserError

from treadle import compat

# Gemma 4's K/V-sharing config (transformers 5.23): on an older release the kind is refused, which
# tests/test_versions.py asserts on the oldest end.
pytestmark = pytest.mark.skipif(not compat.gemma4_kv_sharing(), reason="frozen_kv needs transformers >= 5.23")

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# 4 layers, both attention types, the last layer kv-shared (the store layers are 1 and 2, not the last ones) and
# per-layer embeddings, as Gemma 4 E2B/E4B (transformers 5.24 needs the latter with the former: its kv-shared slicing
# indexes them)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=512, layer_types=TYPES, num_kv_shared_layers=1, max_position_embeddings=256,
            use_cache=False)
RUN = ("--draft.kind=frozen_kv", "--draft.ttt_steps=2", "--draft.gamma=2", "--draft.loss=mix", "--optim.lr=1e-2",
       "--train.micro_batch_size=2", "--train.eval_at_start=false", "--train.eval_batches=1")


def tiny_target(seed=0, sliding_window=64):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    return Gemma4ForCausalLM(Gemma4TextConfig(**TINY, sliding_window=sliding_window)).eval()


@pytest.fixture(scope="module")
def gemma_target(shards, tmp_path_factory):
    """The tiny Gemma 4 target with the shards' tokenizer."""
    return save_target(tiny_target(), shards, tmp_path_factory.mktemp("gemma4-target"))


def sharp_model(target, dtype=torch.float64):
    model = FrozenKvModel(target, FrozenKvDraft(new_assistant(target, 2))).to(dtype).eval()
    torch.manual_seed(3)
    for p in model.draft_model.parameters():  # sharp logits: a wrong position or mask changes argmaxes
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.3)
    return model


def test_the_unroll_is_what_the_drafter_proposes():
    """Step k of the training unroll (explicit masks, all rows at once) gives, at every start, the token the drafter
    (the assistant's own forward and mask builders, one row) proposes at link k; a sliding window of 4 makes both
    windows count. float64."""
    from treadle.drafts.frozen_kv.drafter import FrozenKvDrafter
    from treadle.speculative.decode import TargetState
    from treadle.speculative.sampling import Sampler

    target = tiny_target(1, sliding_window=4).double()
    model = sharp_model(target)
    text = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = target(text, output_hidden_states=True, return_shared_kv_states=True)
    hidden, stored = out.hidden_states[-1], out.shared_kv_states
    by_index = {i: stored[t] for t, i in store_layers(target.config).items()}
    drafter = FrozenKvDrafter(model)
    drafter.reset(text[:, :3])
    for start in (3, 9, 15):  # the bonus token is text[start]; the target has processed tokens < start
        kv = {i: (k[:, :, :start], v[:, :, :start]) for i, (k, v) in by_index.items()}
        got = drafter.propose(text[:, : start + 1], TargetState(None, hidden[:, :start], kv), 3, Sampler()).tokens
        # teacher forcing on a text that continues with the drafter's own guesses: step k from ``start`` is its k-th
        chained = torch.cat((text[:, : start + 1], torch.tensor([got]), text[:, start + 4:]), dim=1)
        guesses = model.chain_guesses(chained, 3)
        assert [int(guesses[k][0, start + k]) for k in range(3)] == got, start


def test_a_row_reads_nothing_after_it_nor_another_document():
    """Row t of step k reads tokens <= t + k of its own document only: changing later tokens, or packing another
    document before it, leaves its logits as they were (float64, to 1e-10)."""
    target = tiny_target(2, sliding_window=4).double()
    model = sharp_model(target)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 512, (1, 12), generator=gen), torch.randint(0, 512, (1, 10), generator=gen)
    pos = lambda n: torch.arange(n)[None]  # noqa: E731
    with torch.no_grad():
        alone = model(b, pos(10), steps=3).logits
        later = b.clone()
        later[:, 6:] = (later[:, 6:] + 7) % 512
        changed = model(later, pos(10), steps=3).logits
        packed = model(torch.cat((a, b), 1), torch.cat((pos(12), pos(10)), 1), steps=3).logits
    for k in range(3):  # step k + 1's row t reads tokens <= t + k + 1
        assert torch.allclose(changed[k][:, : 6 - k - 1], alone[k][:, : 6 - k - 1], atol=1e-10, rtol=0), k
        assert not torch.allclose(changed[k][:, 6 - k - 1], alone[k][:, 6 - k - 1])
        # the packed row's second document (its last k + 1 rows read past the end: filler, never scored)
        n = 10 - k - 1
        assert torch.allclose(packed[k][:, 12: 12 + n], alone[k][:, :n], atol=1e-10, rtol=0), k


def test_a_renamed_weight_is_refused_at_export_and_nothing_is_written(gemma_target, tmp_path):
    from treadle.checkpoint.export import export_draft

    target = tiny_target()
    model = FrozenKvModel(target, FrozenKvDraft(new_assistant(target, 2)))
    state = {"draft_model." + k: v for k, v in model.draft_model.state_dict().items()}
    state["draft_model.assistant.model.layers.1.self_attn.q_norm.weigth"] = state.pop(
        "draft_model.assistant.model.layers.1.self_attn.q_norm.weight")
    ident = {"config_fingerprint": "x", "tokenizer_fingerprint": None}
    out = tmp_path / "export"
    with pytest.raises(UserError, match="q_norm.weigth"):
        export_draft(model, state, out, gemma_target, ident, _Cfg())
    assert not out.exists()


def test_an_assistant_with_nan_weights_is_refused_naming_file_and_tensor(tmp_path):
    """Issue 39: a shipped assistant (or draft.init) loaded through from_pretrained is checked finite after the load."""
    from safetensors.torch import load_file, save_file

    from treadle.drafts.frozen_kv.model import load_frozen_kv

    target = tiny_target()
    new_assistant(target, 2).save_pretrained(tmp_path / "shipped")
    file = tmp_path / "shipped" / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("inf")
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"^draft {file}: tensor {name} holds 1 inf of"):
        load_frozen_kv(tmp_path / "shipped", target)


def test_the_centroid_head_is_trained_and_exported_with_its_ordering(gemma_target, tmp_path):
    """A shipped-style assistant with the centroid-masked head, loaded strictly: the unroll's auxiliary loss (each
    step's centroid logits against the guessed token's centroid, from token_ordering) reaches the centroids, and the
    export writes them and token_ordering exactly as the model holds them."""
    from transformers import Gemma4AssistantForCausalLM

    from treadle.checkpoint.export import export_draft
    from treadle.drafts.frozen_kv.model import centroid_of, load_frozen_kv, new_config
    from treadle.drafts.recurrent import aux_loss

    target = tiny_target()
    config = new_config(target.config, 2)
    config.use_ordered_embeddings, config.num_centroids, config.centroid_intermediate_top_k = True, 16, 4
    torch.manual_seed(1)
    shipped = Gemma4AssistantForCausalLM(config)
    with torch.no_grad():
        shipped.masked_embedding.token_ordering.copy_(torch.randperm(512))
    shipped.save_pretrained(tmp_path / "shipped")
    model = load_frozen_kv(tmp_path / "shipped", target).train()
    masked = model.draft_model.assistant.masked_embedding
    ordering = masked.token_ordering
    # centroid 3's tokens: token_ordering's fourth block of V / C = 32 (what the masked head gathers for it)
    assert torch.equal((centroid_of(masked) == 3).nonzero().flatten(), ordering[3 * 32: 4 * 32].sort().values)
    ids = torch.randint(0, 512, (1, 12))
    pos = torch.cat((torch.arange(5), torch.arange(7)))[None]  # two documents
    out = model(ids, pos, steps=2)
    labels = torch.cat((ids[:, 1:], ids.new_full((1, 1), -100)), 1)
    from treadle.config import DraftConfig

    loss = aux_loss(DraftConfig(kind="frozen_kv", target="t"), out, pos, labels).sum()
    loss.backward()
    assert loss > 0 and masked.centroids.weight.grad.abs().sum() > 0
    state = {"draft_model." + k: v for k, v in model.draft_model.state_dict().items()}
    ident = {"config_fingerprint": "x", "tokenizer_fingerprint": None}
    export_draft(model, state, tmp_path / "export", gemma_target, ident, _Cfg())
    back = Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "export")
    assert back.config.use_ordered_embeddings and back.config.num_centroids == 16
    assert torch.equal(back.masked_embedding.centroids.weight, masked.centroids.weight)
    assert torch.equal(back.masked_embedding.token_ordering, shipped.masked_embedding.token_ordering)


class _Cfg:
    def model_dump(self, mode="json"):
        return {}


def _both_loops(target, assistant, model, monkeypatch, gamma, n_prompts=3, new=24):
    """Per prompt, (accepted drafts per round in transformers' assisted generate, in treadle's spec-eval loop), both
    lossless. The rounds are the same until one follows a rejection, or the last: after a rejection transformers'
    assistant also reads the target's K/V row of the rejected candidate at the bonus position (its shared_kv_states
    are cut to the sequence's length, not the accepted tokens'; treadle's, as training, read tokens <= t only), and
    its last round counts drafts past max_new_tokens as not accepted."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator as Generator

    from treadle.drafts.frozen_kv.drafter import FrozenKvDrafter
    from treadle.speculative.decode import speculative_generate

    rounds = record_accepted_rounds(monkeypatch, Generator)
    assistant.generation_config.num_assistant_tokens = gamma  # generate's K (an export's generation_config.json)
    prompts = torch.randint(3, 512, (n_prompts, 8), generator=torch.Generator().manual_seed(5))
    out = []
    for i, prompt in enumerate(prompts):
        rounds.clear()
        kw = dict(max_new_tokens=new, do_sample=False, use_cache=True, attention_mask=torch.ones(1, 8, dtype=torch.long))
        plain = target.generate(prompt[None], **kw)
        assert torch.equal(target.generate(prompt[None], assistant_model=assistant, **kw), plain), i
        ours = speculative_generate(target, FrozenKvDrafter(model), prompt[None], gamma, plain.shape[1] - 8)
        assert ours.tokens == plain[0, 8:].tolist(), i
        hf, mine = rounds[1:], ours.accepted_per_call  # transformers' first round is the prefill: nothing drafted
        differ = [r for r in range(min(len(hf), len(mine))) if hf[r] != mine[r]]
        if differ:
            r = differ[0]
            assert r == min(len(hf), len(mine)) - 1 or hf[r - 1] < gamma, (i, hf, mine)
        out.append((hf, mine))
    return out


def test_acceptance_in_transformers_generate_is_treadles_until_a_rejection(monkeypatch):
    """A pair with real acceptance: a target whose sublayers barely touch the residual stream (post-norm scales
    0.02: its next token is mostly a function of the current one, context a little) and an assistant that is that
    function (its layers copied, pre_projection reading the embedding). Both loops accept the same per round until
    a round follows a rejection (``_both_loops``)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    target = Gemma4ForCausalLM(Gemma4TextConfig(**TINY, tie_word_embeddings=False, sliding_window=64)).eval()
    quiet = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight", "post_per_layer_input_norm.weight")
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith(quiet):
                p.mul_(0.02)
        assistant = new_assistant(target, 2)
        d = target.config.hidden_size
        assistant.pre_projection.weight.zero_()
        assistant.pre_projection.weight[:, :d] = torch.eye(d)
        assistant.model.norm.weight.copy_(target.model.norm.weight)
    model = FrozenKvModel(target, FrozenKvDraft(assistant)).eval()
    both = _both_loops(target, assistant, model, monkeypatch, 3, n_prompts=2)
    hf, mine = sum(sum(h) for h, _ in both), sum(sum(m) for _, m in both)
    rounds = sum(len(m) for _, m in both)
    print(f"accepted drafts: transformers {hf}, treadle {mine} over {rounds} rounds of 3")
    assert mine >= rounds // 2  # not a trivial comparison: about one draft in three or more accepted


def test_frozen_kv_run_trains_resumes_exports_and_runs_in_transformers_generate(shards, gemma_target, tmp_path,
                                                                                monkeypatch, capsys):
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from treadle.drafts.frozen_kv.model import build_frozen_kv, load_frozen_kv

    a, b = tmp_path / "a", tmp_path / "b"
    assert main(draft_args(shards, gemma_target, a, "--train.max_steps=4", "--checkpoint.every=2", *RUN)) == 0
    loss = records(a)
    assert "assistant: new, 2 layers" in capsys.readouterr().out  # the start line says where the draft started
    for key in ("acc_1", "acc_2", "eal", "draft_kl", "draft_ce", "target_loss", "eval_loss", "tau_sim"):
        assert records(a, key), key
    assert 0.0 <= records(a, "eal")[4] <= 2.0 and not records(a, "acc_3")
    # Checkpoints hold the draft and its optimizer state, never a target tensor: not the head Gemma ties to its
    # embedding (torch's ignore_frozen_params keeps that alias), nor the target's buffers.
    from treadle.checkpoint.safety import read_metadata

    keys = list(read_metadata(a / "checkpoints" / "step_2" / "state").state_dict_metadata)
    assert any("draft_model." in k for k in keys) and not [k for k in keys if "target" in k]
    # Exact resume from step 2.
    assert main(draft_args(shards, gemma_target, b, "--train.max_steps=4", *RUN,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    assert [loss[s] for s in (3, 4)] == [records(b)[s] for s in (3, 4)]

    # The export is the assistant's own checkpoint; transformers loads it strictly and generate drives it.
    export = a / "draft"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "gemma4_assistant" and config["architectures"] == ["Gemma4AssistantForCausalLM"]
    assert config["treadle_draft_kind"] == "frozen_kv" and config["target"]["model_type"] == "gemma4_text"
    assert "path" not in config["target"]
    assert json.loads((export / "generation_config.json").read_text())["num_assistant_tokens"] == 2
    assistant, info = Gemma4AssistantForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info
    main_model = Gemma4ForCausalLM.from_pretrained(gemma_target).eval()
    treadle_model = load_frozen_kv(export, main_model)
    mine = treadle_model.draft_model.assistant.state_dict()
    assert all(torch.equal(assistant.state_dict()[k], mine[k]) for k in mine)

    for i, (hf, ours) in enumerate(_both_loops(main_model, assistant, treadle_model, monkeypatch,
                                                   assistant.generation_config.num_assistant_tokens, n_prompts=1)):
        print(f"trained export, prompt {i}: transformers accepted {hf}, treadle {ours}")

    # treadle export rebuilds the same export from the last checkpoint (the draft's tensors only).
    assert main(["export", str(a), str(tmp_path / "again")]) == 0
    from safetensors.torch import load_file

    again, first = load_file(tmp_path / "again" / "model.safetensors"), load_file(export / "model.safetensors")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert (tmp_path / "again" / "generation_config.json").is_file()

    # draft.init from the export: the run starts from its weights.
    class Cfg:
        target, init, num_layers = str(gemma_target), str(export), None

    started, _, _ = build_frozen_kv(Cfg, 512, None)
    got = started.draft_model.assistant.state_dict()
    assert all(torch.equal(got[k], mine[k]) for k in mine)
    # An assistant for another target is refused in one line.
    other = tmp_path / "other"
    from transformers import Gemma4TextConfig

    from treadle.drafts.frozen_kv.model import new_config

    torch.manual_seed(0)
    Gemma4AssistantForCausalLM(new_config(Gemma4TextConfig(**{**TINY, "hidden_size": 32}), 2)).save_pretrained(other)
    Cfg.init = str(other)
    with pytest.raises(UserError, match="hidden size 32"):
        build_frozen_kv(Cfg, 512, None)
    # spec-eval decodes losslessly with the export.
    out = tmp_path / "spec.json"
    assert main([*SPEC_EVAL, "--target", str(gemma_target), "--draft", str(export), "--num-prompts", "1",
                 "--gamma", "2", "--prompt-len", "8", "--max-new-tokens", "8", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "frozen_kv" and 1.0 <= got["tau"] <= 3.0


def test_a_new_assistant_copies_the_same_tensors_from_a_target_built_empty(gemma_target):
    """Under FSDP2 / ZeRO-3 the target is built on the meta device and filled after the draft exists: a new assistant
    then reads the target's head and storing layers from its files, and starts where it would from a live target."""
    from treadle.drafts.frozen_kv.model import build_frozen_kv

    class Cfg:
        target, init, num_layers = str(gemma_target), None, None

    live, _, _ = build_frozen_kv(Cfg, 512, None)
    empty, _, _ = build_frozen_kv(Cfg, 512, None, empty=True)
    assert empty.target.get_output_embeddings().weight.is_meta
    a, b = live.draft_model.assistant, empty.draft_model.assistant
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    for mine, theirs in zip(a.model.layers, b.model.layers):
        assert torch.equal(mine.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight)
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)



@pytest.mark.parametrize("loss", ["ce", "kl", "mix"])
def test_the_chunked_unroll_loss_equals_the_whole_logits_one(loss):
    """model.loss_chunk_tokens for frozen_kv (Gemma 4's 262k vocabulary): the assistant's head and the target's
    (soft-capped) a few rows at a time give the whole-logits loss, side sums and the assistant's gradients, float64."""
    assert_chunked_unroll_equals_whole(sharp_model(tiny_target(1, sliding_window=4).double()).train(), "frozen_kv",
                                       loss)
