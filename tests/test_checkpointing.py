"""Activation checkpointing (model.activation_checkpointing): exact, really recomputing, and invisible to checkpoints.

Exactness is checked on a 4-layer Llama in fp32 (loss and every gradient against no checkpointing), and that the
layers really are recomputed by counting the aten ops that run in forward + backward: a checkpointed layer runs its
activation (silu) twice; selective keeps the matmuls' outputs, so no matmul runs a second time.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TARGET, activation_checkpointing_on, args, draft_args, records
from treadle.cli import main
from treadle.config import ModelConfig
from treadle.models.checkpointing import apply_activation_checkpointing
from treadle.drafts.glide.model import GlideDraft, GlideModel

LAYERS = 4
LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
MATMULS = {"mm", "addmm", "bmm"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 24), generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)  # two packed documents per row
    return ids, pos


def loss_and_grads(mode: str = "none", every: int = 1, ops: list[str] | None = None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), dtype=torch.float32).train()
    apply_activation_checkpointing(model, ModelConfig(activation_checkpointing=mode, activation_checkpointing_every=every,
                                                      activation_checkpointing_save_ops=ops or []))
    ids, pos = batch()
    with OpCounter() as counter:
        loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    return loss.item(), grads, counter.counts, flags


@pytest.fixture(scope="module")
def plain():
    return loss_and_grads()


@pytest.mark.parametrize("mode,every,ops,checkpointed", [
    ("full", 1, None, [True] * 4),
    ("full", 2, None, [True, False, True, False]),
    ("selective", 1, None, [True] * 4),
    ("selective", 3, ["addmm", "aten.mm"], [True, False, False, True]),
])
def test_checkpointing_gives_the_same_loss_and_grads_and_recomputes(plain, mode, every, ops, checkpointed):
    loss0, grads0, counts0, flags0 = plain
    loss, grads, counts, flags = loss_and_grads(mode, every, ops)
    assert flags0 == [False] * LAYERS and flags == checkpointed
    assert loss == pytest.approx(loss0, rel=1e-6)
    assert grads.keys() == grads0.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, grads0[name], rtol=1e-5, atol=1e-7, msg=name)
    # Each checkpointed layer runs its MLP activation again in backward.
    assert counts0["silu"] == LAYERS and counts["silu"] == LAYERS + sum(checkpointed)
    matmuls0, matmuls = sum(counts0[o] for o in MATMULS), sum(counts[o] for o in MATMULS)
    if mode == "selective":  # the matmuls' outputs were kept, not recomputed
        assert matmuls == matmuls0
    else:  # 6 of the 7 projections run again (torch stops recomputing once backward has what it needs:
        assert matmuls == matmuls0 + 6 * sum(checkpointed)  # nothing saved needs down_proj's output)


def test_selective_keeps_the_cpu_attention_output_and_a_custom_list_can_leave_it_out(plain):
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert plain[2][sdpa] == LAYERS  # the op CPU sdpa really runs (absent from torch's compute-intensive list)
    assert loss_and_grads("selective")[2][sdpa] == LAYERS
    assert loss_and_grads("selective", ops=["mm"])[2][sdpa] == 2 * LAYERS


def test_glide_draft_checkpointing_is_exact_and_leaves_the_target_alone():
    def run(mode):
        torch.manual_seed(1)
        target = AutoModelForCausalLM.from_config(LlamaConfig(**TARGET))
        model = GlideModel(target, GlideDraft(target.config)).train()
        apply_activation_checkpointing(model.draft_model, ModelConfig(activation_checkpointing=mode))
        ids = torch.randint(0, TARGET["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(16).expand(2, -1)
        with OpCounter() as counter:
            out = model(ids, pos, lag=2)
            out.logits.float().log_softmax(-1).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return grads, counter.counts, activation_checkpointing_on(model.target)

    grads0, counts0, _ = run("none")
    grads, counts, target_checkpointed = run("full")
    assert not target_checkpointed
    assert grads.keys() == grads0.keys() and all(k.startswith("draft_model.") for k in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads0[name], rtol=1e-5, atol=1e-7, msg=name)
    assert counts["silu"] == counts0["silu"] + 1  # the draft block ran again; the target's layers did not


def built(argv):
    """The trainer `treadle train ARGV` would fit: assembled (the run's own wiring), not trained, closed again."""
    from treadle.config import load_config
    from treadle.train.run import build_trainer, close_trainer

    trainer = build_trainer(load_config(None, argv[1:]))
    close_trainer(trainer)
    return trainer


def test_a_checkpoint_written_with_checkpointing_resumes_without_it(shards, tmp_path):
    """Same keys, same numbers: a run with selective checkpointing logs the losses of one without, and its step-2
    checkpoint resumed without checkpointing continues with them too (config compat lets the key change)."""
    plain_run, ac_run, resumed = tmp_path / "plain", tmp_path / "ac", tmp_path / "resumed"
    common = ["--train.max_steps=4", "--train.eval_every=0", "--checkpoint.export_hf=false"]
    assert main(args(shards, plain_run, *common)) == 0
    assert main(args(shards, ac_run, *common, "--checkpoint.every=2", "--model.activation_checkpointing=selective")) == 0
    assert main(args(shards, resumed, *common, f"--checkpoint.resume={ac_run / 'checkpoints' / 'step_2'}")) == 0
    want = records(plain_run)
    assert records(ac_run) == pytest.approx(want, rel=1e-6)
    rest = records(resumed)
    assert [rest[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-6)
    # Equal numbers would also come from a run that never checkpointed: the run's model really is.
    probe = built(args(shards, tmp_path / "probe", *common, "--model.activation_checkpointing=selective"))
    assert activation_checkpointing_on(probe.engine.module)


def test_a_draft_run_with_checkpointing_trains_like_one_without(shards, target_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=2", "--train.eval_every=0")) == 0
    assert main(draft_args(shards, target_dir, b, "--train.max_steps=2", "--train.eval_every=0",
                           "--model.activation_checkpointing=full")) == 0
    assert records(a) == pytest.approx(records(b), rel=1e-6)
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    probe = built(draft_args(shards, target_dir, tmp_path / "probe", "--model.activation_checkpointing=full"))
    assert probe.engine.module.draft_model.checkpoint_kwargs is not None  # the run's draft block is checkpointed
    assert not activation_checkpointing_on(probe.engine.module.target)
