"""Greedy speculative decoding: lossless output, acceptance statistics, drafters, prompts, spec-eval."""

import argparse
import copy
import json

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from treadle import corpus
from treadle.errors import UserError
from treadle.models.hf import cache_kwargs, load_causal_lm
from treadle.speculative import evaluate
from treadle.speculative.decode import Proposal, SpecResult, speculative_generate, summarize, target_generate
from treadle.speculative.drafters import ModelDrafter, PromptLookupDrafter, RandomDrafter
from treadle.speculative.prompts import heldout_prompts, load_prompts_jsonl
from treadle.speculative.sampling import Sampler
from treadle.tokenizer import load_backend_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 4
NEW = 24
VOCAB = 128


def tiny_llama(vocab_size=VOCAB, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (1, 12), generator=gen) for _ in range(3)]


@pytest.fixture(scope="module")
def noisy_copy(target):
    """A draft that agrees with the target only sometimes: every acceptance count occurs."""
    model = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    return model


class Spy:
    """Wraps a drafter and records what each propose call saw and returned."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, []

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def propose(self, context_ids, state, gamma, sampler):
        proposal = self.inner.propose(context_ids, state, gamma, sampler)
        keys, values = state.kv
        self.calls.append((context_ids.clone(), keys.clone(), values.clone(), proposal.tokens))
        return proposal

    def accept(self, n_context):
        self.inner.accept(n_context)


def run_all(target, drafter, prompts, max_new_tokens=NEW, eos_id=None):
    """Speculative results for every prompt, each checked against the target's own greedy output."""
    results = []
    for prompt in prompts:
        reference, _ = target_generate(target, prompt, max_new_tokens, eos_id)
        result = speculative_generate(target, drafter, prompt, GAMMA, max_new_tokens, eos_id)
        assert result.tokens == reference
        results.append(result)
    return results


# --------------------------------------------------------------------------- the loop


def test_exact_copy_accepts_every_draft(target, prompts):
    results = run_all(target, ModelDrafter(copy.deepcopy(target)), prompts)
    summary = summarize(results, GAMMA)
    assert summary["tau"] == GAMMA + 1
    assert summary["acceptance_conditional"] == [1.0] * GAMMA
    assert summary["acceptance_unconditional"] == [1.0] * GAMMA
    # 1 prefill token, then 5 per call: ceil(23 / 5) calls per prompt.
    assert [r.verify_calls for r in results] == [5, 5, 5]
    assert summary["generated_tokens"] == NEW * len(prompts)


def test_random_drafter_is_lossless_and_accepts_almost_nothing(target, prompts):
    results = run_all(target, RandomDrafter(VOCAB, seed=0), prompts)
    tau = summarize(results, GAMMA)["tau"]
    assert 1.0 <= tau < 1.2


def test_tau_is_one_plus_sum_of_unconditional_acceptance(target, prompts):
    results = run_all(target, PromptLookupDrafter(), prompts, max_new_tokens=40)
    accepted = {n for r in results for n in r.accepted_per_call}
    assert {0, GAMMA} <= accepted  # a mixed case, or the identity would hold trivially
    s = summarize(results, GAMMA)
    assert 1.0 < s["tau"] < GAMMA + 1
    assert s["tau"] == pytest.approx(1 + sum(s["acceptance_unconditional"]))
    chained = 1.0
    for k in range(GAMMA):
        chained *= s["acceptance_conditional"][k]
        assert chained == pytest.approx(s["acceptance_unconditional"][k])


def test_summarize_by_hand():
    r = SpecResult(tokens=[1] * 11, verify_calls=4, accepted_per_call=[0, 2, 4, 1], gamma=4, seconds=1.0)
    s = summarize([r], 4)
    assert s["tau"] == r.tau == (1 + 3 + 5 + 2) / 4
    assert s["acceptance_unconditional"] == [3 / 4, 2 / 4, 1 / 4, 1 / 4]
    assert s["acceptance_conditional"] == [3 / 4, 2 / 3, 1 / 2, 1.0]
    never = summarize([SpecResult([1], 2, [0, 0], 4, 1.0)], 4)
    assert never["acceptance_conditional"] == [0.0, None, None, None]
    assert summarize([SpecResult([1], 0, [], 4, 1.0)], 4)["tau"] is None


@pytest.mark.parametrize("draft", ["random", "noisy"])
def test_target_kv_is_the_fresh_forward_of_context_minus_bonus(target, prompts, noisy_copy, draft):
    inner = RandomDrafter(VOCAB, seed=3) if draft == "random" else ModelDrafter(noisy_copy)
    spy = Spy(inner)
    run_all(target, spy, prompts[:1])
    assert len(spy.calls) > 3
    for context, keys, values, _ in spy.calls:
        assert keys.shape[-2] == values.shape[-2] == context.shape[1] - 1
        fresh = DynamicCache()
        with torch.inference_mode():
            target(input_ids=context[:, :-1], use_cache=True, **cache_kwargs(target, fresh))
        torch.testing.assert_close(keys, fresh.layers[-1].keys)
        torch.testing.assert_close(values, fresh.layers[-1].values)


class FeatureSpy(Spy):
    """A drafter that declares feature layers: records the hidden states handed to it."""

    feature_layers = (2, 0, 1)

    def propose(self, context_ids, state, gamma, sampler):
        self.calls.append((context_ids.shape[1], state.start, state.hidden.clone()))
        return self.inner.propose(context_ids, state, gamma, sampler)


def assert_hidden_rows_tile_the_sequence(calls, target, full: list[int]) -> None:
    """Each call's hidden rows start where the last call's ended and equal a fresh target forward over ``full``
    (the accepted sequence) read as training reads it (``capture_features``: where each state is made, so the last
    layer's is its own output, not the final norm's that ``output_hidden_states`` puts last), the feature layers
    concatenated in the drafter's order."""
    from treadle.drafts.targets import capture_features

    with torch.inference_mode(), capture_features(target, FeatureSpy.feature_layers) as tap:
        target(input_ids=torch.tensor([full]))
        want = tap.take()
    covered = 0
    for length, start, hidden in calls:
        assert start == covered and start + hidden.shape[1] == length - 1
        torch.testing.assert_close(hidden, want[:, start:length - 1], atol=1e-4, rtol=1e-4)
        covered = length - 1


def test_feature_layers_get_the_accepted_positions_hidden_states_once(target, prompts, noisy_copy):
    """The contract EAGLE-3 builds on: over a sequence the hidden rows tile positions 0.. exactly once, each equal to
    a fresh target forward over the accepted sequence, layers concatenated in the drafter's order."""
    spy = FeatureSpy(ModelDrafter(noisy_copy))
    result = run_all(target, spy, prompts[:1], max_new_tokens=32)[0]
    assert len(set(result.accepted_per_call)) >= 2  # partial acceptances cut the hidden rows
    assert_hidden_rows_tile_the_sequence(spy.calls, target, prompts[0][0].tolist() + result.tokens)
    assert spy.calls[0][2].shape[1] == prompts[0].shape[1]  # the first call: the whole prompt


def test_model_drafter_cache_stays_consistent(target, prompts, noisy_copy):
    """Every proposal equals the draft model's greedy continuation computed from scratch."""
    spy = Spy(ModelDrafter(noisy_copy))
    results = run_all(target, spy, prompts, max_new_tokens=32)
    accepted = {n for r in results for n in r.accepted_per_call}
    assert len(accepted) >= 3  # full, partial and zero acceptance all exercise the crop
    for context, _, _, draft in spy.calls:
        assert draft == target_generate(noisy_copy, context, GAMMA)[0]


def test_max_new_tokens_truncates_exactly(target, prompts):
    reference, _ = target_generate(target, prompts[0], NEW)
    drafter = ModelDrafter(copy.deepcopy(target))
    result = speculative_generate(target, drafter, prompts[0], GAMMA, 7)
    assert result.tokens == reference[:7]
    assert result.verify_calls == 2  # 1 + 5 = 6 < 7, then 11 cut to 7
    one = speculative_generate(target, drafter, prompts[0], GAMMA, 1)
    assert one.tokens == reference[:1] and one.verify_calls == 0 and one.tau is None


@pytest.mark.parametrize("draft", ["copy", "random"])
def test_eos_stops_and_is_kept(target, prompts, draft):
    reference, _ = target_generate(target, prompts[0], NEW)
    # A first occurrence in the middle of a copy-drafter round (rounds end at 5, 10, ...).
    stop = next(i for i in range(6, NEW) if reference[i] not in reference[:i] and i % (GAMMA + 1))
    eos = reference[stop]
    drafter = ModelDrafter(copy.deepcopy(target)) if draft == "copy" else RandomDrafter(VOCAB)
    tokens, _ = target_generate(target, prompts[0], NEW, eos_id=eos)
    assert tokens == reference[: stop + 1]
    result = speculative_generate(target, drafter, prompts[0], GAMMA, NEW, eos_id=eos)
    assert result.tokens == tokens
    if draft == "copy":  # no call after the one that produced eos, even when eos was not its last token
        assert result.verify_calls == -(-stop // (GAMMA + 1))


def test_drafter_must_propose_gamma_tokens(target, prompts):
    class Short(RandomDrafter):
        def propose(self, context_ids, state, gamma, sampler):
            proposal = super().propose(context_ids, state, gamma, sampler)
            return Proposal(proposal.tokens[:-1])

    with pytest.raises(RuntimeError, match="proposed 3 tokens, expected 4"):
        speculative_generate(target, Short(VOCAB), prompts[0], GAMMA, NEW)


# --------------------------------------------------------------------------- prompt lookup


def lookup(seq, gamma, **kw):
    return PromptLookupDrafter(**kw).propose(torch.tensor([seq]), None, gamma, Sampler()).tokens


def test_prompt_lookup_takes_most_recent_match_with_full_continuation():
    # [5, 6] last occurs at 3, but only 3 tokens follow it; at 0 a full 4 follow.
    assert lookup([5, 6, 7, 5, 6, 7, 5, 6], 4) == [7, 5, 6, 7]
    # Two full matches of [1, 2, 3]: the later one wins.
    assert lookup([1, 2, 3, 9, 9, 9, 1, 2, 3, 7, 8, 6, 5, 1, 2, 3], 3) == [7, 8, 6]


def test_prompt_lookup_prefers_longer_ngrams_then_falls_back():
    # [8, 2, 3] matches at 0 (-> 4 4 4); the single token 3 matches more recently (-> 5 5 5).
    seq = [8, 2, 3, 4, 4, 4, 0, 7, 3, 5, 5, 5, 0, 8, 2, 3]
    assert lookup(seq, 3) == [4, 4, 4]
    assert lookup(seq, 3, max_ngram=1) == [5, 5, 5]
    assert lookup([4, 1, 9, 2, 4], 2) == [1, 9]
    assert lookup([4, 1, 9, 2, 4], 2, min_ngram=2) == [4, 4]  # no match: the last token repeated
    assert lookup([1, 2, 3], 4) == [3, 3, 3, 3]


# --------------------------------------------------------------------------- prompts and spec-eval


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    files = [p for _, p in corpus.corpus_files()[:5]]
    return corpus.train_tokenizer(files, tmp_path_factory.mktemp("tok"), vocab_size=300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tok_dir):
    """A treadle-like run directory whose hf/ holds a tiny Llama and the tokenizer."""
    from transformers import AutoTokenizer

    run = tmp_path_factory.mktemp("run")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(run / "hf")
    tokenizer.save_pretrained(run / "hf")
    return run


def test_heldout_prompts_come_from_val_files_deterministically(tok_dir):
    prompts = heldout_prompts(tok_dir, 4, 16)
    assert prompts == heldout_prompts(str(tok_dir), 4, 16)
    assert [len(p) for p in prompts] == [16] * 4
    backend = load_backend_tokenizer(tok_dir)
    val_texts = [path.read_text() for rel, path in corpus.corpus_files() if corpus.split_of(rel) == "val"]
    for prompt in prompts:
        assert any(backend.decode(prompt) in text for text in val_texts)
    with pytest.raises(UserError, match="requested"):
        heldout_prompts(tok_dir, 10**6, 16)


def test_load_prompts_jsonl(tmp_path, tok_dir):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "def f(x):"}\n\n{"text": "import os\\nimport sys\\n"}\n')
    encode = load_backend_tokenizer(tok_dir).encode
    prompts = load_prompts_jsonl(good, tok_dir, 3)
    assert prompts[0] == encode("def f(x):").ids[-3:]
    assert prompts[1] == encode("import os\nimport sys\n").ids[-3:]
    bad = tmp_path / "bad.jsonl"
    for body, message in [('{"prompt": "a"}\n\n{"prompt": 3}\n', "bad.jsonl:3: expected a JSON object"),
                          ('{"prompt": "a"}\n{oops\n', "bad.jsonl:2: not valid JSON"),
                          ("\n", "no prompts")]:
        bad.write_text(body)
        with pytest.raises(UserError, match=message):
            load_prompts_jsonl(bad, tok_dir, 8)
    with pytest.raises(UserError, match="cannot read"):
        load_prompts_jsonl(tmp_path / "missing.jsonl", tok_dir, 8)


def spec_eval(*argv):
    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return evaluate.run(parser.parse_args(list(argv)))


def test_spec_eval_writes_json(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich would wrap the table's text at 80 columns
    out = tmp_path / "r.json"
    rc = spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", "--num-prompts", "2", "--prompt-len", "16",
                   "--max-new-tokens", "12", "--json", str(out))
    assert rc == 0
    assert "tokens per target verification call, bonus token included" in capsys.readouterr().out
    r = json.loads(out.read_text())
    for key in ("tau", "gamma", "acceptance_conditional", "acceptance_unconditional", "lossless",
                "tokens_per_s_spec", "tokens_per_s_target", "num_prompts", "generated_tokens", "verify_calls",
                "drafter"):
        assert key in r
    assert r["lossless"] is True and r["gamma"] == 4 and r["num_prompts"] == 2 and r["drafter"] == "prompt-lookup"
    assert r["tau"] == pytest.approx(1 + sum(r["acceptance_unconditional"]))
    assert r["tokens_per_s_spec"] > 0 and r["tokens_per_s_target"] > 0
    assert r["written_by"] == "treadle spec-eval"  # what lets a later --json replace it
    # Rerunning over its own result replaces it (make demo does), as it does a result from before written_by.
    del r["written_by"]
    out.write_text(json.dumps(r))
    assert spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", "--num-prompts", "1", "--prompt-len", "16",
                     "--max-new-tokens", "4", "--json", str(out)) == 0
    assert json.loads(out.read_text())["num_prompts"] == 1


def test_spec_eval_interleaves_and_repeats_the_timed_phases_and_warns_on_a_loaded_machine(run_dir, tmp_path, capsys,
                                                                                           monkeypatch):
    """Issue 48: under load one side's timing was slowed more than the other's (0.09x, 0.36x quiet). The phases
    alternate prompt by prompt and pass by pass; speeds are the median pass's, with the spread; a loaded machine
    (readings given here: never this machine's) is said in one line; tau and the lossless check come from one pass."""
    from treadle import machine_load
    from treadle.speculative import decode

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    calls = []
    real_target, real_spec = decode.target_generate, decode.speculative_generate

    def target_spy(*a, **k):
        calls.append("T")
        return real_target(*a, **k)

    def spec_spy(*a, **k):
        calls.append("S")
        return real_spec(*a, **k)

    monkeypatch.setattr(decode, "target_generate", target_spy)  # evaluate imports them from decode when it runs
    monkeypatch.setattr(decode, "speculative_generate", spec_spy)
    loaded = machine_load.Readings(load=3.9, cpus=2, steal=0.0)
    monkeypatch.setattr(machine_load, "watch", lambda: machine_load.Given(loaded))
    common = ["--target", str(run_dir), "--draft", str(run_dir), "--num-prompts", "2", "--prompt-len", "16",
              "--max-new-tokens", "12"]
    assert spec_eval(*common, "--repeats", "2", "--json", str(tmp_path / "a.json")) == 0
    assert calls == ["T", "S"] + ["T", "S", "S", "T"] + ["S", "T", "T", "S"]  # the warm-up, then two passes
    out, err = capsys.readouterr()
    r = json.loads((tmp_path / "a.json").read_text())
    assert r["repeats"] == 2 and len(r["speedup_repeats"]) == 2 and r["speedup"] in r["speedup_repeats"]
    assert r["speedup_min"] == min(r["speedup_repeats"]) <= r["speedup"] <= r["speedup_max"]
    assert r["speedup"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_target"], rel=1e-12)
    assert r["load"] == {"loaded": True, "why": "load 3.9 on 2 CPUs"}
    assert evaluate.is_spec_eval_json(tmp_path / "a.json")
    assert f"{r['speedup']:.2f}x (median of 2 passes; {r['speedup_min']:.2f}x to {r['speedup_max']:.2f}x)" in out
    warning, = [line for line in err.splitlines() if "loaded" in line]
    assert warning.startswith("treadle: spec-eval: the machine was loaded while it timed the decoding (load 3.9 on 2 "
                              "CPUs): the tokens/s and the speedup ") and warning.endswith("do not depend on it")
    # One pass on a quiet machine: the same tau, acceptance and draft forwards (counted over the first pass only),
    # and no warning.
    quiet = machine_load.Readings(load=0.2, cpus=2, steal=0.0)
    monkeypatch.setattr(machine_load, "watch", lambda: machine_load.Given(quiet))
    calls.clear()
    assert spec_eval(*common, "--repeats", "1", "--json", str(tmp_path / "b.json")) == 0
    assert calls == ["T", "S", "T", "S", "S", "T"]
    one = json.loads((tmp_path / "b.json").read_text())
    assert one["repeats"] == 1 and one["load"]["loaded"] is False and "loaded" not in capsys.readouterr().err
    for key in ("tau", "acceptance_unconditional", "draft_forwards_per_round", "lossless", "generated_tokens"):
        assert one[key] == r[key], key
    with pytest.raises(UserError, match=r"^--repeats 0: must be >= 1"):
        spec_eval(*common, "--repeats", "0")


def test_speed_figures_are_the_median_pass_and_the_spread():
    figures = evaluate.speed_figures([(10.0, 20.0), (30.0, 10.0), (4.0, 10.0)])
    assert figures == {"tokens_per_s_spec": 10.0, "tokens_per_s_target": 20.0, "speedup": 0.5, "repeats": 3,
                       "speedup_min": 0.4, "speedup_max": 3.0, "speedup_repeats": [0.5, 3.0, 0.4]}
    assert evaluate.speed_figures([(1.0, 1.0), (2.0, 1.0)])["speedup"] == 1.0  # an even count: the lower middle


def test_spec_eval_model_draft_and_prompts_file(run_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "class A:\\n    def f(self):"}\n{"text": "for i in range(3):"}\n')
    out = tmp_path / "r.json"
    rc = spec_eval("--target", str(run_dir / "hf"), "--draft", str(run_dir), "--prompts", str(prompts),
                   "--gamma", "3", "--max-new-tokens", "9", "--json", str(out))
    r = json.loads(out.read_text())
    assert rc == 0 and r["num_prompts"] == 2 and r["drafter"].startswith("lm:")
    assert r["tau"] == 4 and r["acceptance_conditional"] == [1.0] * 3  # the draft is the target itself


def test_spec_eval_tree_and_sampled(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "r.json"
    # The draft is the target itself: every path of the tree that follows the target's argmax is accepted.
    assert spec_eval("--target", str(run_dir), "--draft", str(run_dir), "--tree", "2,2,1", "--num-prompts", "2",
                     "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["tree"] == [2, 2, 1] and r["gamma"] == 3 and r["lossless"] is True and r["tau"] == 4
    printed = capsys.readouterr().out
    assert "tree 2,2,1: 10 nodes, depth 3" in printed, printed
    assert spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", "--temperature", "0.8", "--top-p", "0.9",
                     "--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["lossless"] is None and r["temperature"] == 0.8 and r["tau"] >= 1
    assert "not compared (sampled at temperature 0.8" in capsys.readouterr().out
    # A sampled tree: the draft's q is the target's p at every node, so the first child is (almost surely) accepted.
    assert spec_eval("--target", str(run_dir), "--draft", str(run_dir), "--tree", "2,2,1", "--temperature", "1",
                     "--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["tree"] == [2, 2, 1] and r["temperature"] == 1 and r["lossless"] is None and r["tau"] > 3.5
    # 2 + 4 + 4 candidates, all kept: the greedy path is among them.
    assert spec_eval("--target", str(run_dir), "--draft", str(run_dir), "--tree", "dynamic:2,3,10",
                     "--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["tree"] == "dynamic:2,3,10" and r["gamma"] == 3 and r["lossless"] is True and r["tau"] == 4
    assert "tree dynamic:2,3,10: EAGLE-2 dynamic tree, depth 3" in capsys.readouterr().out
    # Sampled too (it was refused): the draft's q is the target's p, so each first-drawn child is (almost surely)
    # accepted; all 10 drawn nodes kept, a round takes 2 drafts and the bonus, 3 when its depth-2 node was expanded.
    assert spec_eval("--target", str(run_dir), "--draft", str(run_dir), "--tree", "dynamic:2,3,10", "--temperature",
                     "1", "--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["tree"] == "dynamic:2,3,10" and r["temperature"] == 1 and r["lossless"] is None and r["tau"] >= 3
    # 4 of them kept: the tree is nearly uniform over 300 tokens, so the kept are the 2 drawn at depth 1 and 2 at
    # depth 2; a round ends at the latest on an unscored depth-3 node (3 tokens, none of them the target's bonus).
    assert spec_eval("--target", str(run_dir), "--draft", str(run_dir), "--tree", "dynamic:2,3,4", "--temperature",
                     "1", "--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "12", "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert 2 <= r["tau"] <= 3 and r["acceptance_unconditional"][0] > 0.9


def test_spec_eval_dtype_bf16_decodes_with_bf16_weights(run_dir, tmp_path, capsys, monkeypatch):
    """--dtype bf16: target and draft decode with bf16 parameters (what the engines serve), their rotary frequencies
    kept in fp32; the record and the report say which precision measured the tau."""
    monkeypatch.setenv("COLUMNS", "200")
    seen = []
    real = evaluate.evaluate_drafter

    def spy(target, drafter, *args, **kwargs):
        seen.append((target, drafter))
        return real(target, drafter, *args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate_drafter", spy)
    out = tmp_path / "r.json"
    for dtype, weights in (("bf16", torch.bfloat16), (None, torch.float32)):
        flags = [] if dtype is None else ["--dtype", dtype]
        assert spec_eval("--target", str(run_dir), "--draft", str(run_dir), "--num-prompts", "2", "--prompt-len", "16",
                         "--max-new-tokens", "8", "--json", str(out), *flags) == 0
        target, drafter = seen.pop()
        for model in (target, drafter.model):
            assert {p.dtype for p in model.parameters()} == {weights}
            assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        r = json.loads(out.read_text())
        assert r["dtype"] == (dtype or "fp32") and r["lossless"] is True
    printed = capsys.readouterr().out
    assert "bf16 weights (--dtype bf16) on cpu" in printed and "fp32 weights on cpu" in printed


def test_spec_eval_reports_a_lossy_decoder(run_dir, monkeypatch, capsys):
    from treadle.speculative import decode

    real = decode.speculative_generate

    def lossy(*args, **kwargs):
        result = real(*args, **kwargs)
        if len(result.tokens) > 5:  # not the 4-token warm-up
            result.tokens[5] += 1
        return result

    monkeypatch.setattr(decode, "speculative_generate", lossy)  # evaluate imports it from decode when it runs
    rc = spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", "--num-prompts", "1", "--prompt-len", "8",
                   "--max-new-tokens", "8")
    assert rc == 1
    assert "prompt 0 differs from the target's greedy output at generated token 5" in capsys.readouterr().err


def test_spec_eval_bad_input(run_dir, tmp_path):
    with pytest.raises(UserError, match="--target .*neither a Hugging Face model directory"):
        spec_eval("--target", str(tmp_path / "nope"), "--draft", "prompt-lookup")
    with pytest.raises(UserError, match="--json"):
        spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", "--json", str(tmp_path / "no" / "r.json"))
    with pytest.raises(UserError, match="--gamma 0"):
        spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", "--gamma", "0")
    for flags, message in [(["--tree", "4,x"], "--tree 4,x: accepted: branching factors >= 1"),
                           (["--tree", "2,0"], "--tree 2,0: accepted"),
                           (["--tree", "2,2", "--gamma", "4"], "--gamma 4 with --tree 2,2: the tree's depth is 2"),
                           (["--tree", "dynamic:4,4"], "--tree dynamic:4,4: accepted: .* or dynamic:K,D,N"),
                           (["--tree", "dynamic:4,0,8"], "--tree dynamic:4,0,8: accepted"),
                           (["--tree", "dynamic:2,3,6", "--gamma", "4"],
                            "--gamma 4 with --tree dynamic:2,3,6: the tree's depth is 3"),
                           (["--dtype", "fp16"], r"^--dtype fp16: accepted: fp32 \(the default\) or bf16 "),
                           (["--temperature", "-1"], "--temperature -1.0: must be >= 0"),
                           (["--temperature", "1", "--top-p", "0"], r"--top-p 0.0: must be in \(0, 1\]")]:
        with pytest.raises(UserError, match=message):
            spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", *flags)
    # A draft for another target: what differs, field by field, and what would be accepted. An export written before
    # targets were recorded by what they are still reads (its path is shown as where the target was).
    target = load_causal_lm(run_dir, "--target")
    glide = tmp_path / "glide"
    glide.mkdir()
    (glide / "config.json").write_text(json.dumps({"treadle_draft_kind": "glide",
                                                   "target": {"config_fingerprint": "0" * 16, "path": "elsewhere"}}))
    with pytest.raises(UserError, match=r"trained for another target than this one \(config fingerprint 0+ there, "
                       r"[0-9a-f]{16} here\); accepted: the target it was trained for \(config fingerprint 0+, at "
                       r"elsewhere when it was trained\), or a draft trained for this one$"):
        evaluate.load_drafter(str(glide), target, None)
    c = target.config
    theirs = {"model_type": c.model_type, "vocab_size": 999, "hidden_size": c.hidden_size,
              "num_hidden_layers": c.num_hidden_layers, "config_fingerprint": "1" * 16}
    (glide / "config.json").write_text(json.dumps({"treadle_draft_kind": "glide", "target": theirs,
                                                   "target_config": {**c.to_dict(), "vocab_size": 999}}))
    with pytest.raises(UserError, match=rf"\(vocab_size 999 there, {c.vocab_size} here\); accepted: the target it was "
                       rf"trained for \({c.model_type}, vocab_size 999, hidden_size {c.hidden_size}, num_hidden_layers "
                       rf"{c.num_hidden_layers}, config fingerprint 1+\), or a draft trained for this one$"):
        evaluate.load_drafter(str(glide), target, None)


def test_prompts_jsonl_lines_end_at_newline_only_and_must_be_utf8(tmp_path, tok_dir):
    """Holes 10a and 5: a U+2028 inside a prompt cut the row in two; a byte that is not UTF-8 names its line."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "x = 1\u2028y = 2\x85z"}, ensure_ascii=False) + "\n", encoding="utf-8")
    encode = load_backend_tokenizer(tok_dir).encode
    assert load_prompts_jsonl(f, tok_dir, 64) == [encode("x = 1\u2028y = 2\x85z").ids]
    f.write_bytes(b'{"prompt": "a"}\n{"prompt": "b\xff"}\n')
    with pytest.raises(UserError, match=rf"{f}:2: not UTF-8 \(byte 0xff at byte 14 of the line\)"):
        load_prompts_jsonl(f, tok_dir, 8)


# --------------------------------------------------------------------------- tree drafting


TREE = (3, 2, 1, 1)


def test_tree_shape_helpers():
    from treadle.speculative.tree import ancestor_mask, node_depths, tree_size

    assert tree_size((4, 2, 2, 1)) == 4 + 8 + 16 + 16 and tree_size((1,) * 4) == 4
    parents = [-1, -1, 0, 0, 1, 2]
    assert node_depths(parents) == [1, 1, 2, 2, 2, 3]
    assert ancestor_mask(parents)[5].tolist() == [True, False, True, False, False, True]
    with pytest.raises(ValueError, match="parents must come before"):
        node_depths([-1, 2, 0])


def path_to(node, tokens, parents):
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def test_model_drafter_tree_nodes_are_the_top_k_of_their_paths(prompts, noisy_copy):
    """Each node is among its parent's top-k under a fresh forward of context + path: the draft's tree masks and
    positions are right, and the cache is left holding the context only."""
    drafter = ModelDrafter(noisy_copy)
    context = prompts[0]
    drafter.reset(context)
    proposal = drafter.propose_tree(context, None, TREE, Sampler())
    from treadle.speculative.tree import node_depths

    assert len(proposal.tokens) == 3 + 6 + 6 + 6
    for node, depth in enumerate(node_depths(proposal.parents)):
        parent_path = path_to(proposal.parents[node], proposal.tokens, proposal.parents)
        with torch.inference_mode():
            logits = noisy_copy(input_ids=torch.cat([context, torch.tensor([parent_path], dtype=torch.long)], 1)).logits
        assert proposal.tokens[node] in logits[0, -1].topk(TREE[depth - 1]).indices.tolist()
    assert drafter._cache.get_seq_length() == context.shape[1]


def test_dynamic_tree_keeps_the_likeliest_nodes_of_top_k_expansions(prompts, noisy_copy):
    """EAGLE-2's dynamic tree equals a naive reference run on fresh forwards of context + path: per depth the K
    likeliest candidates (cumulative draft log-prob) get their top-K children, and the N likeliest candidates of
    all are kept."""
    from treadle.speculative.tree import DynamicTree

    k, depth, n = 3, 4, 10
    draft = copy.deepcopy(noisy_copy)
    with torch.no_grad():
        draft.lm_head.weight.mul_(30)  # peaked, uneven distributions: deep nodes outrank shallow ones, or not
    drafter, context = ModelDrafter(draft), prompts[0]
    drafter.reset(context)
    proposal = drafter.propose_tree(context, None, DynamicTree(k, depth, n), Sampler())
    assert proposal.q is None and drafter._cache.get_seq_length() == context.shape[1]

    def children(path, score):
        with torch.inference_mode():
            ids = torch.cat([context, torch.tensor([path], dtype=torch.long)], 1)
            top = draft(input_ids=ids).logits[0, -1].log_softmax(-1).topk(k)
        return [((*path, int(t)), score + float(v)) for v, t in zip(top.values, top.indices)]

    level = children((), 0.0)
    candidates = list(level)
    for _ in range(depth - 1):
        chosen = sorted(level, key=lambda c: -c[1])[:k]
        level = [child for path, score in chosen for child in children(path, score)]
        candidates += level
    want = {path for path, _ in sorted(candidates, key=lambda c: -c[1])[:n]}
    got = {tuple(path_to(node, proposal.tokens, proposal.parents)) for node in range(len(proposal.tokens))}
    assert got == want and max(map(len, got)) == depth and len({len(p) for p in got}) == depth  # every depth kept


def tree_run(target, drafter, prompts, tree, max_new_tokens=NEW):
    from treadle.speculative.tree import tree_depth

    results = []
    for prompt in prompts:
        reference, _ = target_generate(target, prompt, max_new_tokens)
        result = speculative_generate(target, drafter, prompt, tree_depth(tree), max_new_tokens, tree=tree)
        assert result.tokens == reference  # lossless
        results.append(result)
    return results


def test_greedy_tree_is_lossless_and_beats_the_chain(target, prompts, noisy_copy):
    chain = summarize(run_all(target, ModelDrafter(noisy_copy), prompts, max_new_tokens=32), GAMMA)["tau"]
    results = tree_run(target, ModelDrafter(noisy_copy), prompts, TREE, max_new_tokens=32)
    tree = summarize(results, len(TREE))["tau"]
    assert len({n for r in results for n in r.accepted_per_call}) >= 3  # partial paths compact the cache
    assert tree > chain
    # A tree of width 1 is the chain: the same acceptances call for call (masks and positions agree with causal).
    narrow = tree_run(target, ModelDrafter(noisy_copy), prompts, (1,) * GAMMA, max_new_tokens=32)
    chained = run_all(target, ModelDrafter(noisy_copy), prompts, max_new_tokens=32)
    assert [r.accepted_per_call for r in narrow] == [r.accepted_per_call for r in chained]
    # EAGLE-2 dynamic trees: lossless, better than the chain, and the chain when they keep the top 1 per depth.
    from treadle.speculative.tree import DynamicTree

    dynamic = tree_run(target, ModelDrafter(noisy_copy), prompts, DynamicTree(3, GAMMA, 12), max_new_tokens=32)
    assert summarize(dynamic, GAMMA)["tau"] > chain
    narrow = tree_run(target, ModelDrafter(noisy_copy), prompts, DynamicTree(1, GAMMA, GAMMA), max_new_tokens=32)
    assert [r.accepted_per_call for r in narrow] == [r.accepted_per_call for r in chained]


def test_tree_falls_back_to_a_chain_for_drafters_without_trees(target, prompts):
    tree_run(target, PromptLookupDrafter(), prompts, TREE)
    tree_run(target, RandomDrafter(VOCAB, seed=0), prompts, TREE)
    with pytest.raises(ValueError, match="gamma == its depth"):
        speculative_generate(target, PromptLookupDrafter(), prompts[0], 3, 8, tree=TREE)


def test_tree_hands_feature_layers_the_accepted_path(target, prompts, noisy_copy):
    """Under --tree, a feature drafter still gets exactly the accepted positions' hidden states (the compacted path)."""

    class TreeFeatureSpy(FeatureSpy):
        def propose_tree(self, context_ids, state, branching, sampler):
            self.calls.append((context_ids.shape[1], state.start, state.hidden.clone()))
            return self.inner.propose_tree(context_ids, state, branching, sampler)

    spy = TreeFeatureSpy(ModelDrafter(noisy_copy))
    result = tree_run(target, spy, prompts[:1], TREE, max_new_tokens=32)[0]
    assert_hidden_rows_tile_the_sequence(spy.calls, target, prompts[0][0].tolist() + result.tokens)


def test_tau_by_position_and_expected_accepted_by_hand():
    # Calls of one sequence emit 3, 1, 5 tokens: they start at generated tokens 1, 4 and 5 (the prefill's token
    # is token 0); with buckets of 4 the first call is in bucket 0, the other two in bucket 1.
    from treadle.speculative.decode import tau_by_position

    r = SpecResult([0] * 10, 3, [2, 0, 4], 4, 1.0)
    assert tau_by_position([r], bucket=4) == [3.0, 3.0]
    other = SpecResult([0] * 4, 2, [0, 1], 4, 1.0)  # starts 1 and 2: both in bucket 0
    assert tau_by_position([r, other], bucket=4) == [pytest.approx((3 + 1 + 2) / 3), 3.0]
    s = summarize([r, other], 4)
    assert s["expected_accepted"] == pytest.approx(s["tau"] - 1)
    assert s["tau_by_position"] == [pytest.approx(s["tau"])]  # 64-token buckets: everything in the first


def test_spec_eval_acceptance_title_is_one_line(run_dir, capsys, monkeypatch):
    """Issue 48: rich wrapped the acceptance table's title to the table's width, mid-phrase ("(n =" / "drafts
    accepted in a call)"), whatever the terminal's width."""
    monkeypatch.setenv("COLUMNS", "200")
    assert spec_eval("--target", str(run_dir), "--draft", "prompt-lookup", "--num-prompts", "1", "--prompt-len", "16",
                     "--max-new-tokens", "4") == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert "acceptance per draft position k (n = drafts accepted in a call)" in lines, lines
