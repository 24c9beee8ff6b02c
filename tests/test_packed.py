"""Packed samples (document boundaries, shards) and the global sample order."""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from treadle.corpus import corpus_files, train_tokenizer
from treadle.data.loader import StepLoader, eval_batches
from treadle.data.mixture import SampleOrder, stream_of
from treadle.data.packed import PackedDataset
from treadle.data.prepare import prepare
from treadle.errors import UserError


def write_shard(path: Path, docs: list[list[int]], dtype: str = "uint16", fingerprint: str = "fp-test") -> Path:
    """A shard written by hand, with token values we choose, exactly as `prepare` lays it out."""
    path.mkdir(parents=True)
    tokens = np.array([t for d in docs for t in d], dtype=dtype)
    tokens.tofile(path / "tokens.bin")
    np.save(path / "offsets.npy", np.cumsum([0] + [len(d) for d in docs]).astype(np.int64))
    (path / "meta.json").write_text(json.dumps({
        "format_version": 1, "dtype": dtype, "vocab_size": 100_000, "tokenizer_fingerprint": fingerprint,
        "tokenizer_dir": "/nowhere", "num_tokens": int(tokens.size), "num_documents": len(docs),
        "num_skipped_empty": 0, "sources": 1, "eos_id": 0,
    }))
    return path


def as_lists(sample):
    return {k: v.tolist() for k, v in sample.items()}


def test_window_across_document_boundary(tmp_path):
    shard = write_shard(tmp_path / "s", [[10, 11, 12], [20, 21, 22, 23, 24], [30, 31]])
    ds = PackedDataset([shard], seq_len=4)
    assert len(ds) == (10 - 1) // 4 == 2
    s0 = ds[0]
    assert all(v.dtype == torch.int64 and v.shape == (4,) for v in s0.values())
    # Window tokens[0:5] = 10 11 12 20 21; predicting 20 (doc 2) from 12 (doc 1) is masked.
    assert as_lists(s0) == {"input_ids": [10, 11, 12, 20], "labels": [11, 12, -100, 21], "position_ids": [0, 1, 2, 0]}
    # Window tokens[4:9] = 21 22 23 24 30 starts mid-document: its first position is 1, not 0.
    assert as_lists(ds[1]) == {"input_ids": [21, 22, 23, 24], "labels": [22, 23, 24, -100], "position_ids": [1, 2, 3, 4]}
    assert as_lists(ds[-1]) == as_lists(ds[1])
    with pytest.raises(IndexError):
        ds[2]

    unmasked = PackedDataset([shard], seq_len=4, mask_cross_doc=False)
    assert unmasked[0]["labels"].tolist() == [11, 12, 20, 21]
    assert unmasked[1]["labels"].tolist() == [22, 23, 24, 30]
    assert unmasked[1]["position_ids"].tolist() == [1, 2, 3, 4]  # positions do not depend on masking


def test_shards_concatenate_with_boundary_between_them(tmp_path):
    a = write_shard(tmp_path / "a", [[1, 2, 3]], dtype="uint32")
    empty = write_shard(tmp_path / "empty", [])
    b = write_shard(tmp_path / "b", [[4, 5], [6, 7, 8]])
    ds = PackedDataset([a, empty, b], seq_len=3)
    assert ds.num_tokens == 8 and len(ds) == 2
    assert ds.tokenizer_fingerprint == "fp-test" and ds.vocab_size == 100_000
    assert ds.meta["dtype"] == "uint32" and ds.tokenizer_dir == Path("/nowhere")
    # A shard boundary is a document boundary even though shard a has one document only.
    assert as_lists(ds[0]) == {"input_ids": [1, 2, 3], "labels": [2, 3, -100], "position_ids": [0, 1, 2]}
    assert as_lists(ds[1]) == {"input_ids": [4, 5, 6], "labels": [5, -100, 7], "position_ids": [0, 1, 0]}
    # Picklable for DataLoader workers, without dragging the token arrays along.
    clone = pickle.loads(pickle.dumps(ds))
    assert as_lists(clone[1]) == as_lists(ds[1])


def test_shards_must_share_a_tokenizer(tmp_path):
    a = write_shard(tmp_path / "a", [[1, 2, 3]], fingerprint="aaaa")
    b = write_shard(tmp_path / "b", [[4, 5, 6]], fingerprint="bbbb")
    with pytest.raises(UserError) as info:
        PackedDataset([a, b], seq_len=2)
    assert str(a) in str(info.value) and str(b) in str(info.value)


def _break(kind: str, shard: Path) -> str:
    """Damage a shard one way; return the text the error must contain."""
    if kind == "missing dir":
        shard.rename(shard.with_name("gone"))
        return str(shard)
    if kind == "missing meta":
        (shard / "meta.json").unlink()
        return "meta.json: missing"
    if kind == "bad json":
        (shard / "meta.json").write_text("{not json")
        return "meta.json: not valid JSON"
    if kind == "missing tokens":
        (shard / "tokens.bin").unlink()
        return "tokens.bin: missing"
    if kind == "truncated tokens":
        data = (shard / "tokens.bin").read_bytes()
        (shard / "tokens.bin").write_bytes(data[:-2])
        return "tokens.bin: 18 bytes, expected 20"
    if kind == "bad offsets":
        np.save(shard / "offsets.npy", np.array([0, 4, 9], dtype=np.int64))
        return "offsets.npy"
    if kind == "bad dtype":
        meta = json.loads((shard / "meta.json").read_text())
        (shard / "meta.json").write_text(json.dumps(dict(meta, dtype="float32")))
        return 'dtype = "float32" is not one of'
    meta = json.loads((shard / "meta.json").read_text())
    edits = {  # hole 3: each of these was a traceback (TypeError, ValueError) or passed unnoticed
        "meta a list": ([meta], "meta.json: a JSON list, not an object"),
        "meta empty": ("", "meta.json: empty"),
        "num_tokens a string": (dict(meta, num_tokens="10"), 'num_tokens = "10" is not a non-negative integer'),
        "num_documents a float": (dict(meta, num_documents=2.0), "num_documents = 2.0 is not"),
        "vocab_size negative": (dict(meta, vocab_size=-5), "vocab_size = -5 is not a positive integer"),
        "fingerprint missing": ({k: v for k, v in meta.items() if k != "tokenizer_fingerprint"},
                                "missing key 'tokenizer_fingerprint'"),
        "format_version 2": (dict(meta, format_version=2), "format_version 2 is not one this treadle reads"),
        "max_token_id a bool": (dict(meta, max_token_id=True), "max_token_id = true is not"),
    }
    if kind in edits:
        value, needle = edits[kind]
        (shard / "meta.json").write_text(value if isinstance(value, str) else json.dumps(value))
        return needle
    if kind == "meta binary":
        (shard / "meta.json").write_bytes(bytes(range(256)))
        return "meta.json: not UTF-8 text"
    if kind == "offsets empty file":
        (shard / "offsets.npy").write_bytes(b"")
        return "offsets.npy: not a readable .npy array"
    if kind == "offsets garbage":
        (shard / "offsets.npy").write_bytes(b"\x93NUMPY garbage")
        return "offsets.npy: not a readable .npy array"
    if kind == "tokens too long":
        (shard / "tokens.bin").write_bytes((shard / "tokens.bin").read_bytes() + b"\0\0")
        return "tokens.bin: 22 bytes, expected 20"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing dir", "missing meta", "bad json", "missing tokens",
                                  "truncated tokens", "bad offsets", "bad dtype", "meta a list", "meta empty",
                                  "num_tokens a string", "num_documents a float", "vocab_size negative",
                                  "fingerprint missing", "format_version 2", "max_token_id a bool", "meta binary",
                                  "offsets empty file", "offsets garbage", "tokens too long"])
def test_damaged_shards_are_user_errors(tmp_path, kind):
    shard = write_shard(tmp_path / "s", [list(range(1, 6)), list(range(6, 11))])
    needle = _break(kind, shard)
    with pytest.raises(UserError) as info:
        PackedDataset([shard], seq_len=4)
    assert needle in str(info.value)


def test_too_few_tokens(tmp_path):
    shard = write_shard(tmp_path / "s", [[1, 2, 3, 4]])
    assert len(PackedDataset([shard], seq_len=3)) == 1
    with pytest.raises(UserError, match="4 tokens.*seq_len=4"):
        PackedDataset([shard], seq_len=4)


def test_prepared_shard_positions_and_masks(tmp_path):
    """End to end: real tokenizer and `prepare`; masks and positions follow the real eos tokens."""
    files = [p for _, p in corpus_files()][:6]
    tok = train_tokenizer(files, tmp_path / "tok", vocab_size=300)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"{i}.txt").write_text(f"value_{i} = {i * 7}\n" * (i + 1))
    meta = prepare([str(docs)], tmp_path / "shard", tok, workers=1)
    ds = PackedDataset([tmp_path / "shard"], seq_len=16)
    eos = meta["eos_id"]
    for i in range(len(ds)):
        s = ds[i]
        # eos ends every document, so the next token starts a new one: masked, and positions restart.
        assert torch.equal(s["labels"] == -100, s["input_ids"] == eos)
        after_eos = torch.nonzero(s["input_ids"][:-1] == eos).flatten() + 1
        assert (s["position_ids"][after_eos] == 0).all()
        assert (s["position_ids"] == 0).sum() == len(after_eos) + int(i * 16 in ds._doc_starts)


def test_sample_order_is_deterministic_and_each_epoch_a_permutation():
    n = 37
    a, b = SampleOrder(n, seed=3), SampleOrder(n, seed=3)
    stream = a.indices(0, 3 * n)
    assert np.array_equal(stream, b.indices(0, 3 * n))
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(stream[:n], stream[n:2 * n])  # each epoch is reshuffled
    assert not np.array_equal(stream[:n], SampleOrder(n, seed=4).indices(0, n))
    # Any window, including one across an epoch boundary, agrees with the stream.
    fresh = SampleOrder(n, seed=3)
    assert np.array_equal(fresh.indices(30, 20), stream[30:50])
    assert np.array_equal(fresh.indices(2 * n + 5, 3), stream[2 * n + 5:2 * n + 8])


@pytest.fixture
def id_dataset(tmp_path):
    """37 samples of seq_len 4 over tokens 0..148: sample i's first input id is 4*i."""
    shard = write_shard(tmp_path / "ids", [list(range(37 * 4 + 1))])
    return PackedDataset([shard], seq_len=4)


def sample_ids(batches):
    return [int(x) // 4 for b in batches for x in b["input_ids"][:, 0]]


def test_step_loader_resume_equals_continuing(id_dataset):
    run = StepLoader(id_dataset, micro_batch_size=3, grad_accum_steps=2, seed=7)
    steps = [run.next_step() for _ in range(9)]  # 54 positions: crosses into epoch 2
    assert all(len(s) == 2 and s[0]["input_ids"].shape == (3, 4) for s in steps)
    assert sample_ids(steps[0] + steps[1])[:6] == SampleOrder(37, 7, stream_of("train")).indices(0, 6).tolist()

    replay = StepLoader(id_dataset, micro_batch_size=3, grad_accum_steps=2, seed=7)
    for _ in range(4):
        replay.next_step()
    state = replay.state_dict()
    assert state["position"] == 24 and state["seed"] == 7

    resumed = StepLoader(id_dataset, micro_batch_size=3, grad_accum_steps=2, seed=7)
    resumed.load_state_dict(state)
    for expected in steps[4:]:
        got = resumed.next_step()
        for g, e in zip(got, expected):
            assert all(torch.equal(g[k], e[k]) for k in e)

    with pytest.raises(UserError, match="seed"):
        StepLoader(id_dataset, 3, 2, seed=8).load_state_dict(state)


def test_ranks_split_the_same_global_step(id_dataset):
    single = StepLoader(id_dataset, micro_batch_size=2, grad_accum_steps=2, seed=1)
    ranks = [StepLoader(id_dataset, micro_batch_size=2, grad_accum_steps=1, seed=1, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(12):  # 48 positions: across an epoch boundary
        want = sample_ids(single.next_step())
        parts = [sample_ids(r.next_step()) for r in ranks]
        assert sorted(parts[0] + parts[1]) == sorted(want)
        assert len(parts[0]) == len(parts[1]) == 2


def test_resume_on_another_world_size_continues_the_global_order(id_dataset):
    order = SampleOrder(37, seed=5, stream=stream_of("train")).indices(0, 80).tolist()
    one = StepLoader(id_dataset, micro_batch_size=2, grad_accum_steps=2, seed=5)
    consumed = [sample_ids(one.next_step()) for _ in range(3)]
    assert sum(consumed, []) == order[:12]
    state = one.state_dict()

    # Resume on 2 ranks with GA 1 and micro-batch 2: same global batch of 4.
    ranks = [StepLoader(id_dataset, 2, 1, seed=5, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for step in range(3, 8):
        parts = [sample_ids(r.next_step()) for r in ranks]
        # Micro-batch 0 of rank 0 then of rank 1: exactly the next slice of the global order.
        assert parts[0] + parts[1] == order[step * 4:(step + 1) * 4]


def test_eval_batches_cover_everything_once(id_dataset):
    per_rank = [list(eval_batches(id_dataset, batch_size=4, rank=r, world_size=2)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 5  # ceil(37 / 8): equal counts on every rank
    seen = []
    for batches in per_rank:
        for b in batches:
            assert b["input_ids"].shape == (4, 4)
            real = (b["labels"] != -100).any(dim=1)
            seen += [int(x) // 4 for x in b["input_ids"][real, 0]]
    assert sorted(seen) == list(range(37))
    # Sequential, not shuffled: rank 0's first batch is samples 0..3.
    assert [int(x) // 4 for x in per_rank[0][0]["input_ids"][:, 0]] == [0, 1, 2, 3]
    assert len(list(eval_batches(id_dataset, batch_size=4, max_batches=2))) == 2


def test_eval_batches_cover_the_same_samples_at_any_world_size(id_dataset):
    """max_batches bounds the samples of the whole evaluation, so eval loss does not depend on the rank count."""
    def covered(world_size):
        ids = []
        for r in range(world_size):
            for b in eval_batches(id_dataset, batch_size=4, max_batches=3, rank=r, world_size=world_size):
                real = b["labels"][:, 0] != -100
                ids += [int(x) // 4 for x in b["input_ids"][real, 0]]
        return sorted(ids)

    assert covered(1) == covered(2) == covered(3) == list(range(12))


def test_micro_batch_layout_interleaves_ranks_within_a_step(id_dataset):
    """Micro-batch m of rank r holds positions (m * world + r) * mb + [0, mb) of the step."""
    order = SampleOrder(37, seed=3, stream=stream_of("train")).indices(0, 16).tolist()
    ranks = [StepLoader(id_dataset, micro_batch_size=2, grad_accum_steps=2, seed=3, rank=r, world_size=2) for r in range(2)]
    steps = [r.next_step() for r in ranks]
    for r in range(2):
        for m in range(2):
            lo = (m * 2 + r) * 2
            assert sample_ids([steps[r][m]]) == order[lo : lo + 2]
    assert all(r.position == 8 for r in ranks)


def test_loader_refuses_ids_beyond_the_vocab_naming_the_source(tmp_path):
    """Hole 4: shards without a recorded max_token_id (another tool's) are checked per micro-batch."""
    good = write_shard(tmp_path / "good", [list(range(1, 40))])
    bad = write_shard(tmp_path / "bad", [list(range(1, 20)) + [600] + list(range(20, 40))])
    datasets = {"a": PackedDataset([good], seq_len=4), "b": PackedDataset([bad], seq_len=4)}
    assert "max_token_id" not in datasets["b"].meta and datasets["b"].shards[0].max_token_id is None
    loader = StepLoader({"a": datasets["a"]}, 2, 2, seed=0, vocab_size=40)
    loader.next_step()  # every id of source a is below 40
    loader = StepLoader(datasets["b"], 9, 1, seed=0, vocab_size=512)
    with pytest.raises(UserError, match=rf"source 'train' \(shard directory {bad}\) holds token id 600.*vocab_size 512"):
        loader.next_step()
    assert StepLoader(datasets["b"], 9, 1, seed=0, vocab_size=601).next_step()  # 600 fits a vocabulary of 601
    with pytest.raises(UserError, match=rf"evaluation data \(shard directory {bad}\) holds token id 600"):
        list(eval_batches(datasets["b"], 4, vocab_size=600))


def test_writer_records_the_largest_id(tmp_path):
    from treadle.data.shards import ShardWriter

    (tmp_path / "s").mkdir()
    writer = ShardWriter(tmp_path / "s", vocab_size=1000, with_loss_mask=False)
    writer.add([3, 999, 4])
    writer.add([7])
    assert writer.finish({"tokenizer_fingerprint": "fp"})["max_token_id"] == 999
    assert PackedDataset([tmp_path / "s"], seq_len=2).shards[0].max_token_id == 999
