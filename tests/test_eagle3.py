"""EAGLE-3 draft: the training-time-test unroll, the decode-time drafter, the vocabulary map, and runs end to end."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import SPEC_EVAL, TARGET, draft_args, records
from treadle.cli import main
from treadle.drafts.eagle3.model import Eagle3Draft, Eagle3Model, default_feature_layers, frequent_tokens, load_eagle3
from treadle.drafts.glide.model import document_ids, ttt_mask
from treadle.drafts.targets import capture_features
from treadle.models.hf import greedy_continuations
from treadle.speculative.acceptance import chain_acceptance
from treadle.speculative.decode import TargetState
from treadle.speculative.sampling import Sampler
from treadle.drafts.eagle3.drafter import Eagle3Drafter
from treadle.drafts.ttt import scored_rows

EAGLE = ("--draft.kind=eagle3", "--draft.vocab_size=200", "--draft.ttt_steps=3")


def eagle3(seed=1, vocab=None):
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 3}))
    model = Eagle3Model(target, Eagle3Draft(target.config, default_feature_layers(3), vocab)).eval()
    for p in model.draft_model.parameters():  # sharp attention and logits: a wrong position or mask changes argmaxes
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    if vocab:
        model.draft_model.set_vocabulary(torch.randperm(512)[:vocab])
    return model


def test_default_feature_layers_are_eagle3s_and_fit_shallow_targets():
    assert default_feature_layers(32) == (2, 16, 29)  # EAGLE-3's picks for Llama-3-8B
    assert default_feature_layers(4) == (1, 2, 3)


def test_ttt_mask_and_scored_rows_match_a_naive_reference():
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])  # three documents
    labels = torch.arange(9)[None].clone()
    labels[0, 3] = labels[0, 6] = -100  # document ends
    doc = document_ids(pos)
    T = 9
    for step in range(3):
        got = ttt_mask(doc, step)[0, 0]
        rows = scored_rows(pos, labels, step)[0]
        for t in range(T):
            for j in range(step + 1):
                for s in range(T):
                    want = (s <= t and doc[0, s] == doc[0, t]) if j == 0 else s == t
                    assert bool(got[t, j * T + s]) == want, (step, t, j, s)
            if t < T - 1 - step:  # index t + 1 + step exists: scored iff same document and labelled
                ahead = t + 1 + step
                assert bool(rows[t]) == bool(doc[0, t] == doc[0, ahead] and labels[0, ahead] != -100), (step, t)


def test_captured_features_are_the_output_hidden_states_entries():
    model = eagle3()
    ids = torch.randint(0, 512, (1, 10))
    with torch.no_grad():
        hidden = model.target(input_ids=ids, output_hidden_states=True).hidden_states  # [embeddings, layer 1 out, ...]
        with capture_features(model.target, (2, 0, 1)) as tap:
            model.target(input_ids=ids)
            got = tap.take()
    assert torch.equal(got, torch.cat((hidden[2], hidden[0], hidden[1]), dim=-1))


@pytest.mark.parametrize("vocab", [None, 64])
def test_decode_drafter_reproduces_the_training_unroll(vocab):
    """Round after round (features handed over incrementally, the draft cache kept), every chain link the drafter
    proposes equals the training-time-test unroll's guess at that link, fed the same tokens."""
    model, gamma, prompt_len = eagle3(vocab=vocab), 4, 6
    torch.manual_seed(2)
    text = greedy_continuations(model.target, torch.randint(0, 512, (1, prompt_len)), 10)
    positions = torch.arange(text.shape[1])[None]
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=text, position_ids=positions)
        features = tap.take()
    drafter = Eagle3Drafter(model)
    drafter.reset(text[:, :prompt_len])
    given = 0
    for s in range(prompt_len, text.shape[1]):  # the bonus at s: the target has processed tokens < s
        state = TargetState(None, features[:, given:s])  # the rows the target added since the last round
        given = s
        proposals = drafter.propose(text[:, : s + 1], state, gamma, Sampler()).tokens
        if vocab:
            assert all(model.draft_model.t2d[p] for p in proposals)
        fed = torch.cat((text[:, : s + 1], torch.tensor([proposals])), dim=1)
        with torch.no_grad():
            guesses = model.chain_guesses(fed, gamma)
        assert proposals == [int(guesses[k][0, s + k]) for k in range(gamma)], s
        drafter.accept(s + 2)  # one more token: the next round hands over one more feature row
    # Sampled: each q row is the draft head's softmax, over the target vocabulary (zero off the draft's tokens),
    # and the drawn token is one the row gives mass to.
    x = torch.randn(1, 1, model.target.config.hidden_size)
    with torch.no_grad():
        token, q = drafter._draw(x, Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0)))
        head = torch.softmax(model.draft_model.logits(x)[0, -1].float(), -1)
    ids = model.draft_model.to_target_ids(torch.arange(head.shape[0]))
    assert q.shape == (512,) and torch.allclose(q[ids], head) and math.isclose(float(q.sum()), 1.0, rel_tol=1e-5)
    off_draft = torch.ones_like(q, dtype=torch.bool)
    off_draft[ids] = False
    # Each token outside the draft vocabulary has exactly zero mass (a per-entry check: summing the rows in two
    # orders differs by an ulp on another CPU's kernels, so a difference of sums is never compared with 0).
    assert float(q[token]) > 0 and bool((q[off_draft] == 0).all())


def test_eagle3_speculative_decoding_is_lossless_and_chain_acceptance_is_consistent():
    from treadle.speculative.decode import speculative_generate, target_generate

    model = eagle3(vocab=100)
    prompt = torch.randint(0, 512, (1, 8))
    want, _ = target_generate(model.target, prompt, 24)
    got = speculative_generate(model.target, Eagle3Drafter(model), prompt, gamma=4, max_new_tokens=24)
    assert got.tokens == want and got.verify_calls >= 1
    texts = greedy_continuations(model.target, torch.randint(0, 512, (2, 6)), 12)
    acc = chain_acceptance(model, texts, 6, 3)
    assert acc["tau_sim"] == pytest.approx(1 + sum(acc["acceptance_unconditional"]))


class HalfRightGuesses:
    """A draft's ``chain_guesses`` that are the text's own tokens in its first half and wrong in its second."""

    def chain_guesses(self, texts, gamma):
        right = torch.cat((texts[:, 1:], texts[:, -1:]), dim=1)  # entry i guesses token i + 1
        half = texts.shape[1] // 2
        return [torch.cat((right[:, :half], -torch.ones_like(right[:, half:])), dim=1) for _ in range(gamma)]


def test_tau_sim_is_tokens_per_round_of_a_decode_not_a_mean_over_starts():
    """Issue 41: tau_sim read 3.80 on a GPU where spec-eval read 1.80. Averaged over every start, a text the draft
    gets whole chains of in one stretch and nothing of in another counts each easy start once, where a decode
    crosses the easy stretch gamma + 1 tokens a round: tokens per round is (E + H) / (E / 5 + H) at gamma 4."""
    texts = torch.arange(92)[None]  # no prompt: 88 starts, guesses right at indices 0..45, wrong from 46
    acc = chain_acceptance(HalfRightGuesses(), texts, 0, 4)
    # Starts 0..42 take all 4 drafts; 43..45 run into the wrong half (3, 2, 1); 46..87 take none.
    # The decode: rounds at 0, 5, ..., 40 (9 rounds of 5), 45 (1 draft: 2 tokens), then 47..87 one token a round.
    assert acc["tau_sim"] == pytest.approx((9 * 5 + 2 + 41) / 51)  # 1.73
    assert acc["rounds"] == 9 + 1 + 41
    assert acc["tau_every_start"] == pytest.approx((43 * 5 + 4 + 3 + 2 + 42) / 88)  # what tau_sim was: 3.02
    assert acc["tau_sim"] == pytest.approx(1 + sum(acc["acceptance_unconditional"]))


def test_tau_sim_and_spec_eval_agree_on_the_same_prompts_and_precision():
    """Issue 41: the training-time eval and spec-eval's decode loop measure one thing when given the same prompts at
    the same precision. In float64 (no argmax ties) tau_sim and its per-position rates are exactly what spec-eval's
    loop (evaluate_drafter) measures on those prompts (the rounds whose chains fit in the texts); the mean over every
    start is not. In bf16 weights on both sides (spec-eval --dtype bf16) they agree within bf16's noise."""
    from treadle.speculative.evaluate import evaluate_drafter

    model, gamma, new, P = eagle3(seed=0), 4, 24, 6
    torch.manual_seed(0)
    texts = greedy_continuations(model.target, torch.randint(0, 512, (4, P)), new)
    # A draft that accepts often but not always: a few steps of the training-time-test loss on these very texts.
    positions = torch.arange(texts.shape[1]).expand_as(texts)
    optimizer = torch.optim.Adam(model.draft_model.parameters(), lr=1e-2)
    model.train()
    for _ in range(20):
        loss = sum(torch.nn.functional.cross_entropy(logits[:, : new + P - k - 2].flatten(0, 1),
                                                     texts[:, k + 2:].flatten())
                   for k, logits in enumerate(model(texts, positions, steps=3).logits))  # step k: token t + k + 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    prompts = texts[:, :P]
    for dtype in ("float64", "bf16"):
        if dtype == "float64":
            model.double()
        else:  # what spec-eval --dtype bf16 does to the models it decodes with
            from treadle.speculative.evaluate import cast_weights

            model.float()
            cast_weights([model], "bf16")
            texts = greedy_continuations(model.target, prompts, new)  # the target's own greedy text in bf16
        acc = chain_acceptance(model, texts, P, gamma)
        spec = evaluate_drafter(model.target, Eagle3Drafter(model), prompts.tolist(), gamma, new - gamma + 1, None)
        assert spec["lossless"] and spec["generated_tokens"] == 4 * (new - gamma + 1)
        assert 1.5 < spec["tau"] < gamma + 1  # rounds that stop early and rounds that take every draft
        if dtype == "float64":
            assert acc["tau_sim"] == spec["tau"]
            assert acc["rounds"] == spec["verify_calls"]
            assert acc["acceptance_unconditional"] == spec["acceptance_unconditional"]
            assert acc["tau_every_start"] != pytest.approx(spec["tau"])
        else:  # one parallel forward against one token at a time: bf16 rounds them apart, near ties flip
            assert abs(acc["tau_sim"] - spec["tau"]) < 0.25


def test_eagle3_tree_nodes_are_the_top_k_of_their_chain_unrolls():
    """Each tree node is among the top-k of the chain unroll (``_step``, the code ``propose`` runs) fed its path:
    a node's feature (its parent's output), token, position and mask are the chain's along that path."""
    from treadle.speculative.tree import node_depths

    model, branching = eagle3(vocab=64), (3, 2, 2)
    context = torch.randint(0, 512, (1, 9))
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=context[:, :-1])
        features = tap.take()
    drafter = Eagle3Drafter(model)
    drafter.reset(context)
    tree = drafter.propose_tree(context, TargetState(None, features), branching, Sampler())
    assert len(tree.tokens) == 3 + 6 + 12 and drafter.rows == 8  # the tree's rows never join the step-0 rows
    draft, to_draft = model.draft_model, model.draft_model.target_to_draft()
    for node, depth in enumerate(node_depths(tree.parents)):
        path, p = [], tree.parents[node]
        while p >= 0:
            path, p = [tree.tokens[p], *path], tree.parents[p]
        chain = Eagle3Drafter(model)
        x, last = chain._absorb(context, TargetState(None, features))
        past = chain.kv
        for link, token in enumerate(path, start=1):
            x, (k, v) = chain._step(torch.tensor([[token]]), x, last + link, past)
            past = (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
        top = draft.logits(x)[0, -1].topk(branching[depth - 1]).indices.tolist()
        assert int(to_draft[tree.tokens[node]]) in top, node
    # Sampled: q rows over the target's vocabulary, each sibling's row without the tokens drawn before it.
    drafter.reset(context)
    tree = drafter.propose_tree(context, TargetState(None, features), branching,
                                Sampler(1.0, generator=torch.Generator().manual_seed(0)))
    assert tree.q.shape == (len(tree.tokens), 512) and torch.allclose(tree.q.sum(-1), torch.ones(len(tree.tokens)))
    for node, token in enumerate(tree.tokens):
        assert float(tree.q[node, token]) > 0
        earlier = [i for i in range(node) if tree.parents[i] == tree.parents[node]]
        assert all(float(tree.q[node, tree.tokens[i]]) == 0 for i in earlier)


def test_eagle3_tree_decoding_is_lossless_and_a_width_1_tree_is_the_chain():
    """Greedy tree decoding equals the target's greedy output, token for token, and a width-1 tree accepts exactly
    what the chain does, call for call. The draft vocabulary is the target's greedy output's tokens, so that even
    an untrained draft gets some drafts accepted (partial paths: the features handed back are the accepted ones)."""
    from treadle.speculative.decode import speculative_generate, target_generate

    torch.manual_seed(2)
    prompt = torch.randint(0, 512, (1, 8))
    want, _ = target_generate(eagle3().target, prompt, 24)
    ids = sorted(set(want))
    model = eagle3(vocab=len(ids))  # the same target (seeded), a draft that can only say those tokens
    model.draft_model.set_vocabulary(torch.tensor(ids))
    chain = speculative_generate(model.target, Eagle3Drafter(model), prompt, gamma=4, max_new_tokens=24)
    tree = speculative_generate(model.target, Eagle3Drafter(model), prompt, gamma=4, max_new_tokens=24,
                                tree=(3, 2, 1, 1))
    narrow = speculative_generate(model.target, Eagle3Drafter(model), prompt, gamma=4, max_new_tokens=24,
                                  tree=(1,) * 4)
    assert chain.tokens == want and tree.tokens == want and narrow.tokens == want
    assert narrow.accepted_per_call == chain.accepted_per_call and max(chain.accepted_per_call) > 0
    assert max(tree.accepted_per_call) > 0


def test_frequent_tokens_pick_the_most_counted_ids():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert frequent_tokens(counts, 3).tolist() == [2, 3, 5]
    draft = Eagle3Draft(LlamaConfig(**{**TARGET, "vocab_size": 6}), (0, 0, 1), vocab_size=3)
    draft.set_vocabulary(frequent_tokens(counts, 3))
    assert draft.draft_to_target().tolist() == [2, 3, 5]
    assert draft.t2d.tolist() == [False, False, True, True, False, True]
    assert draft.target_to_draft().tolist() == [-1, -1, 0, 1, -1, 2]
    assert draft.to_target_ids(torch.tensor([2, 0])).tolist() == [5, 2]


def test_eagle3_run_trains_exports_and_decodes(shards, eagle3_target_dir, tmp_path, capsys):
    from treadle.checkpoint.safety import read_metadata

    target_dir = eagle3_target_dir
    run = tmp_path / "run"
    assert main(draft_args(shards, target_dir, run, "--train.max_steps=3", *EAGLE)) == 0
    # Per-step accuracy of the unroll, the target's reference loss and tau_sim are logged.
    for key in ("acc_1", "acc_2", "acc_3", "draft_kl", "target_loss", "eval_loss", "eval_acc_1", "eval_acc_3"):
        assert records(run, key), key
    assert not records(run, "acc_4") and not records(run, "ttt_rows_1") and not records(run, "eval_acc_4")
    assert all(0.0 <= a <= 1.0 for a in records(run, "acc_1").values())
    assert set(records(run, "tau_sim")) == {0, 3}
    # Checkpoints hold the draft with its vocabulary map, never a target tensor.
    keys = list(read_metadata(run / "checkpoints" / "step_3" / "state").state_dict_metadata)
    assert "model.draft_model.d2t" in keys or any(k.endswith("draft_model.d2t") for k in keys), keys
    assert not [k for k in keys if "target" in k]

    export = run / "draft"
    st = load_file(export / "model.safetensors")
    config = json.loads((export / "config.json").read_text())
    assert config["treadle_draft_kind"] == "eagle3" and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["vocab_size"] == 512 and config["draft_vocab_size"] == 200 and config["dtype"] == "float32"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert not (export / "draft_model_weights.pth").exists()
    assert st["lm_head.weight"].shape == (200, TARGET["hidden_size"]) and st["t2d"].dtype == torch.bool
    # The map is the 200 most frequent training tokens.
    from treadle.data.packed import PackedDataset

    counts = torch.from_numpy(PackedDataset([shards / "train"], seq_len=32).token_counts(512))
    ids = st["d2t"] + torch.arange(200)
    assert torch.equal(ids, frequent_tokens(counts, 200)) and int(st["t2d"].sum()) == 200

    # treadle export rebuilds the same export from the checkpoint, map included (also in bf16: the map keeps its dtype).
    assert main(["export", str(run), str(tmp_path / "again")]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == st.keys() and all(torch.equal(again[k], st[k]) for k in st)
    assert main(["export", str(run), "--dtype", "bf16", str(tmp_path / "bf16")]) == 0
    half = load_file(tmp_path / "bf16" / "model.safetensors")
    assert half["d2t"].dtype == torch.long and half["fc.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"

    # Reloaded, the export gives the trained draft's unroll.
    reloaded = load_eagle3(export, AutoModelForCausalLM.from_pretrained(target_dir))
    texts = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        a = reloaded(texts, torch.arange(16)[None], steps=2).logits
    assert a[1].shape == (1, 16, 200)

    # spec-eval decodes losslessly with it.
    out = tmp_path / "spec.json"
    capsys.readouterr()
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(run), "--num-prompts", "2",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "eagle3" and 1.0 <= got["tau"] <= 5.0
    assert got["draft_forwards_per_round"] == 4.0  # one draft forward per token of the gamma-4 chain
    # Sampled verification: the reduced head's q rows live on the draft's tokens of the target vocabulary.
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(run), "--num-prompts", "2",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--temperature", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is None and 1.0 <= got["tau"] <= 5.0

    # A reduced draft whose export lost its map is refused in one line, not decoded with wrong ids.
    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    save_file({k: v for k, v in st.items() if k not in ("d2t", "t2d")}, str(broken / "model.safetensors"))
    capsys.readouterr()
    assert main(["spec-eval", "--target", str(target_dir), "--draft", str(broken), "--num-prompts", "1",
                 "--prompt-len", "8", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "d2t" in err


def test_eagle3_run_resumes_bit_for_bit(shards, eagle3_target_dir, tmp_path):
    target_dir = eagle3_target_dir
    a, b = tmp_path / "a", tmp_path / "b"
    chunked = "--model.loss_chunk_tokens=24"  # the run's wiring of the chunked scores (their math: test_eagle3_memory)
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=4", "--checkpoint.every=2", "--draft.loss=mix",
                           *EAGLE, chunked)) == 0
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=4", "--draft.loss=mix", *EAGLE, chunked,
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    la, lb = records(a), records(b)
    assert [la[s] for s in (3, 4)] == [lb[s] for s in (3, 4)]
    assert records(a, "acc_2")[4] == records(b, "acc_2")[4]
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # The draft's architecture keys are the checkpoint's: another vocabulary is refused in one line.
    assert main(draft_args(shards, target_dir, tmp_path / "c", "--train.max_steps=4", *EAGLE, "--draft.vocab_size=100",
                           f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 2


def test_an_eagle3_run_starts_from_a_draft_in_the_eagle_layout(shards, eagle3_target_dir, tmp_path, capsys):
    """draft.init: a treadle export or run, or a draft trained elsewhere (no treadle keys), starts a run; its weights,
    feature layers and vocabulary map are the run's first draft, not the data's counts."""
    from treadle.config import load_config
    from treadle.train.run import build_trainer

    target_dir, a = eagle3_target_dir, tmp_path / "a"
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=2", *EAGLE, "--draft.feature_layers=[1,2,3]")) == 0
    want = load_file(a / "draft" / "model.safetensors")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = json.loads((a / "draft" / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in (
        "treadle_draft_kind", "target", "target_config", "training")}))
    shutil.copy(a / "draft" / "model.safetensors", foreign / "model.safetensors")
    # The same draft in the speculators format (drafts/eagle3/speculators.py), as treadle export writes it.
    speculators = tmp_path / "speculators"
    assert main(["export", str(a), "--to", "speculators", str(speculators)]) == 0
    assert json.loads((speculators / "config.json").read_text())["speculators_model_type"] == "eagle3"
    for init in (a, foreign, speculators):
        trainer = build_trainer(load_config(None, draft_args(shards, target_dir, tmp_path / "b", "--train.max_steps=2",
                                                             "--draft.kind=eagle3", f"--draft.init={init}")[1:]))
        draft = trainer.engine.module.draft_model
        assert draft.vocab_size == 200 and draft.feature_layers == (1, 2, 3)
        got = {k: v for k, v in draft.state_dict().items()}
        names = {"final_norm.weight": "norm.weight", "fc.weight": "fc.weight", "d2t": "d2t", "t2d": "t2d",
                 "q_proj.weight": "midlayer.self_attn.q_proj.weight"}
        assert all(torch.equal(got[ours], want[theirs]) for ours, theirs in names.items())
        trainer.metrics.close()
    # It trains, and exports a draft of the same layout.
    assert main(draft_args(shards, target_dir, tmp_path / "c", "--train.max_steps=2", "--draft.kind=eagle3",
                           f"--draft.init={foreign}")) == 0
    assert load_file(tmp_path / "c" / "draft" / "model.safetensors")["d2t"].equal(want["d2t"])
    # spec-eval measures the draft trained elsewhere against its target, losslessly.
    out = tmp_path / "spec.json"
    for draft_dir in (foreign, speculators):
        assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(draft_dir), "--num-prompts", "1",
                     "--prompt-len", "8", "--max-new-tokens", "8", "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["drafter"] == "eagle3" and got["lossless"] is True
    # A draft.vocab_size other than the initial draft's, or a directory that is no EAGLE-3 draft, is one line.
    capsys.readouterr()
    for extra, word in (((f"--draft.init={foreign}", "--draft.vocab_size=100"), "draft.vocab_size"),
                        ((f"--draft.init={shards}",), "draft.init")):
        args = draft_args(shards, target_dir, tmp_path / "d", "--train.max_steps=2", "--draft.kind=eagle3", *extra)
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and word in err, err
        assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("bad, key", [
    (("--draft.kind=glide", "--draft.vocab_size=100"), "draft.vocab_size"),
    (("--draft.kind=glide", "--draft.init=somewhere"), "draft.init"),  # not a draft directory
    (("--draft.kind=glide", "--draft.ttt_steps=3", "--model.loss_chunk_tokens=16"), "model.loss_chunk_tokens"),
    (("--draft.kind=eagle3", "--draft.feature_layers=[0,2]"), "draft.feature_layers"),  # three, as engines serve
    (("--draft.kind=eagle3", "--draft.feature_layers=[1,2,2]"), "draft.feature_layers"),  # strictly increasing
    (("--draft.kind=eagle3", "--draft.feature_layers=[0,1,2]"), "draft.feature_layers"),  # 0: the embeddings
    (("--draft.kind=eagle3", "--draft.feature_layers=[1,2,3,4]"), "draft.feature_layers"),
    (("--draft.kind=eagle3", "--draft.feature_layers=[1,2,4]"), "draft.feature_layers"),  # the target has 4 layers
    (("--draft.kind=eagle3", "--draft.vocab_size=9999"), "draft.vocab_size"),
    (("--draft.kind=eagle3", "--draft.window=8"), "draft.window"),
    (("--draft.kind=eagle3", "--distributed.context_parallel=2", "--model.loss_chunk_tokens=0"),
     "distributed.context_parallel"),  # a slice is scored chunk by chunk only
])
def test_bad_eagle3_settings_are_one_line(shards, eagle3_target_dir, tmp_path, capsys, bad, key):
    assert main(draft_args(shards, eagle3_target_dir, tmp_path / "run", "--train.max_steps=2", *bad)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err
    assert not (tmp_path / "run").exists()


def test_an_eagle3_draft_of_a_target_too_shallow_to_serve_is_refused(shards, target_dir, tmp_path, capsys):
    """Two decoder layers have no three distinct features: what vLLM and SGLang could not serve is not trained."""
    assert main(draft_args(shards, target_dir, tmp_path / "run", "--train.max_steps=2", "--draft.kind=eagle3")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "draft.feature_layers" in err and "2 decoder layers" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_ttt_loss_equals_a_naive_sum_over_steps_and_rows(loss):
    """Step k's row t is scored against index t + 1 + k (label or target distribution, within the draft vocabulary),
    weighted decay**k, summed: the objective equals this written as plain loops."""
    from treadle.config import DraftConfig
    from treadle.drafts.eagle3.objective import Eagle3Objective

    model = eagle3(vocab=64)
    cfg = DraftConfig(kind="eagle3", target="x", loss=loss, ttt_steps=3, ttt_decay=0.5)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    ids = torch.randint(0, 512, (1, 12))
    ids[0, 1:4] = model.draft_model.draft_to_target()[:3]  # some labels inside the draft vocabulary
    labels = torch.cat((ids[:, 1:], torch.tensor([[7]])), 1)
    labels[0, 5] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    with torch.no_grad():
        got, side = Eagle3Objective(cfg, 512, 12)(model, batch)
        out = model(ids, pos, steps=3)
    doc = document_ids(pos)[0]
    to_draft = model.draft_model.target_to_draft()
    in_vocab = model.draft_model.t2d
    d2t = model.draft_model.draft_to_target()
    want = 0.0
    for k in range(3):
        for t in range(12):
            i = t + 1 + k
            if i >= 12 or doc[i] != doc[t] or labels[0, i] == -100:
                continue
            log_q = torch.log_softmax(out.logits[k][0, t], -1)
            teacher = out.target_logits[0, i]
            if loss == "ce" and to_draft[labels[0, i]] >= 0:
                want += 0.5 ** k * float(-log_q[to_draft[labels[0, i]]])
            if loss == "kl" and in_vocab[teacher.argmax()]:
                p = torch.softmax(teacher[d2t], -1)
                want += 0.5 ** k * float((p * (p.log() - log_q)).sum())
    assert float(got.sum()) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert float(side["ttt_rows_1"]) == 9 and float(side["ttt_rows_3"]) == 5
