"""Every target family trains: a tiny random model of each (tests/families.py), saved as a Hugging Face directory
with the test tokenizer, runs two steps of pretraining through ``treadle train --model.path``, with the plain loss
and with the chunked loss (model.loss_chunk_tokens), which must agree.

Gemma 2/3 soft-cap their logits and Granite scales them: the chunked head applies that inside each chunk, so the
chunked loss is still the model's own (the plain run's loss comes from the model's own logits). fp32: step 1 is
computed on the same weights, so the two agree to fp32's rounding; step 2 after one (equal up to rounding) update.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.families import FAMILIES, GLIDE_REFUSED, build_family
from tests.helpers import EXACT, KL_ATOL, SPEC_EVAL, records, save_target
from treadle.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 7  # divides neither the 64 tokens of a micro-batch nor the 512-token vocabulary


def family_args(shards, model_dir, out, *extra):
    return [
        "train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}",
        f"--model.path={model_dir}", "--data.seq_len=32", "--train.micro_batch_size=2", "--train.grad_accum_steps=1",
        "--train.log_every=1", "--train.eval_batches=1", "--train.max_steps=2", "--schedule.warmup_steps=1",
        *EXACT, *extra,
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_pretrains_with_the_plain_and_the_chunked_loss(family, shards, tmp_path):
    build_family(family, tmp_path / "model", shards / "tok")
    losses = {}
    for chunk in (0, CHUNK):
        out = tmp_path / f"run-{chunk}"
        # An explicit chunk size: a model the chunked loss cannot serve is refused (exit 2), not left unchunked.
        assert main(family_args(shards, tmp_path / "model", out, f"--model.loss_chunk_tokens={chunk}")) == 0, chunk
        losses[chunk] = records(out)
        assert sorted(losses[chunk]) == [1, 2] and all(math.isfinite(v) for v in losses[chunk].values()), losses
        assert (out / "hf" / "config.json").exists()
    plain, chunked = losses[0], losses[CHUNK]
    assert chunked[1] == pytest.approx(plain[1], rel=1e-6), (plain, chunked)
    assert chunked[2] == pytest.approx(plain[2], rel=1e-5), (plain, chunked)


def draft_family_args(shards, target, out, kind):
    """Two steps of a ``kind`` draft run, tiny (DRAFT_SHORT's acceptance settings, one eval batch)."""
    return [
        "train", f"--train.output_dir={out}", f"--data.train={shards / 'train'}", f"--data.val={shards / 'val'}",
        f"--draft.kind={kind}", f"--draft.target={target}", "--data.seq_len=32", "--train.micro_batch_size=2",
        "--train.grad_accum_steps=1", "--train.log_every=1", "--train.eval_batches=1", "--train.max_steps=2",
        "--schedule.warmup_steps=1", "--draft.eval_prompts=2", "--draft.eval_prompt_len=8",
        "--draft.eval_new_tokens=8", "--draft.max_position_offset=64", *EXACT,
    ]


def spec_eval_is_lossless(target, run, tmp_path, kind):
    out = tmp_path / f"spec-{kind}.json"
    assert main([*SPEC_EVAL, "--target", str(target), "--draft", str(run), "--num-prompts", "2", "--prompt-len", "8",
                 "--max-new-tokens", "8", "--threads", "1", "--json", str(out)]) == 0, kind
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == kind and 1.0 <= got["tau"], got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_drafts_eagle3_everywhere_and_glide_where_it_can_read_the_cache(family, shards, tmp_path, capsys):
    """Per family, a 4-layer target (EAGLE-3's three feature layers need 4): two steps of an EAGLE-3 draft and a
    lossless greedy spec-eval with it; GLIDE likewise, or (GLIDE_REFUSED) refused in one line that names the reason
    and EAGLE-3 as the alternative, exit 2, before anything is written."""
    target = tmp_path / "target"
    build_family(family, target, shards / "tok", layers=4)
    for kind in ("eagle3", "glide"):
        run = tmp_path / kind
        capsys.readouterr()
        rc = main(draft_family_args(shards, target, run, kind))
        err = capsys.readouterr().err
        if kind == "glide" and family in GLIDE_REFUSED:
            assert rc == 2 and not run.exists(), (rc, err)
            line = [x for x in err.splitlines() if "GLIDE cannot draft" in x]
            assert len(line) == 1 and GLIDE_REFUSED[family] in line[0] and "draft.kind = 'eagle3'" in line[0], err
            continue
        assert rc == 0, (kind, err)
        assert sorted(records(run)) == [1, 2] and all(math.isfinite(v) for v in records(run).values())
        spec_eval_is_lossless(target, run, tmp_path, kind)


# The block kinds, each small (block 4: three drafts per block) with its own head's keys.
BLOCK_KINDS = {"dflash": [], "dflash2": ["--draft.conv_group_size=8", "--draft.selector_rank=8",
                                         "--draft.selector_top_k=4"],
               "dspark": ["--draft.markov_rank=8"], "lilicorr": ["--draft.candidates=4"],
               "dspine": ["--draft.candidates=4"], "xpress": []}
DOC, ANCHOR, GAMMA = 12, 5, 3  # two 12-token documents per row, one block anchored at token 5 of each


def self_drafted_rows(model):
    """Two packed rows of two documents, each document's tokens after its block's anchor replaced by the draft's own
    guesses from that anchor (its tokens before it unchanged, so the block's are the same guesses), labels set at the
    anchor and its slots only. LiLiCorr's lattice terms are zero unless the data's tokens are among the slots'
    candidates: on random text of 512 tokens they are never there, on the draft's own walk they are."""
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 2 * DOC))
    labels = torch.full_like(ids, -100)
    for start in (0, DOC):
        guesses = model.chain_guesses(ids[:, start:start + DOC], GAMMA)  # step k's guess of token i + 1 at i
        for k in range(1, GAMMA + 1):
            ids[:, start + ANCHOR + k] = guesses[k - 1][:, ANCHOR + k - 1]
        span = slice(start + ANCHOR, start + ANCHOR + GAMMA)
        labels[:, span] = ids[:, span.start + 1:span.stop + 1]
    positions = torch.arange(DOC).repeat(2)[None].expand(2, -1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "order_position": torch.tensor([0, 1])}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_and_decodes_every_block_draft(family, shards, tmp_path):
    """Per family (4 layers, float64; MoE experts run eagerly: the grouped matmul has no float64 kernel), each block
    kind's draft built by its kind against the family's target: one training forward and backward of its own
    objective on packed rows gives a finite loss, a gradient in every part of the draft (LiLiCorr's correlator and
    backbone, DSpark's Markov and confidence heads, DFlash2's selector) and none in the target, and greedy
    speculative decoding with its drafter is the target's own continuation. The block kinds read hidden states
    through their own rotary and score through the target's head with its logit transform: no family is refused."""
    from treadle.config import load_config
    from treadle.drafts.registry import kind as draft_kind
    from treadle.speculative.decode import speculative_generate, target_generate

    target_dir = tmp_path / "target"
    build_family(family, target_dir, shards / "tok", layers=4)
    for name, extra in BLOCK_KINDS.items():
        cfg = load_config(None, ["--data.train=x", f"--draft.kind={name}", f"--draft.target={target_dir}",
                                 "--draft.block_size=4", "--draft.num_layers=1", f"--draft.gamma={GAMMA}",
                                 f"--draft.anchors={2 * GAMMA}", f"--data.seq_len={2 * DOC}", *extra])
        kind = draft_kind(name)
        model = kind.build(cfg.draft, 512, None)[0]
        model.target.set_experts_implementation("eager")
        model = model.double().eval()
        objective = kind.setup(cfg, model, None)
        batch = self_drafted_rows(model)
        loss, side = objective(model.train(), batch)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and loss.sum() > 0, (name, loss)
        silent = [n for n, part in model.draft_model.named_children()
                  if not any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())]
        assert not silent, (name, silent, side)
        assert all(p.grad is None for p in model.target.parameters()), name
        prompt = torch.randint(0, 512, (1, 6))
        want, _ = target_generate(model.target, prompt, 8)
        got = speculative_generate(model.target, kind.drafter(model.eval()), prompt, gamma=GAMMA, max_new_tokens=8)
        assert got.tokens == want, name


def test_glide_decides_from_the_config_not_the_family_name():
    """The same family is refused or drafted by what its config says: a sliding window shorter than the context (or
    a sliding last layer) keeps no cache of every position; a full-attention last layer or an unlimited window does."""
    import transformers

    from treadle.drafts.targets import glide_obstacle

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512)
    assert "sliding window" in glide_obstacle(transformers.MistralConfig(sliding_window=64, **small))
    assert glide_obstacle(transformers.MistralConfig(sliding_window=None, **small)) is None
    assert glide_obstacle(transformers.MistralConfig(sliding_window=512, **small)) is None  # the whole context
    sliding_last = transformers.Qwen3Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                                            sliding_window=16, use_sliding_window=True, **small)
    assert "'sliding_attention' layer" in glide_obstacle(sliding_last)
    full_last = transformers.Qwen3Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                         sliding_window=16, use_sliding_window=True, **small)
    assert glide_obstacle(full_last) is None
    # SmolLM3 without its no-RoPE layers is a Llama for GLIDE.
    assert glide_obstacle(transformers.SmolLM3Config(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 1], **small)) is None


def test_a_target_no_draft_kind_can_read_is_refused_for_every_kind_that_reads_it(shards, tmp_path, capsys):
    """GPT-2 (learned positions, no rotary embedding, no model.layers): refused in one line for GLIDE, EAGLE-3 and
    every block kind."""
    import transformers
    from transformers import AutoModelForCausalLM

    target = tmp_path / "gpt2"
    config = transformers.GPT2Config(vocab_size=512, n_embd=32, n_layer=4, n_head=4, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    save_target(AutoModelForCausalLM.from_config(config), shards, target)
    for kind in ("eagle3", "glide", *BLOCK_KINDS):
        capsys.readouterr()
        assert main(draft_family_args(shards, target, tmp_path / kind, kind)) == 2, kind
        err = capsys.readouterr().err
        assert "no draft kind can read" in err and "rotary" in err and not (tmp_path / kind).exists(), err


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "granite", "gpt_oss"])
def test_eagle3_reads_the_embedding_and_teacher_the_target_computes(family, shards, tmp_path):
    """Gemma scales its embedding by sqrt(d) inside the embedding module, Granite multiplies it in the model's
    forward: either way the draft's first norm sees what the target's first layer does (RMSNorm ignores the scale, up to its eps).
    The teacher is the target's own distribution: Gemma's soft-capped, Granite's scaled logits, and causal also
    where the target's attention is eager (Gemma 2, gpt-oss), which adds a 4-D mask to its scores."""
    import torch
    from transformers import AutoModelForCausalLM

    from treadle.drafts.eagle3.model import Eagle3Draft, Eagle3Model

    config = build_family(family, tmp_path / "t", shards / "tok", layers=4)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).eval()
    model = Eagle3Model(target, Eagle3Draft(target.config, (1, 2, 3)))
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        norm = model.draft_model.embed_norm
        embeds = target.get_input_embeddings()(ids)
        torch.testing.assert_close(norm(embeds), norm(out.hidden_states[0]), rtol=1e-2, atol=1e-2)  # up to eps
        got = model(ids, torch.arange(12)[None]).target_logits
    torch.testing.assert_close(got, out.logits)
    raw = target.lm_head(out.hidden_states[-1])
    if family == "granite":
        torch.testing.assert_close(got, raw / config.logits_scaling)
    elif family != "gpt_oss":
        cap = config.final_logit_softcapping
        torch.testing.assert_close(got, torch.tanh(raw / cap) * cap)


def test_glide_chunked_loss_scores_a_transformed_teacher_as_the_plain_loss(shards, tmp_path):
    """Granite scales its logits: GLIDE's and EAGLE-3's chunked scores apply the scale inside each chunk (to the
    teacher's logits, and GLIDE's draft's through the shared head), so a chunked draft run's losses are the plain
    run's (tests/test_glide_targets.py compares the per-token scores and gradients in fp64, for Gemma 2's soft-cap
    too)."""
    build_family("granite", tmp_path / "t", shards / "tok", layers=4)
    for kind, steps in (("glide", "--draft.ttt_steps=1"), ("eagle3", "--draft.ttt_steps=2")):
        losses = {}
        for chunk in (0, CHUNK):
            out = tmp_path / f"{kind}-{chunk}"
            assert main([*draft_family_args(shards, tmp_path / "t", out, kind), steps,
                         f"--model.loss_chunk_tokens={chunk}"]) == 0, (kind, chunk)
            losses[chunk] = records(out)
        # The KL of a draft near its (scaled, nearly flat) teacher is tiny: fp32 bounds its error absolutely (KL_ATOL).
        assert losses[CHUNK][1] == pytest.approx(losses[0][1], rel=1e-6, abs=KL_ATOL), (kind, losses)
        assert losses[CHUNK][2] == pytest.approx(losses[0][2], rel=1e-5, abs=KL_ATOL), (kind, losses)
