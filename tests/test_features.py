"""Offline target features (drafts/features/): a draft run from a store equals the live-target run, a killed
`treadle features` resumes to the same files, and a store for another run, or a damaged one, is refused in one line."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import draft_args, records
from treadle import compat
from treadle.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small(shards, tmp_path_factory):
    """The shards' tokenizer over a few files: a store of the whole data stays small (about 200 train windows)."""
    from treadle import corpus
    from treadle.data.prepare import prepare

    root = tmp_path_factory.mktemp("small")
    files = [str(p) for _, p in corpus.corpus_files()[:40]]
    prepare(files[:2], root / "train", shards / "tok", workers=1)
    prepare(files[36:37], root / "val", shards / "tok", workers=1)
    return root


RUN = ("--train.max_steps=4", "--draft.max_position_offset=0", "--draft.loss=mix", "--train.eval_every=2",
       "--checkpoint.every=2")
# GLIDE scores draft and teacher chunk by chunk (the stored final hidden state through the head per chunk); EAGLE-3
# unrolls 3 steps on whole logits.
KINDS = {"glide": ("--model.loss_chunk_tokens=64",), "eagle3": ("--draft.kind=eagle3", "--draft.ttt_steps=3"),
         "dflash": ("--draft.kind=dflash", "--draft.block_size=6", "--draft.num_layers=2"),
         "dspark": ("--draft.kind=dspark", "--draft.block_size=5", "--draft.num_layers=2", "--draft.markov_rank=8"),
         "dflash2": ("--draft.kind=dflash2", "--draft.block_size=6", "--draft.num_layers=2", "--draft.selector_top_k=4",
                     "--draft.selector_rank=16"),
         "lilicorr": ("--draft.kind=lilicorr", "--draft.block_size=6", "--draft.num_layers=2", "--draft.candidates=4"),
         "dspine": ("--draft.kind=dspine", "--draft.block_size=6", "--draft.num_layers=2", "--draft.candidates=4"),
         "xpress": ("--draft.kind=xpress", "--draft.block_size=6", "--draft.num_layers=2")}


def features_args(shards, target, out, *extra):
    """`treadle features` with the run's own arguments (its output dir unused), writing the store ``out``."""
    return ["features", *draft_args(shards, target, out.parent / "unused")[1:], *RUN, f"--out={out}", *extra]


def close(a: dict, b: dict, rel=1e-5):
    """Per-step values equal within ``rel`` of their size (fp32: the store's teacher is the head applied to the
    stored final hidden state, the live run's the same head inside the target's forward)."""
    assert a.keys() == b.keys() and a
    for k in a:
        assert abs(a[k] - b[k]) <= rel * max(1.0, abs(a[k])), (k, a[k], b[k])


def same_weights(a, b, rel=1e-5):
    wa, wb = load_file(a / "draft" / "model.safetensors"), load_file(b / "draft" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        if wa[k].is_floating_point():
            assert torch.allclose(wa[k], wb[k], rtol=rel, atol=rel * wa[k].abs().max().item()), k
        else:
            assert torch.equal(wa[k], wb[k]), k


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_from_an_fp32_store_equals_the_live_run(small, target_dir, eagle3_target_dir, tmp_path, kind, capsys):
    target = target_dir if kind == "glide" else eagle3_target_dir  # EAGLE-3's and DFlash's: three distinct layers
    extra = KINDS[kind]
    store, live, stored = tmp_path / "store", tmp_path / "live", tmp_path / "stored"
    assert main(features_args(small, target, store, "--dtype=fp32", "--shard-samples=16", *extra)) == 0
    line = capsys.readouterr().out
    assert "treadle: features:" in line and " and 0 kept;" in line  # a new store: everything written now
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["complete"] and manifest["kind"] == kind and set(manifest["splits"]) == {"train", "val"}
    assert len(manifest["splits"]["train"]["shards"]) > 1  # several shards: the windows are read across files
    assert main(draft_args(small, target, live, *RUN, *extra)) == 0
    assert main(draft_args(small, target, stored, *RUN, *extra, f"--draft.features={store}")) == 0
    for key in ("loss", "grad_norm", "eval_loss", "tau_sim"):
        close(records(live, key), records(stored, key))
    same_weights(live, stored)
    # Bit-exact resume from the store: steps 3 and 4 again from step 2's checkpoint.
    again = tmp_path / "again"
    assert main(draft_args(small, target, again, *RUN, *extra, f"--draft.features={store}",
                           f"--checkpoint.resume={stored / 'checkpoints' / 'step_2'}")) == 0
    assert [records(again)[s] for s in (3, 4)] == [records(stored)[s] for s in (3, 4)]
    if kind == "eagle3":  # a store for another draft kind: one line naming the difference
        capsys.readouterr()
        assert main(draft_args(small, target, tmp_path / "glide", *RUN, f"--draft.features={store}")) == 2
        err = capsys.readouterr().err
        assert "draft.kind: the store's 'eagle3', this run's 'glide'" in err and len(err.strip().splitlines()) == 1


def _killed(argv: list[str], out) -> None:
    """``treadle features`` in a process of its own, SIGKILLed once it has written its first shard."""
    import os
    import signal
    import time

    from tests.preloaded import Forked

    proc = Forked(argv, {**os.environ, "OMP_NUM_THREADS": "1"})  # a process of its own, forked with treadle imported
    while proc.poll() is None and not list(out.glob("train-*.safetensors")):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_killed_features_resume_to_the_same_files_and_bad_stores_are_refused(small, target_dir, tmp_path, capsys):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(features_args(small, target_dir, whole, "--shard-samples=4")) == 0
    _killed(features_args(small, target_dir, cut, "--shard-samples=4"), cut)
    manifest = json.loads((cut / "manifest.json").read_text())
    assert not manifest["complete"]  # killed mid-way
    # What else a kill can leave: a shard torn mid-write, a temporary file, a shard never begun.
    assert main(features_args(small, target_dir, cut, "--shard-samples=4")) == 0
    (cut / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    torn = cut / "train-00001.safetensors"
    torn.write_bytes(torn.read_bytes()[:-100])
    (cut / ".train-00002.safetensors.tmp").write_bytes(b"partial")
    (cut / "val-00000.safetensors").unlink()
    capsys.readouterr()
    assert main(draft_args(small, target_dir, tmp_path / "r0", *RUN, f"--draft.features={cut}")) == 2
    assert "unfinished feature store" in capsys.readouterr().err
    assert main(features_args(small, target_dir, cut, "--shard-samples=4")) == 0
    kept = re.search(r"and ([\d,]+) kept;", capsys.readouterr().out)
    assert kept and int(kept.group(1).replace(",", "")) > 0  # the whole shards of the killed run were kept
    files = sorted(p.name for p in whole.iterdir())
    assert files == sorted(p.name for p in cut.iterdir())
    for name in files:
        assert (whole / name).read_bytes() == (cut / name).read_bytes(), name

    # Another target (its config differs), another draft shape, another dtype to continue with: one line each.
    other = tmp_path / "other_target"
    shutil.copytree(target_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    cases = [
        (draft_args(small, other, tmp_path / "r1", *RUN, f"--draft.features={whole}"), "target.config"),
        (draft_args(small, target_dir, tmp_path / "r3", *RUN, "--draft.eval_prompts=3", f"--draft.features={whole}"),
         "eval.prompts"),
        (features_args(small, target_dir, whole, "--shard-samples=4", "--dtype=fp8"), "dtype"),
        (draft_args(small, target_dir, tmp_path / "r4", *RUN, "--draft.max_position_offset=8",
                    f"--draft.features={whole}"), "draft.max_position_offset"),
    ]
    # Another data.seq_len cuts other windows: the refusal names the setting and both values, not the data's hash,
    # for a store written before the settings were recorded too (its manifest has only its seq_len).
    seq_len = (draft_args(small, target_dir, tmp_path / "r6", *RUN, "--data.seq_len=24", f"--draft.features={whole}"),
               "(data.seq_len: the store's 32, this run's 24); accepted: the store's data.seq_len = 32, or a store")
    cases.append(seq_len)
    for argv, named in cases:
        capsys.readouterr()
        assert main(argv) == 2, named
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    manifest = json.loads((whole / "manifest.json").read_text())
    assert manifest["settings"]["data.seq_len"] == 32
    del manifest["settings"]
    (whole / "manifest.json").write_text(json.dumps(manifest))
    assert main(seq_len[0]) == 2 and seq_len[1] in capsys.readouterr().err
    # Continuing a store with another seq_len names it too.
    assert main(features_args(small, target_dir, whole, "--shard-samples=4", "--data.seq_len=24")) == 2
    assert "(data.seq_len: the store's 32, this run's 24); accepted: the same config" in capsys.readouterr().err
    # A damaged shard: one line naming the file; the store itself is left as it is.
    shard = whole / "train-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    assert main(draft_args(small, target_dir, tmp_path / "r5", *RUN, f"--draft.features={whole}")) == 2
    err = capsys.readouterr().err
    assert str(shard) in err and "damaged" in err and len(err.strip().splitlines()) == 1
    # A user's directory is never written into.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(features_args(small, target_dir, mine)) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def _store_at_world_size_2(rank, world_size, small, target, out):
    """Rank 0 and 1 write one store together, then train an EAGLE-3 draft from it on fsdp2."""
    from treadle.config import load_config
    from treadle.train.features import write_features
    from treadle.train.run import run_training

    args = features_args(small, target, out / "store2", "--shard-samples=16", *KINDS["eagle3"])
    flags = [a for a in args[1:] if not a.startswith(("--out", "--shard-samples"))]
    report = write_features(load_config(None, flags), out / "store2", dtype="fp32", shard_samples=16, progress=False)
    run_training(load_config(None, draft_args(small, target, out / "two", *RUN, *KINDS["eagle3"], *FSDP2,
                                              "--train.threads=1", f"--draft.features={out / 'store2'}")[1:]))
    return report.written


FSDP2 = ("--distributed.engine=fsdp2", "--train.grad_accum_steps=1")


@pytest.mark.skipif(not compat.FSDP2_TRAINS_DRAFTS, reason="draft runs on FSDP2 need torch >= 2.13 (refused before)")
def test_a_store_written_and_read_by_2_ranks_equals_one_process(small, eagle3_target_dir, tmp_path):
    """Two ranks write the same files one process writes (each its shards), and an fsdp2 run of 2 ranks from the
    fp32 store equals one process's live run (the same global batch: 2 ranks x GA 1 = 1 x GA 2)."""
    from tests.distributed import run_distributed

    target = eagle3_target_dir
    written = run_distributed(_store_at_world_size_2, world_size=2, timeout=300, small=small, target=target,
                              out=tmp_path)
    one = tmp_path / "store1"
    assert main(features_args(small, target, one, "--shard-samples=16", "--dtype=fp32", *KINDS["eagle3"])) == 0
    two = tmp_path / "store2"
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in two.iterdir()) and len(files) > 4
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files if f.endswith(".safetensors"))
    assert written[0] == written[1] == json.loads((one / "manifest.json").read_text())["splits"]["train"]["samples"] \
        + json.loads((one / "manifest.json").read_text())["splits"]["val"]["samples"]
    ref = tmp_path / "ref"
    assert main(draft_args(small, target, ref, *RUN, *KINDS["eagle3"])) == 0
    for key in ("loss", "grad_norm", "eval_loss", "tau_sim", "acc_1"):
        close(records(ref, key), records(tmp_path / "two", key))


def test_an_eagle3_run_trains_from_speculators_offline_data(eagle3_target_dir, small, tmp_path, capsys):
    """Hidden states as vLLM's extract_hidden_states writes them (tests/test_features_speculators.py) are a run's
    training data: the draft trains on them with no target decoder layer built, and the data's files say neither
    their layers nor their kind, which the config must (one line each)."""
    from transformers import AutoModelForCausalLM

    from tests.test_features_speculators import write_store

    target = AutoModelForCausalLM.from_pretrained(eagle3_target_dir).eval()
    g = torch.Generator().manual_seed(5)
    rows = [(torch.randint(0, 512, (40,), generator=g).tolist(), [0] * 10 + [1] * 30) for _ in range(24)]
    store = write_store(tmp_path / "speculators", target, rows)
    run = tmp_path / "run"
    common = [*RUN, *KINDS["eagle3"], f"--draft.features={store}"]
    assert main(draft_args(small, eagle3_target_dir, run, *common, "--draft.feature_layers=[1,2,3]")) == 0
    out = capsys.readouterr().out
    losses = records(run)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert not records(run, "tau_sim") and (run / "draft" / "model.safetensors").is_file()
    assert "exported draft" in out
    for extra, named in (((), "draft.feature_layers"), (("--draft.kind=glide",), "draft.kind = 'eagle3' (not 'glide')")):
        argv = draft_args(small, eagle3_target_dir, tmp_path / "bad", *common, *extra)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, err


def test_storage_forms_round_trip_within_their_precision():
    """fp32 is exact; bf16 within its 8-bit mantissa; fp8 (e4m3) within its 3-bit mantissa of each token's own
    scale, so a token of small values keeps its precision next to a token of large ones."""
    from treadle.drafts.features.store import decode, encode

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=g) * torch.logspace(-3, 3, 5).view(1, 5, 1, 1)  # tokens of 6 magnitudes
    for dtype, rel in (("fp32", 0.0), ("bf16", 2.0 ** -8), ("fp8", 2.0 ** -4)):
        stored = encode("k", x, dtype)
        back = decode("k", stored.__getitem__)
        amax = x.abs().flatten(2).amax(-1).view(2, 5, 1, 1)
        floor = amax * 2.0 ** -9 if dtype == "fp8" else 0.0  # e4m3's subnormals, relative to the token's scale
        assert back.dtype == torch.float32 and ((back - x).abs() <= rel * x.abs() + floor).all(), dtype
        if dtype == "fp8":
            assert stored["k"].dtype == torch.float8_e4m3fn and stored["k.scale"].shape == (2, 5)



@pytest.mark.parametrize("kind", [pytest.param("frozen_kv", marks=pytest.mark.skipif(
    not compat.gemma4_kv_sharing(), reason="frozen_kv needs transformers >= 5.23")), "mtp"])
def test_a_recurrent_run_from_a_store_equals_the_live_run(shards, small, tmp_path, kind):
    """Gemma 4's assistant trained from stored target reads (the final hidden state and the two stored K/V per
    token, full and sliding: what speculators cannot get, its RFC #586), and an MTP head (the final hidden state
    alone), each equal to the live-target run; a new draft is copied from the target's files as the live run copies
    it from the module."""
    from tests.helpers import save_target

    if kind == "frozen_kv":
        from tests.test_frozen_kv import RUN as OWN, tiny_target
    else:
        from tests.test_mtp import RUN as OWN, tiny_target
    target = save_target(tiny_target(**({"family": "glm4_moe"} if kind == "mtp" else {})), shards, tmp_path / "t")
    extra = tuple(a for a in OWN if a.startswith("--draft."))
    store, live, stored = tmp_path / "store", tmp_path / "live", tmp_path / "stored"
    assert main(features_args(small, target, store, "--dtype=fp32", "--shard-samples=16", *extra)) == 0
    assert json.loads((store / "manifest.json").read_text())["kind"] == kind
    assert main(draft_args(small, target, live, *RUN, *extra)) == 0
    assert main(draft_args(small, target, stored, *RUN, *extra, f"--draft.features={store}")) == 0
    for key in ("loss", "grad_norm", "eval_loss", "tau_sim"):
        close(records(live, key), records(stored, key))
    same_weights(live, stored)
