"""model.attention: packed documents attended without a dense mask equal the dense mask's attention.

In float64 on CPU, for every target family: the logits and every parameter's gradient of the ``varlen`` path (sdpa per
document) equal transformers' dense-mask sdpa on packed rows of many short documents and of a document longer than
the sliding window (Gemma 3's layers: window 16); FlexAttention's forward (CPU has no flex backward) too. A model
switched to either still generates as before (a cached, left-padded batch gets sdpa's mask).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from tests.families import COMMON, FAMILIES
from tests.helpers import SMALL_MODEL, args, records
from treadle.cli import main
from treadle.errors import UserError
from treadle.models import attention

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

# Three rows of 48 tokens: a window's continuation (positions from 9) then documents of 1 to 3 tokens; one document
# (longer than Gemma 3's / gpt-oss's window of 16); a 40-token document among short ones.
DOCS = ([(9, 6), (0, 1), (0, 2), (0, 3), (0, 1), (0, 1), (0, 20), (0, 2), (0, 3), (0, 1), (0, 8)],
        [(0, 48)],
        [(0, 2), (0, 40), (0, 1), (0, 5)])


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(start, start + n) for start, n in row]) for row in DOCS])


def family_model(name: str) -> nn.Module:
    cls, extra = FAMILIES[name]
    config = getattr(transformers, cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager").double()


def run(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, grad: bool):
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    if not grad:
        return logits, None
    (logits.square().mean() + logits[..., :7].sum()).backward()  # any scalar that reaches every position
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_document_attention_equals_the_dense_mask_for_every_family(family):
    dense = family_model(family)
    positions = packed_positions()
    ids = torch.randint(0, COMMON["vocab_size"], positions.shape, generator=torch.Generator().manual_seed(1))
    why = attention.obstacle(dense.config)
    if why is not None:  # soft-capped scores (Gemma 2), sinks (gpt-oss): sdpa per document cannot compute them
        with pytest.raises(UserError, match="model.attention = 'varlen' cannot run this model"):
            attention.resolve("varlen", dense.config, torch.device("cpu"), 2048)
        assert attention.resolve("auto", dense.config, torch.device("cuda"), 32768)[0] == "dense"
        return
    want, want_grads = run(dense, ids, positions, grad=True)
    varlen = copy.deepcopy(dense)
    attention.use(varlen, "varlen")
    got, got_grads = run(varlen, ids, positions, grad=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")
    flex = copy.deepcopy(dense)
    attention.use(flex, "flex")
    torch.testing.assert_close(run(flex, ids, positions, grad=False)[0], want, rtol=0, atol=1e-12)


def test_documents_start_where_positions_do_not_grow(monkeypatch):
    # A draft run's anchor offsets jump forward inside a document (7 -> 12); a restart, or a repeat, starts one.
    positions = torch.tensor([[3, 4, 5, 0, 1, 7, 12, 13, 0, 0, 1]])
    docs = attention.Documents.of(positions)
    assert docs.spans == (((0, 3), (3, 8), (8, 9), (9, 11)),)
    assert docs.ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3]]
    cu, longest = attention.Documents.of(torch.stack([positions[0], torch.arange(11)])).cumulative
    assert cu.tolist() == [0, 3, 8, 9, 11, 22] and longest == 11
    # Found once per forward: every layer is handed the same position tensor.
    found = []
    monkeypatch.setattr(attention.Documents, "of", lambda p, of=attention.Documents.of: found.append(p) or of(p))
    model = family_model("llama")
    attention.use(model, "varlen")
    model(input_ids=torch.zeros_like(positions), position_ids=positions, use_cache=False)
    assert len(found) == 1 and model.config.num_hidden_layers > 1


def test_a_switched_model_still_generates_a_padded_batch_as_before():
    dense = family_model("llama").eval()
    prompts = torch.randint(1, COMMON["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0  # left padding: the second prompt is 5 tokens
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    want = dense.generate(prompts, **kwargs)
    for choice in ("varlen", "flex"):
        model = copy.deepcopy(dense)
        attention.use(model, choice)
        assert torch.equal(model.generate(prompts, **kwargs), want), choice


def test_auto_keeps_the_dense_mask_where_it_is_fastest_or_the_only_way():
    config = family_model("llama").config
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object: no GPU is needed to decide
    assert attention.resolve("auto", config, cpu, attention.CPU_DENSE_UP_TO)[0] == "dense"
    assert attention.resolve("auto", config, cpu, attention.CPU_DENSE_UP_TO + 1)[0] == "varlen"
    assert attention.resolve("auto", config, cuda, 256)[0] == "dense"  # measured faster at 2k on an H200
    assert attention.resolve("auto", config, cuda, 2048)[0] == "dense"  # the Trainer's speed at 2k (fourth GPU run)
    assert attention.resolve("auto", config, cuda, attention.CUDA_FLEX_FROM - 1)[0] == "dense"
    assert attention.resolve("auto", config, cuda, attention.CUDA_FLEX_FROM)[0] == "flex"  # 1.26x dense at 8k
    assert attention.resolve("auto", config, cuda, 32768)[0] == "flex"  # varlen measured 0.21x dense: never on CUDA
    choice, why = attention.resolve("auto", config, cuda, 4096, context_parallel=2)
    assert choice == "dense" and "context parallelism" in why
    with pytest.raises(UserError, match="'flex' needs CUDA"):
        attention.resolve("flex", config, cpu, 4096)


def test_a_run_says_what_auto_chose_and_trains_the_same_loss(shards, tmp_path, capsys):
    # Rows of 2100 tokens on CPU: auto takes varlen; the dense run of the same steps has the same losses (fp32).
    common = ("--data.seq_len=2100", "--train.micro_batch_size=1", "--train.grad_accum_steps=1", "--train.max_steps=2",
              "--train.log_every=1", "--train.eval_every=0", "--checkpoint.every=0", "--checkpoint.export_hf=false",
              f"--model.overrides={SMALL_MODEL}", "--model.compile=false", "--model.dtype=fp32")
    assert main(args(shards, tmp_path / "auto", *common)) == 0
    assert "model.attention = auto -> varlen: rows of 2100 tokens on CPU" in capsys.readouterr().out
    assert main(args(shards, tmp_path / "dense", *common, "--model.attention=dense")) == 0
    assert "model.attention" not in capsys.readouterr().out
    auto, dense = records(tmp_path / "auto"), records(tmp_path / "dense")
    assert auto.keys() == dense.keys() == {1, 2}
    for step in auto:
        assert auto[step] == pytest.approx(dense[step], rel=1e-5), (auto, dense)
    assert main(args(shards, tmp_path / "flex", *common, "--model.attention=flex")) == 2
    assert "model.attention = 'flex' needs CUDA" in capsys.readouterr().err
