"""Meta-device init and sharded loading (models/sharded_load.py, engine.builds_empty and build_engine).

A model from disk built empty and filled after sharding must hold exactly what ``from_pretrained`` gives (bf16
files into fp32 weights, tied and untied heads, RoPE buffers recomputed); each FSDP2 rank must hold only its shard;
ZeRO-3 must build it partitioned. Files that cannot be read part by part are loaded whole, with a line saying why.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.distributed import run_distributed
from tests.helpers import TARGET, args, records
from treadle.cli import main
from treadle.config import load_config
from treadle.models.hf import load_causal_lm
from treadle.models.sharded_load import WEIGHTS_FROM, empty_causal_lm, is_empty, materialize

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _save(root, tied: bool, dtype=torch.bfloat16, **kw):
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**(TARGET | {"tie_word_embeddings": tied})))
    model.to(dtype).save_pretrained(root, **kw)
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_load")
    # Untied in bf16, split over several files (a real checkpoint's layout); tied in fp32.
    return {"untied": _save(root / "untied", False, max_shard_size="40KB"), "tied": _save(root / "tied", True, torch.float32)}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_an_empty_model_filled_from_its_files_equals_from_pretrained(saved, kind):
    path = saved[kind]
    assert kind == "tied" or len(list(path.glob("*.safetensors"))) > 1
    want = load_causal_lm(path, "model.path")
    model, why = empty_causal_lm(path, "model.path")
    assert why is None and is_empty(model) and getattr(model, WEIGHTS_FROM) == path
    assert all(p.is_meta for p in model.parameters())
    materialize(model, torch.device("cpu"))
    assert not is_empty(model) and not hasattr(model, WEIGHTS_FROM)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (kind == "tied")
    full = dict(want.named_parameters()) | dict(want.named_buffers())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.dtype == torch.float32 and torch.equal(t, full[name]), name  # inv_freq recomputed too
    ids = torch.randint(0, TARGET["vocab_size"], (2, 12))
    assert torch.equal(_logits(model, ids), _logits(want, ids))


def test_files_that_cannot_be_read_by_parts_are_loaded_whole_with_a_line_saying_why(tmp_path, capsys):
    path = _save(tmp_path / "bin", False, torch.float32)
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    torch.save(load_file(file), path / "pytorch_model.bin")  # the older layout: whole-file pickles
    file.unlink()
    model = load_causal_lm(path, "model.path", empty=True)
    assert not is_empty(model)
    assert f"model.path {path} is loaded whole on every rank: it has no *.safetensors files" in capsys.readouterr().err
    # Files that name other tensors than the model has (another layout) are refused by part too.
    path = _save(tmp_path / "renamed", False, torch.float32)
    file = path / "model.safetensors"
    save_file({k.replace("model.layers.", "model.blocks."): v for k, v in load_file(file).items()}, file, {"format": "pt"})
    model, why = empty_causal_lm(path, "model.path")
    assert model is None and "do not name" in why and "model.layers." in why


def _path_args(shards, out, saved, *extra):
    """A small run of the saved untied model (its own architecture: no overrides)."""
    return [a for a in args(shards, out) if not a.startswith("--model.overrides")] + [
        "--train.max_steps=2", f"--model.path={saved['untied']}", *extra]


def _sharded(rank, world_size, saved, shards, out):
    from treadle.engine import build_engine, builds_empty
    from treadle.engine.fsdp2 import FSDP2Engine
    from treadle.models.hf import build_model
    from treadle.train.run import run_training

    got = {}
    device = torch.device("cpu")
    opt = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)  # noqa: E731
    # FSDP2: built empty (what run.py asks for under fsdp2), each rank allocates and reads only its shard.
    cfg = load_config(None, [f"--model.path={saved['untied']}", "--distributed.engine=fsdp2"])
    model = build_model(cfg.model, TARGET["vocab_size"], empty=builds_empty("fsdp2", cfg, world_size))
    got["empty"] = is_empty(model)
    engine = FSDP2Engine(model, opt, device)
    local = sum(p.to_local().numel() for p in engine.module.parameters())
    got["fsdp2"] = (local, sum(p.numel() for p in engine.module.parameters()), engine.export_state_dict())
    # ZeRO-3: built empty, then read and partitioned module by module (rank 0 reads, the partitions broadcast).
    cfg = load_config(None, [f"--model.path={saved['tied']}", "--distributed.engine=deepspeed",
                             "--distributed.zero_stage=3", "--train.micro_batch_size=1", "--train.grad_accum_steps=1"])
    assert builds_empty("deepspeed", cfg, world_size)
    model = build_model(cfg.model, TARGET["vocab_size"], empty=True)
    engine = build_engine("deepspeed", model, cfg, device)
    got["zero3_partitioned"] = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    got["zero3_tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    got["zero3"] = engine.export_state_dict()
    got["zero3_buffers"] = {k: b.clone() for k, b in model.named_buffers()}  # inv_freq computed, not left empty
    # A whole run from model.path under fsdp2: the same losses as one process (compared by the test).
    run_training(load_config(None, _path_args(shards, out, saved, "--train.threads=1", "--distributed.engine=fsdp2")[1:]))
    return got


def test_fsdp2_ranks_read_their_shards_and_zero3_builds_partitioned(saved, shards, tmp_path):
    res = run_distributed(_sharded, world_size=2, timeout=240, saved=saved, shards=shards, out=tmp_path / "two")
    assert all(r["empty"] for r in res)
    local, total = res[0]["fsdp2"][0], res[0]["fsdp2"][1]
    assert local + res[1]["fsdp2"][0] == total and abs(local - total / 2) < total * 0.05  # about half each
    for kind, got in (("untied", res[0]["fsdp2"][2]), ("tied", res[0]["zero3"])):
        want = load_causal_lm(saved[kind], "model.path").state_dict()
        assert set(got) <= set(want) and len(got) >= len(want) - 1, kind  # a tied head may be exported once
        assert all(torch.equal(got[k], want[k]) for k in got), kind
    assert all(r["zero3_partitioned"] and r["zero3_tied"] for r in res)
    want = dict(load_causal_lm(saved["tied"], "model.path").named_buffers())
    assert all(torch.equal(b, want[k]) for r in res for k, b in r["zero3_buffers"].items())
    one = tmp_path / "one"
    assert main(_path_args(shards, one, saved, "--train.grad_accum_steps=4")) == 0  # the same global batch
    a, b = records(one), records(tmp_path / "two")
    assert a.keys() == b.keys() and all(math.isclose(a[s], b[s], rel_tol=1e-5) for s in a), (a, b)
