"""bench/scaling.py --layouts: the collective volume per step per rank computed from a model's shapes
(``comm_volume``), checked against numbers worked out by hand for a toy Llama.

The bench itself (torchrun launches of a 200M-parameter model) is far too slow for the suite; the collectives it
measured agreed with this function byte for byte on all-gathers, reduce-scatters and sends (docs/benchmarks.md).
Here the arithmetic is pinned down.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "scaling.py"
_spec = importlib.util.spec_from_file_location("bench_scaling", SCRIPT)
scaling = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = scaling  # dataclasses looks its module up while the script is being executed
_spec.loader.exec_module(scaling)

# hidden 8, MLP 16, 2 layers, 2 query heads and 1 key/value head of 4, vocabulary 32, untied.
# One layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 + gate, up, down 3*8*16 = 576 matmul weights, + 2 norms of 8 = 592.
# Root: embedding 32*8 + head 32*8 + final norm 8 = 520. Whole model: 2*592 + 520 = 1704 parameters.
TOY = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=32, tie_word_embeddings=False)
STEP = dict(seq_len=4, micro_batch=1, grad_accum=2)  # one activation [1, 4, 8] = 32 values, 4 tokens
F32 = 4


def volume(name, model=TOY, **kw):
    v = scaling.comm_volume(model, scaling.LAYOUTS[name], **STEP, **kw)
    return {k: x / F32 for k, x in v.items() if x}  # in fp32 values, the zero kinds left out


def test_fsdp_gathers_every_unit_twice_per_micro_batch_and_reduce_scatters_once():
    # 2 micro-batches x (forward + backward re-gather) x 1704; one reduce-scatter of 1704; each sends half.
    assert volume("fsdp2-ws2") == {"all_gather": 6816, "reduce_scatter": 1704, "sent": (6816 + 1704) / 2}
    # Without resharding after forward, backward reuses forward's gather.
    assert volume("fsdp2-ws2", reshard_after_forward=False)["all_gather"] == 2 * 1704
    # Four shards: the same sizes, each rank sends 3/4 of them.
    assert volume("fsdp2-ws4")["sent"] == (6816 + 1704) * 3 / 4
    # Tied: the head is the embedding, the root is 256 + 8.
    assert volume("fsdp2-ws2", model={**TOY, "tie_word_embeddings": True})["reduce_scatter"] == 2 * 592 + 264


def test_tensor_parallel_moves_activations_not_weights():
    # Per micro-batch: 4 exchanges per layer x 2 layers + the embedding's + the head's = 10 [1, 4, 8] tensors,
    # gathered and as many reduce-scattered; 2 micro-batches. All-reduce: the 5 norms' gradients (8 each) once,
    # and the loss's 3 x 4 tokens per micro-batch.
    assert volume("tp2") == {"all_gather": 640, "reduce_scatter": 640, "all_reduce": 40 + 24,
                             "sent": 640 / 2 * 2 + 64 / 2 * 2}


def test_fsdp_over_tensor_parallel_gathers_the_tp_local_shares():
    # A TP rank holds 576 / 2 + 16 = 304 per layer and 128 + 128 + 8 = 264 of the root: 872 parameters.
    fsdp_ag, fsdp_rs = 2 * 872 * 2, 872
    assert volume("fsdp2xtp2") == {"all_gather": fsdp_ag + 640, "reduce_scatter": fsdp_rs + 640, "all_reduce": 64,
                                   "sent": (fsdp_ag + fsdp_rs) / 2 + 640 + 64}


def test_hsdp_adds_one_all_reduce_of_the_shard_across_replicas():
    assert volume("hsdp2x2") == {"all_gather": 6816, "reduce_scatter": 1704, "all_reduce": 852,
                                 "sent": (6816 + 1704) / 2 + 852}


def test_pipeline_stages_send_the_boundary_activations_and_shard_only_their_layers():
    # The busiest stage: 1 layer (592) + head and final norm (264; the other end holds the embedding, 256).
    # Each micro-batch sends one [1, 4, 8] activation (forward) or its gradient (backward): 2 x 32.
    assert volume("pp2xfsdp2") == {"all_gather": 2 * 856 * 2, "reduce_scatter": 856, "send_recv": 64,
                                   "sent": (2 * 856 * 2 + 856) / 2 + 64}
    assert volume("pp2xdp2") == {"all_reduce": 856, "send_recv": 64, "sent": 856 + 64}


@pytest.mark.parametrize("name", list(scaling.LAYOUTS))
def test_every_layout_asks_for_the_world_size_its_axes_make(name):
    layout = scaling.LAYOUTS[name]
    shard = next(f for f in layout.flags if f.startswith("--distributed.data_parallel_shard="))
    assert shard.endswith(f"={layout.dp_shard}") or shard.endswith("=-1")
    assert layout.world_size in (2, 4)
