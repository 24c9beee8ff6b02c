"""GLIDE draft: masks, positions, target K/V, the decode-time drafter, and draft runs end to end."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from tests.helpers import SPEC_EVAL, TARGET, draft_args, records
from treadle.cli import main
from treadle.drafts.glide.model import (
    GlideDraft, GlideModel, anchored_positions, attention_mask, capture_last_kv, document_ids,
)
from treadle.drafts.glide.layout import load_glide
from treadle.model_dirs import model_fingerprint
from treadle.models.hf import cache_kwargs, greedy_continuations
from treadle.speculative.acceptance import chain_acceptance
from treadle.speculative.decode import TargetState
from treadle.drafts.glide.drafter import GlideDrafter
from treadle.speculative.sampling import Sampler


def glide(seed=1, window=0):
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(LlamaConfig(**TARGET))
    return GlideModel(target, GlideDraft(target.config, window=window)).eval()


def test_masks_match_a_naive_reference():
    torch.manual_seed(0)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4, 5]])
    doc = document_ids(position_ids)
    idx = torch.arange(12).expand(2, 12)
    for lag, window in [(0, 0), (1, 0), (3, 0), (0, 3), (2, 4)]:
        got = attention_mask(idx, idx, min_gap=lag, window=window, q_doc=doc, k_doc=doc)
        want = torch.zeros(2, 1, 12, 12, dtype=torch.bool)
        for b in range(2):
            for i in range(12):
                for j in range(12):
                    same_doc = doc[b, i] == doc[b, j]
                    want[b, 0, i, j] = bool(same_doc and j <= i - lag and (window == 0 or i - j < window))
        assert torch.equal(got, want), (lag, window)


def test_anchor_offset_positions_follow_the_config():
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    assert anchored_positions(pos, anchor=3, offset=100).tolist() == [[0, 1, 2, 103, 104, 105, 0, 1, 2, 103]]
    assert torch.equal(anchored_positions(pos, anchor=3, offset=0), pos)


def test_captured_target_kv_equal_the_kv_cache():
    model = glide()
    ids = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        cache = DynamicCache()
        model.target(input_ids=ids, use_cache=True, **cache_kwargs(model.target, cache))
        with capture_last_kv(model.target) as kv:
            model.target(input_ids=ids, position_ids=torch.arange(10).expand(2, 10), use_cache=False)
    assert torch.equal(kv["k"], cache.layers[-1].keys) and torch.equal(kv["v"], cache.layers[-1].values)


def test_lagged_draft_reads_no_target_kv_it_should_not_see():
    model = glide()
    ids = torch.randint(0, 512, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])  # two documents
    with torch.no_grad():
        _, (k, v) = model.target_forward(ids, pos)
        for lag in (1, 3):
            base = model.draft_logits(ids, pos, (k, v), lag)
            j = 2  # perturb the target K/V at index 2 (first document)
            k2, v2 = k.clone(), v.clone()
            k2[:, :, j] += 5.0
            v2[:, :, j] -= 5.0
            moved = (model.draft_logits(ids, pos, (k2, v2), lag) - base).abs().amax(-1)[0]
            unseen = [i for i in range(12) if i < j + lag or i >= 6]  # too early for index 2, or another document
            assert moved[unseen].max() == 0.0
            assert moved[j + lag] > 0  # the first index allowed to read it does


def test_decode_drafter_reproduces_training_logits_and_chain_acceptance():
    """The cached decode path and the teacher-forced training path compute the same draft, lag by lag."""
    model, gamma = glide(window=5), 3
    torch.manual_seed(2)
    prompts = torch.randint(0, 512, (2, 6))
    texts = greedy_continuations(model.target, prompts, 12)
    pos = torch.arange(texts.shape[1]).expand_as(texts)
    with torch.no_grad():
        _, target_kv = model.target_forward(texts, pos)
        lagged = [model.draft_logits(texts, pos, target_kv, lag) for lag in range(1, gamma + 1)]
    drafter = GlideDrafter(model)
    for b in range(2):
        for s in range(6, texts.shape[1] - gamma):
            row = texts[b:b + 1]
            kv = (target_kv[0][b:b + 1, :, :s], target_kv[1][b:b + 1, :, :s])  # the target has processed < s
            drafter.reset(row[:, :6])
            first = drafter.propose(row[:, :s + 1], TargetState(kv), 1, Sampler()).tokens  # feeds 0..s, the bonus at s: lag 1
            assert first == [int(lagged[0][b, s].argmax())]
            for k in range(2, gamma + 1):  # feed the true next tokens: chain step k sees lag k
                drafter.accept(s + k)  # keep everything: the "draft" was the text
                assert drafter.propose(row[:, :s + k], TargetState(kv), 1, Sampler()).tokens == [int(lagged[k - 1][b, s + k - 1].argmax())]
    got = chain_acceptance(model, texts, 6, gamma)
    assert got["tau_sim"] == pytest.approx(1 + sum(got["acceptance_unconditional"]))
    assert len(got["acceptance_conditional"]) == gamma


@pytest.mark.parametrize("window", [0, 2])
def test_glide_tree_nodes_are_the_top_k_of_their_paths(window):
    """Each tree node is among its parent's top-k when the context plus the node's path is fed as a plain chain:
    the tree's self-attention mask, window and indices are the chain's."""
    from treadle.speculative.tree import node_depths

    model, branching = glide(window=window), (2, 2, 2, 1)
    context = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        _, kv = model.target_forward(context[:, :-1], torch.arange(8)[None])
    drafter = GlideDrafter(model)
    drafter.reset(context)
    tree = drafter.propose_tree(context, TargetState(kv), branching, Sampler())
    assert drafter.seen == 9 and drafter.kv[0].shape[2] == 9  # the tree's K/V never enter the cache
    for node, depth in enumerate(node_depths(tree.parents)):
        path, p = [], tree.parents[node]
        while p >= 0:
            path, p = [tree.tokens[p], *path], tree.parents[p]
        fresh = GlideDrafter(model)
        logits = fresh._feed(torch.cat([context, torch.tensor([path], dtype=torch.long)], 1), kv)
        assert tree.tokens[node] in logits.topk(branching[depth - 1]).indices.tolist()


@pytest.mark.parametrize("window", [0, 3])
def test_glide_speculative_decoding_is_lossless(window):
    from treadle.speculative.decode import speculative_generate, target_generate

    model = glide(window=window)
    prompt = torch.randint(0, 512, (1, 8))
    want, _ = target_generate(model.target, prompt, 24)
    got = speculative_generate(model.target, GlideDrafter(model), prompt, gamma=4, max_new_tokens=24)
    assert got.tokens == want
    assert got.verify_calls >= 1
    # Greedy tree drafting: lossless too, and a width-1 tree accepts exactly what the chain does, call for call.
    tree = speculative_generate(model.target, GlideDrafter(model), prompt, gamma=4, max_new_tokens=24, tree=(3, 2, 1, 1))
    assert tree.tokens == want
    narrow = speculative_generate(model.target, GlideDrafter(model), prompt, gamma=4, max_new_tokens=24, tree=(1,) * 4)
    assert narrow.accepted_per_call == got.accepted_per_call and max(got.accepted_per_call) > 0
    # EAGLE-2 dynamic trees too; one that keeps the top 1 per depth is the chain.
    from treadle.speculative.tree import DynamicTree

    dynamic = speculative_generate(model.target, GlideDrafter(model), prompt, gamma=4, max_new_tokens=24,
                                   tree=DynamicTree(3, 4, 10))
    assert dynamic.tokens == want
    narrow = speculative_generate(model.target, GlideDrafter(model), prompt, gamma=4, max_new_tokens=24,
                                  tree=DynamicTree(1, 4, 4))
    assert narrow.accepted_per_call == got.accepted_per_call


@pytest.mark.parametrize("loss, window, lag", [("ce", 0, 1), ("kl", 0, 2), ("kl", 3, 1)])
def test_ttt_unroll_equals_a_naive_chain_per_row(loss, window, lag):
    """draft.ttt_steps for GLIDE: step k's row t is the draft fed its own chain (argmaxes of steps < k) after token t
    of its document, read at index t + k with lag ``lag`` + k, scored against index t + k's label or target
    distribution, weighted decay**k; the objective equals this written as plain per-row loops over each document
    alone, and with lag 1 the decode drafter proposes exactly the unroll's chain."""
    from treadle.config import DraftConfig
    from treadle.drafts.glide.objective import GlideObjective

    model = glide(window=window)
    for p in model.draft_model.parameters():  # sharp attention and logits: a wrong mask or position changes argmaxes
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    K, decay = 3, 0.5
    cfg = DraftConfig(kind="glide", target="x", loss=loss, ttt_steps=K, ttt_decay=decay, window=window)
    docs = [(0, 7), (7, 6)]  # (start, length): two packed documents
    pos = torch.tensor([[*range(7), *range(6)]])
    torch.manual_seed(3)
    ids = torch.randint(0, 512, (1, 13))
    labels = torch.cat((ids[:, 1:], torch.tensor([[7]])), 1)
    labels[0, 6] = labels[0, 12] = labels[0, 3] = -100  # document ends, and one unlabelled token inside
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    with torch.no_grad():
        got, side = GlideObjective(cfg, 512, 13).losses(model, batch, lag=lag, offset=0, train=True)
        out = model(ids, pos, lag=lag, steps=K)
        assert torch.equal(out.logits, model(ids, pos, lag=lag).logits)  # step 0 is today's teacher-forced pass
    want, hits, rows = 0.0, [0] * K, [0] * K
    drafter = GlideDrafter(model)
    for start, n in docs:
        text = ids[:, start:start + n]
        with torch.no_grad():
            target_logits, kv = model.target_forward(text, torch.arange(n)[None])
        for t in range(n):
            chain = []
            for k in range(min(K, n - t)):
                fed = torch.cat((text[0, :t + 1], torch.tensor(chain, dtype=torch.long)))[None]
                length = fed.shape[1]  # t + k + 1: the fed token stands at index t + k
                with torch.no_grad():
                    logits = model.draft_logits(fed, torch.arange(length)[None],
                                                (kv[0][:, :, :length], kv[1][:, :, :length]), lag=lag + k)[0, -1]
                label = int(labels[0, start + t + k])
                if label != -100:
                    log_q = torch.log_softmax(logits, -1)
                    p = torch.softmax(target_logits[0, t + k], -1)
                    value = -log_q[label] if loss == "ce" else (p * (p.log() - log_q)).sum()
                    want += decay ** k * float(value)
                    rows[k] += 1
                    hits[k] += int(logits.argmax() == target_logits[0, t + k].argmax())
                chain.append(int(logits.argmax()))
            if lag == 1 and t >= 1:  # decoding after the bonus at t: the target has processed tokens < t
                drafter.reset(text[:, :1])
                state = TargetState((kv[0][:, :, :t], kv[1][:, :, :t]))
                assert drafter.propose(text[:, :t + 1], state, len(chain), Sampler()).tokens == chain, t
    assert float(got.sum()) == pytest.approx(want, rel=1e-5, abs=1e-6)
    for k in range(K):
        assert float(side[f"ttt_rows_{k + 1}"]) == rows[k] and float(side[f"ttt_hits_{k + 1}"]) == hits[k], k
    assert rows == [10, 8, 6]  # the label mask moved along: 10 labelled tokens, each chain stops at its document's end


def test_ttt_steps_one_draws_todays_lags():
    """draft.ttt_steps = K trains chain links lag..lag + K - 1: lags are drawn in [1, gamma - K + 1], and K = 1
    (glide's default) keeps today's draws in [1, gamma], micro-batch by micro-batch."""
    from treadle.config import DraftConfig
    from treadle.drafts.glide.objective import GlideObjective

    def lags(**kw):
        objective = GlideObjective(DraftConfig(kind="glide", target="x", gamma=4, **kw), 512, 32)
        return [objective._draw({"order_position": torch.tensor([i])})[0] for i in range(200)]

    assert lags() == lags(ttt_steps=1) and set(lags()) == {1, 2, 3, 4}
    assert set(lags(ttt_steps=3)) == {1, 2} and set(lags(ttt_steps=4)) == set(lags(ttt_steps=9)) == {1}


def test_glide_ttt_with_context_parallelism_is_refused_in_one_line():
    from treadle.config import load_config
    from treadle.errors import UserError

    args = ["--data.train=builtin", "--draft.kind=glide", "--draft.target=x", "--distributed.context_parallel=2"]
    load_config(None, args)  # GLIDE runs with context parallelism; the unroll is not built for it
    with pytest.raises(UserError, match="draft.ttt_steps = 3") as got:
        load_config(None, [*args, "--draft.ttt_steps=3"])
    assert len(str(got.value).splitlines()) == 1


def test_draft_run_trains_only_the_draft_and_exports_it(shards, target_dir, tmp_path, capsys):
    from treadle.checkpoint.safety import read_metadata
    from treadle.config import load_config
    from treadle.train.run import build_trainer

    run = tmp_path / "run"
    trainer = build_trainer(load_config(None, draft_args(shards, target_dir, run, "--train.max_steps=3",
                                                          "--checkpoint.best_metric=tau_sim",
                                                          "--checkpoint.best_mode=max",
                                                          "--model.loss_chunk_tokens=16")[1:]))
    model = trainer.engine.model
    assert model.loss_chunk_tokens == 16  # trained through the chunked scores (tests/test_chunked_ce.py)
    before = {k: v.clone() for k, v in model.target.state_dict().items()}
    draft_before = {k: v.clone() for k, v in model.draft_model.state_dict().items()}
    trainer.fit()
    trainer.metrics.close()
    assert "degenerate" not in capsys.readouterr().out  # this random target writes varied text
    after = model.target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the target is bit-identical
    assert any(not torch.equal(draft_before[k], v) for k, v in model.draft_model.state_dict().items())

    # Checkpoints hold the draft and its optimizer state, never a target tensor.
    md = read_metadata(run / "checkpoints" / "step_3" / "state")
    keys = list(md.state_dict_metadata)
    assert any("draft_model." in k for k in keys)
    assert not [k for k in keys if "target" in k]

    # Both export forms hold the same draft weights; reloaded, they give the trained draft's logits.
    export = run / "draft"
    st = load_file(export / "model.safetensors")
    pth = torch.load(export / "draft_model_weights.pth", weights_only=True)
    assert st.keys() == pth.keys() == model.draft_model.state_dict().keys()
    assert not [k for k in st if k.startswith(("draft_model.", "target."))]
    config = json.loads((export / "config.json").read_text())
    assert config["treadle_draft_kind"] == "glide"
    # The target named by what it is, not where it sat (the directory means nothing on another machine).
    target_config = json.loads((target_dir / "config.json").read_text())
    assert "path" not in config["target"] and config["target"]["content_fingerprint"] == model_fingerprint(target_dir)
    assert {k: config["target"][k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")} == {
        k: target_config[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")}
    reloaded = load_glide(export, AutoModelForCausalLM.from_pretrained(target_dir))
    ids = torch.randint(0, 512, (1, 16))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        assert torch.equal(reloaded(ids, pos, lag=2).logits, model.eval()(ids, pos, lag=2).logits)

    # Acceptance and the target's reference loss are logged; "best" follows tau_sim.
    assert set(records(run, "tau_sim")) == {0, 3}
    assert records(run, "target_loss") and records(run, "eval_target_loss")
    assert (run / "checkpoints" / "best").resolve().name == "step_3"

    # treadle export rebuilds the same draft export from the run's checkpoint, which it knows is a draft run.
    assert main(["export", str(run), str(tmp_path / "again")]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(again[k], st[k]) for k in st)
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "wrong")]) == 2
    capsys.readouterr()
    assert main(["export", str(run), "--to", "speculators", str(tmp_path / "wrong")]) == 2  # no such layout for glide
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "accepted: a draft of kind 'eagle3'" in err
    assert not (tmp_path / "wrong").exists()
    # ... again over its own earlier export, with the marker that allows it; every file readable by others.
    assert main(["export", str(run), "--to", "draft", str(tmp_path / "again")]) == 0
    marker = json.loads((tmp_path / "again" / ".treadle.json").read_text())
    assert marker["kind"] == "export" and "draft_model_weights.pth" in marker["files"]
    # --dtype reaches a draft export too: bf16 on disk, recorded, and load_glide reads it back.
    assert main(["export", str(run), "--dtype", "bf16", str(tmp_path / "bf16")]) == 0
    half = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {v.dtype for v in half.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bf16"
    assert all(torch.equal(half[k], st[k].to(torch.bfloat16)) for k in st)
    load_glide(tmp_path / "bf16", AutoModelForCausalLM.from_pretrained(target_dir))
    umask = os.umask(0o022)
    os.umask(umask)
    for export_dir in (run / "draft", tmp_path / "again"):
        assert {p.stat().st_mode & 0o777 for p in export_dir.iterdir()} == {0o666 & ~umask}

    # spec-eval takes the run directory as --draft and decodes losslessly with it.
    out = tmp_path / "spec.json"
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(run), "--num-prompts", "2",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "glide" and got["gamma"] == 4
    assert 1.0 <= got["tau"] <= 5.0 and len(got["acceptance_conditional"]) == 4


@pytest.mark.parametrize("ttt", [(), ("--draft.ttt_steps=3",)])
def test_draft_run_resumes_bit_for_bit(shards, target_dir, tmp_path, ttt):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=4", "--checkpoint.every=2",
                            "--draft.loss=mix", *ttt)) == 0
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=4", "--draft.loss=mix", *ttt,
                            f"--checkpoint.resume={a / 'checkpoints' / 'step_2'}")) == 0
    la, lb = records(a), records(b)
    assert [la[s] for s in (3, 4)] == [lb[s] for s in (3, 4)]
    if ttt:  # the training-time test logs each step's accuracy, resumed identically
        assert set(records(a, "acc_3")) == {1, 2, 3, 4} and records(a, "acc_3")[4] == records(b, "acc_3")[4]
    else:
        assert not records(a, "acc_1")
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_draft_run_bad_target_is_one_line(shards, tmp_path, capsys):
    assert main(draft_args(shards, tmp_path / "nowhere", tmp_path / "run", "--train.max_steps=2")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "draft.target" in err
    assert not (tmp_path / "run").exists()


def test_a_looping_target_is_named_degenerate_once_and_natural_text_is_not(shards, target_dir, tmp_path, capsys):
    """Issue 13.10: a draft reaches tau_sim's ceiling on a target that repeats itself; the run says so, once.
    Issue 39.4: spec-eval says so too, the same line with prompt lookup's tau beside the draft's."""
    from treadle.data.packed import PackedDataset
    from treadle.speculative.acceptance import degenerate_target_warning, lookup_tau

    val = PackedDataset([shards / "val"], seq_len=32)
    natural = torch.stack([val[i]["input_ids"] for i in range(8)])  # Python source: repetitive, but not a loop
    assert degenerate_target_warning(lookup_tau(natural, 8, 4), 4) is None
    looped = [list(range(8)) + [9, 10, 11] * 8]
    assert degenerate_target_warning(lookup_tau(torch.tensor(looped), 8, 4), 4) is not None
    # spec-eval's rows: any lengths, a prompt length per row; a row too short for a chain has no start
    assert lookup_tau(looped + [[1, 2, 3]], [8, 3], 4) == lookup_tau(torch.tensor(looped), 8, 4)
    assert lookup_tau([[1, 2, 3]], [3], 4) is None and degenerate_target_warning(None, 4) is None
    # A real model that always writes token 0: its lm_head is zero, so every logit ties and argmax is 0.
    looping = tmp_path / "looping"
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    target.lm_head.weight.data.zero_()
    target.save_pretrained(looping)
    for f in target_dir.glob("tokenizer*"):
        (looping / f.name).write_bytes(f.read_bytes())
    run = tmp_path / "run"
    assert main(draft_args(shards, looping, run, "--train.max_steps=2", "--train.eval_every=1")) == 0
    out = capsys.readouterr().out
    assert out.count("the target looks degenerate") == 1 and "reaches tau 5.00 of at most 5" in out
    assert max(records(run, "tau_sim").values()) == 5.0  # the ceiling, whatever the draft learnt
    # spec-eval stops at eos, which token 0 is: a looping target for it writes token 7 at every step. Dimension 0 of
    # its residual stream is 1 for every token and no layer writes to it, so only token 7's logit is positive.
    loops_on_7 = tmp_path / "loops-on-7"
    with torch.no_grad():
        target.model.embed_tokens.weight[:, 0] = 1.0
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        target.lm_head.weight[7, 0] = 1.0
    target.save_pretrained(loops_on_7)
    for f in target_dir.glob("tokenizer*"):
        (loops_on_7 / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()
    result = tmp_path / "spec.json"
    assert main([*SPEC_EVAL, "--target", str(loops_on_7), "--draft", str(run), "--num-prompts", "2", "--prompt-len",
                 "8", "--max-new-tokens", "12", "--json", str(result)]) == 0
    got = json.loads(result.read_text())
    assert got["prompt_lookup_tau"] == 5.0 and got["generated_tokens"] == 24
    err = capsys.readouterr().err
    assert err.count("treadle: warning: the target looks degenerate") == 1
    assert (f"reaches tau 5.00 of at most 5 on them; the draft's tau: {got['tau']:.2f}), so a tau near its ceiling"
            in err)
    # natural text: the random target's continuations do not loop, and spec-eval says nothing
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(run), "--num-prompts", "2", "--prompt-len",
                 "8", "--max-new-tokens", "12", "--json", str(result)]) == 0
    assert json.loads(result.read_text())["prompt_lookup_tau"] < 3 and "degenerate" not in capsys.readouterr().err
