"""Draft runs and spec-eval emit no warning that treadle's own calls cause.

transformers' deprecation warnings carry ``stacklevel=2``, which points at torch's
``Module.__call__`` (the caller of the decorated ``forward``), not at treadle's line:
``filterwarnings("error", module="treadle")`` never matches them. So these tests record
every warning raised while treadle runs and allow none (a third-party warning that treadle
could not avoid would be listed here with its reason; there is none today).
"""

import contextlib
import json
import warnings

import pytest
import torch

from tests.helpers import SPEC_EVAL, draft_args
from treadle.cli import main

EAGLE = ("--draft.kind=eagle3", "--draft.vocab_size=200", "--draft.ttt_steps=2")
SHORT = ("--train.max_steps=2", "--draft.eval_prompts=1", "--draft.eval_new_tokens=6")


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not caught, "\n".join(f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}" for w in caught)


@pytest.mark.parametrize("kind", ["glide", "eagle3"])
def test_a_draft_step_and_spec_eval_warn_nothing(shards, target_dir, eagle3_target_dir, tmp_path, kind):
    """One optimizer step of each draft kind (its eval decodes with the target's KV cache), then spec-eval with it:
    greedy chain, sampled static tree, greedy and sampled dynamic tree."""
    target_dir = eagle3_target_dir if kind == "eagle3" else target_dir
    run = tmp_path / "run"
    extra = EAGLE if kind == "eagle3" else ()
    with no_warnings():
        assert main(draft_args(shards, target_dir, run, *SHORT, *extra)) == 0
    out = tmp_path / "spec.json"
    common = [*SPEC_EVAL, "--target", str(target_dir), "--draft", str(run), "--num-prompts", "1", "--prompt-len", "8",
              "--max-new-tokens", "8", "--json", str(out)]
    for flags in ([], ["--tree", "2,1", "--temperature", "1"], ["--tree", "dynamic:2,2,3"],
                  ["--tree", "dynamic:2,2,2", "--temperature", "1"]):
        with no_warnings():
            assert main([*common, *flags]) == 0, flags
        assert json.loads(out.read_text())["drafter"] == kind


def test_an_eagle3_step_under_bf16_autocast_has_no_dtype_mismatch(shards, eagle3_target_dir, tmp_path):
    """bf16 autocast over fp32 weights: the draft's norms see bf16 activations (fc's output) and fp32 weights, which
    torch's fused RMSNorm refuses with "Mismatch dtype ... Cannot dispatch to fused implementation"."""
    argv = [a for a in draft_args(shards, eagle3_target_dir, tmp_path / "run", *SHORT, *EAGLE)
            if a != "--model.dtype=fp32"]
    with no_warnings():
        assert main([*argv, "--model.dtype=bf16"]) == 0


def test_the_cache_goes_by_the_keyword_the_model_names():
    """transformers 5.24 renamed forward's past_key_values to cache (the old name warns); 5.23, in treadle's range,
    knows only past_key_values and would silently drop cache= (a fresh cache each call). Remote code may lag too."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from tests.helpers import TARGET
    from treadle.models.hf import cache_kwargs

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    cache = DynamicCache()
    assert cache_kwargs(Older(), cache) == {"past_key_values": cache}
    model = LlamaForCausalLM(LlamaConfig(**TARGET))
    with no_warnings():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 3


def test_a_lora_run_imports_no_bitsandbytes_and_its_stderr_is_clean(shards, tmp_path):
    """A LoRA run without 4-bit weights, in a fresh interpreter (an import warns once per process): bitsandbytes is
    never imported (PEFT imports it whenever installed; bitsandbytes 0.50 then warns on an AVX512-BF16 CPU that the
    optional `kernels` package is missing), and stderr holds neither that line nor transformers' FutureWarning
    about is_gradient_checkpointing (which PEFT reads)."""
    import subprocess
    import sys

    from tests.families import build_family
    from tests.helpers import args

    base = tmp_path / "base"
    build_family("llama", base, shards / "tok")
    argv = args(shards, tmp_path / "run", f"--model.path={base}", "--lora.rank=4", "--train.max_steps=2",
                "--model.activation_checkpointing=full")
    code = ("import sys; from treadle.cli import main; rc = main(sys.argv[1:]); "
            "print('bitsandbytes imported:', sys.modules.get('bitsandbytes') is not None); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bitsandbytes imported: False" in proc.stdout
    for line in ("gemm_4bit_forward", "kernels", "is_gradient_checkpointing", "FutureWarning"):
        assert line not in proc.stderr, proc.stderr[-3000:]
