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
