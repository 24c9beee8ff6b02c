"""Helpers for tests that run small real trainings (the data comes from the `shards` fixture)."""

import json
import math

# Runs that compare losses or tensors exactly pin fp32 (the default, auto, may pick bf16 on a machine where it is
# faster); a test that passes its own --model.dtype overrides it.
EXACT = ("--model.dtype=fp32",)

SMALL_MODEL = "{hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2}"


def args(shards, out, *extra):
    return [
        "train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}",
        f"--model.overrides={SMALL_MODEL}", "--data.seq_len=32", "--train.micro_batch_size=4",
        "--train.grad_accum_steps=2", "--train.log_every=1", "--train.eval_batches=2", "--schedule.warmup_steps=1",
        "--optim.lr=5e-3", *EXACT, *extra,
    ]


# The draft runs' target: a small random Llama over the test tokenizer's 512 tokens.
TARGET = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, use_cache=False)


# A KL is a difference of log-probabilities as large as ln(vocab): fp32 leaves an absolute error of about
# eps * ln(vocab) in it however small the KL itself is (~1e-3 in these runs), and CPUs' kernels round differently.
# Compare a KL (and a loss that is one) with this absolute bound beside the relative one.
KL_ATOL = 2.0 ** -23 * math.log(TARGET["vocab_size"])


def draft_args(shards, target_dir, out, *extra):
    return [
        "train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}",
        "--draft.kind=glide", f"--draft.target={target_dir}", "--data.seq_len=32", "--train.micro_batch_size=4",
        "--train.grad_accum_steps=2", "--train.log_every=1", "--train.eval_batches=2", "--schedule.warmup_steps=1",
        "--optim.lr=5e-3", "--draft.eval_prompts=2", "--draft.eval_prompt_len=8", "--draft.eval_new_tokens=12",
        "--draft.max_position_offset=64", *EXACT, *extra,
    ]


MOE_MODEL = ("{hidden_size=32,moe_intermediate_size=32,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
             "head_dim=8}")


def moe_args(shards, out, *extra):
    """A small run of the tiny-moe preset (Qwen3-MoE, 8 experts, top-2) made smaller, both router losses on."""
    return [
        "train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}",
        "--model.preset=tiny-moe", f"--model.overrides={MOE_MODEL}", "--data.seq_len=32", "--train.micro_batch_size=2",
        "--train.grad_accum_steps=2", "--train.log_every=1", "--train.eval_batches=1",
        "--model.router_aux_loss_coef=0.01", "--model.router_z_loss_coef=0.001", *EXACT, *extra,
    ]


# spec-eval with one timed pass (its default, 3, times both phases three times for a speed spread): the tests that
# call it check tau, acceptance and losslessness, computed from the first pass alone; tests/test_spec_decode.py checks
# --repeats itself.
SPEC_EVAL = ("spec-eval", "--repeats", "1")


def records(run_dir, key="loss"):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in lines if key in r}




def mixture_args(shards, sft_file, out, *extra):
    """A run on two sources: the code shards (weight 3) and an SFT file (weight 1), which a phase at step 3 drops,
    halving the learning rate."""
    base = [a for a in args(shards, out) if not a.startswith("--data.train=")]
    return base + [
        f'--data.sources=[{{name="code",path="{shards / "train"}",weight=3}},{{name="sft",path="{sft_file}"}}]',
        "--data.phases=[{start_step=3,weights={sft=0},lr_scale=0.5}]", *extra,
    ]


def write_pairs(path, n=60):
    """A small prompt/completion SFT file."""
    path.write_text("".join(json.dumps({"prompt": f"# add {i} to x\n", "completion": f"x = x + {i}\n"}) + "\n"
                            for i in range(n)))
    return path


def save_target(model, shards, d):
    """``model`` saved as a Hugging Face directory ``d`` with the shards' tokenizer beside it: a target a draft run
    (or spec-eval) loads, its data tokenized alike."""
    from transformers import AutoTokenizer

    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(shards / "tok").save_pretrained(d)
    return d


def assert_chunked_unroll_equals_whole(plain, kind: str, loss: str) -> None:
    """A recurrent kind's model (mtp, frozen_kv; float64, train mode) scored chunk by chunk (loss_chunk_tokens = 5:
    16 rows a step, three whole chunks and a partial one) gives its whole-logits loss, side sums and draft gradients
    to 1e-10, on two rows: a masked prompt, and two packed documents."""
    import copy

    import torch

    from treadle.config import DraftConfig
    from treadle.data.packed import IGNORE_INDEX
    from treadle.drafts.recurrent import RecurrentObjective

    chunked = copy.deepcopy(plain)
    chunked.loss_chunk_tokens = 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 17), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX
    positions = torch.cat((torch.arange(16)[None], torch.cat((torch.arange(6), torch.arange(10)))[None]))
    batch = {"input_ids": ids[:, :-1], "labels": labels, "position_ids": positions}
    objective = RecurrentObjective(DraftConfig(kind=kind, loss=loss, kl_weight=0.3, ttt_steps=3), 64, 16)
    want, want_side = objective.losses(plain, batch, 0, 0, train=True)
    got, got_side = objective.losses(chunked, batch, 0, 0, train=True)
    assert got.dtype == torch.float64 and got_side.keys() == want_side.keys()
    assert torch.allclose(got, want, rtol=1e-10, atol=0)
    assert all(abs(got_side[k].item() - want_side[k].item()) <= 1e-10 * abs(want_side[k].item()) for k in want_side)
    want.sum().backward()
    got.sum().backward()
    for (name, p), q in zip(plain.draft_model.named_parameters(), chunked.draft_model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.allclose(q.grad, p.grad, rtol=1e-9, atol=1e-14), name


def record_accepted_rounds(monkeypatch, generator_cls) -> list[int]:
    """The accepted count of each verification round transformers' assisted ``generate`` runs with the candidate
    generator class ``generator_cls`` (filled as generate runs: its ``update_candidate_strategy`` observed)."""
    rounds: list[int] = []
    original = generator_cls.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        rounds.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    monkeypatch.setattr(generator_cls, "update_candidate_strategy", record)
    return rounds



def activation_checkpointing_on(model) -> bool:
    """Whether an HF model checkpoints its layers: ``is_activation_checkpointing`` from transformers 5.23, before
    it ``is_gradient_checkpointing`` (the oldest supported, 5.17)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name))


def assert_greedy_lossless(model, drafter_cls, gammas=(1, 3, 5), new_tokens: int = 24):
    """A block draft's greedy speculative decoding gives the target's own greedy continuation at each gamma (8 random
    prompt tokens of the test tokenizer's 512); returns the prompt and that continuation."""
    import torch

    from treadle.speculative.decode import speculative_generate, target_generate

    prompt = torch.randint(0, 512, (1, 8))
    want, _ = target_generate(model.target, prompt, new_tokens)
    for gamma in gammas:
        got = speculative_generate(model.target, drafter_cls(model), prompt, gamma=gamma, max_new_tokens=new_tokens)
        assert got.tokens == want, gamma
    return prompt, want


def block_draft_rounds(model, drafter, prompt_len: int = 6, new_tokens: int = 10, seed: int = 2):
    """A block draft's text and drafter, decode round by round: (text [1, L], positions, the target's features
    [1, L, n * d]), then a generator of (s, n): the drafter has absorbed the features of tokens < s and its next
    proposal's block is anchored at token s (the n-th anchor from prompt_len), as the decode loop hands them over."""
    import torch

    from treadle.drafts.targets import capture_features
    from treadle.models.hf import greedy_continuations
    from treadle.speculative.decode import TargetState

    torch.manual_seed(seed)
    text = greedy_continuations(model.target, torch.randint(0, 512, (1, prompt_len)), new_tokens)
    positions = torch.arange(text.shape[1])[None]
    with torch.no_grad(), capture_features(model.target, model.draft_model.feature_layers) as tap:
        model.target(input_ids=text, position_ids=positions)
        features = tap.take()

    def rounds():
        drafter.reset(text[:, :prompt_len])
        given = 0
        for s in range(prompt_len, text.shape[1]):
            with torch.no_grad():
                drafter._absorb(text[:, : s + 1], TargetState(None, features[:, given:s]))
            given = s
            yield s, s - prompt_len

    return (text, positions, features), rounds()


def assert_sampling_exact(target, drafter, gamma: int = 2):
    """tests/test_spec_sampling.py's chi-square test of speculative sampling with ``drafter`` against ``target``'s
    exact distribution (its seeded runs), and the total variation within twice the sampling noise."""
    import torch

    from tests.test_spec_sampling import (
        RUNS, chi_square, critical, exact_distribution, sampling_noise_tv, speculative_counts, total_variation,
    )
    from treadle.speculative.sampling import Sampler

    sampler = Sampler(1.0, 1.0, torch.Generator().manual_seed(0))
    dist = exact_distribution(target, sampler)
    counts = speculative_counts(target, drafter, sampler, RUNS, gamma=gamma)
    stat, dof = chi_square(counts, dist, RUNS)
    assert stat < critical(dof), (stat, dof)
    assert total_variation(counts, dist, RUNS) < 2 * sampling_noise_tv(dist, RUNS)


def chunked_and_whole(model, objective, batch, chunk: int = 7):
    """(loss, side sums, gradients of the draft's parameters) of ``objective`` on ``batch`` with the whole logits,
    after asserting model.loss_chunk_tokens = ``chunk`` gives the same (float64 model)."""
    import torch

    got = []
    for tokens in (0, chunk):
        model.loss_chunk_tokens = tokens
        model.zero_grad()
        loss, side = objective(model, batch)
        loss.sum().backward()
        got.append((loss.detach(), side, {n: p.grad.clone() for n, p in model.draft_model.named_parameters()
                                          if p.grad is not None}))
    model.loss_chunk_tokens = 0
    (l0, s0, g0), (l1, s1, g1) = got
    assert torch.allclose(l0, l1, rtol=1e-10) and s0.keys() == s1.keys()
    assert all(torch.allclose(s0[k].double(), s1[k].double(), rtol=1e-10) for k in s0), s0
    assert g0.keys() == g1.keys() and all(torch.allclose(g0[n], g1[n], rtol=1e-8, atol=1e-12) for n in g0)
    return got[0]


def assert_spec_eval_decodes(target_dir, draft_dir, drafter: str, out, gamma: int = 5):
    """``treadle spec-eval`` on a draft run or export: its ``drafter``, lossless greedy, and sampled at T = 1."""
    from treadle.cli import main

    for extra in ((), ("--temperature", "1")):
        assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(draft_dir), "--num-prompts", "2",
                     "--gamma", str(gamma), "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out),
                     *extra]) == 0
        got = json.loads(out.read_text())
        assert got["drafter"] == drafter and got["lossless"] is (None if extra else True), got
