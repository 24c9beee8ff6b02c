"""Data-file sources: Hugging Face datasets reading, the tokenization cache, bad rows, SFT examples in packed samples."""

import json
import os

import numpy as np
import pytest
import torch

from treadle.config import DataConfig
from treadle.data import sft
from treadle.data.packed import IGNORE_INDEX, ExampleDataset
from treadle.data.sources import open_source
from treadle.errors import UserError


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))


def write_jsonl(path, rows, blank_after=()):
    lines = []
    for i, r in enumerate(rows):
        lines.append(r if isinstance(r, str) else json.dumps(r))
        if i in blank_after:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def open_(shards, path, seq_len=16, fmt="auto", **data):
    cfg = DataConfig(seq_len=seq_len, **data)
    return open_source("s", [str(path)], "train", fmt, "text", seq_len, cfg, shards / "tok", "data.sources[0] (s)")


TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(40)]


def test_text_jsonl_is_tokenized_once_and_cached(shards, tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    src = open_(shards, f)
    tok = sft.load_tokenizer(shards / "tok")
    want = [i for t in TEXTS for i in tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]]
    assert src.kind == "text" and src.dataset.num_tokens == len(want)
    assert src.dataset[0]["input_ids"].tolist() == want[:16]
    cached = src.dataset.shards[0].path
    assert cached.parent == tmp_path / "cache" / "sources"
    stamp = (cached / "tokens.bin").stat().st_mtime_ns
    again = open_(shards, f)  # the second run finds the shards: nothing re-tokenized
    assert again.dataset.shards[0].path == cached and (cached / "tokens.bin").stat().st_mtime_ns == stamp
    write_jsonl(f, [{"text": t} for t in TEXTS[:-1]])  # the file changed: another cache entry
    os.utime(f, ns=(1, 1))
    assert open_(shards, f).dataset.shards[0].path != cached


def test_parquet_and_a_glob_of_files(shards, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(2):
        pq.write_table(pa.table({"body": TEXTS[k * 20 : (k + 1) * 20]}), tmp_path / f"part{k}.parquet")
    cfg = DataConfig(seq_len=16)
    src = open_source("p", [str(tmp_path / "*.parquet")], "train", "text", "body", 16, cfg, shards / "tok", "k")
    assert src.dataset.meta["rows"] == 40 and len(src.dataset.meta["files"]) == 2


def test_bad_rows_name_file_and_line_or_are_counted(shards, tmp_path):
    rows = [{"text": t} for t in TEXTS[:5]] + ["{not json", {"txt": "x"}, {"text": 3}] + [{"text": t} for t in TEXTS[5:9]]
    f = write_jsonl(tmp_path / "bad.jsonl", rows, blank_after=(1,))  # a blank line: line numbers are not row numbers
    with pytest.raises(UserError, match=rf"{f}:7: not valid JSON"):
        open_(shards, f)
    f2 = write_jsonl(tmp_path / "bad2.jsonl", rows[:5] + rows[6:], blank_after=(1,))
    with pytest.raises(UserError, match=rf"{f2}:7: field 'text' is missing"):
        open_(shards, f2)
    src = open_(shards, f, bad_rows="skip")
    assert src.skipped == 3 and src.dataset.meta["rows"] == 9
    assert src.skip_examples[0].startswith(f"{f}:7: not valid JSON") and f"{f}:9: field 'text' is a int" in src.skip_examples[2]
    assert "3 bad rows skipped" in src.describe()


def test_a_corrupt_line_reaches_the_user_as_treadles_line_alone(shards, tmp_path):
    """Issue 39: datasets logged pyarrow's failure twice (``Failed to load JSON ... in row 20``: a 0-based row of a
    batch, the text cut off) before treadle's own line. Only treadle's line is left, naming the line a user counts,
    in a .jsonl, a .json holding JSON lines, and a .json document."""
    import logging

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    rows = [{"text": t} for t in TEXTS]
    lines = [json.dumps(r) for r in rows[:20]] + ['{"text": "cut off'] + [json.dumps(r) for r in rows[20:]]
    seen = Seen()
    logging.getLogger("datasets").addHandler(seen)
    try:
        for name in ("bad.jsonl", "lines.json"):
            f = tmp_path / name
            f.write_text("\n".join(lines) + "\n")
            with pytest.raises(UserError, match=rf"^{f}:21: not valid JSON \(Invalid control character at column 18\)"):
                open_(shards, f)
        doc = tmp_path / "doc.json"
        doc.write_text(json.dumps(rows, indent=1).replace("},", "}", 8).replace("}", "},", 7))  # the 8th comma gone
        with pytest.raises(UserError, match=rf"^{doc}:26: not valid JSON \(Expecting ',' delimiter at column 2\)"):
            open_(shards, doc)
    finally:
        logging.getLogger("datasets").removeHandler(seen)
    assert [r.getMessage() for r in seen.records if r.levelno >= logging.WARNING] == []


def test_empty_files_and_unusable_sources(shards, tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": t} for t in TEXTS])
    (tmp_path / "d" / "b.jsonl").write_text("")
    with pytest.raises(UserError, match="b.jsonl: empty file"):
        open_(shards, tmp_path / "d")
    assert open_(shards, tmp_path / "d", bad_rows="skip").skipped == 1
    with pytest.raises(UserError, match="no such file"):
        open_(shards, tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="not one of"):
        open_(shards, tmp_path / "x.csv")
    only_bad = write_jsonl(tmp_path / "only_bad.jsonl", [{"text": 1}])
    with pytest.raises(UserError, match="no usable row"):
        open_(shards, only_bad, fmt="text", bad_rows="skip")


PAIRS = [{"prompt": f"# task {i}\n", "completion": f"print({i})\n" * (1 + i % 3)} for i in range(30)]


def test_sft_examples_are_packed_whole_with_loss_on_completions_only(shards, tmp_path):
    f = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    src = open_(shards, f, seq_len=48)
    ds = src.dataset
    assert src.kind == "sft" and isinstance(ds, ExampleDataset) and ds.stats["truncated"] == ds.stats["dropped"] == 0
    tok = sft.load_tokenizer(shards / "tok")
    encoded = [sft.encode_sft(tok, r) for r in PAIRS]
    seen = []
    for i in range(len(ds)):
        s = ds[i]
        pos, ids, labels = s["position_ids"].tolist(), s["input_ids"].tolist(), s["labels"].tolist()
        starts = [j for j, p in enumerate(pos) if p == 0]
        for a, b in zip(starts, starts[1:] + [len(pos)]):
            if all(lab == IGNORE_INDEX for lab in labels[a:b]) and ids[a:b] == [ids[a]] * (b - a):
                continue  # the padding segment
            seen.append((ids[a:b], labels[a:b]))
    assert len(seen) == len(PAIRS)  # every example once, none split across samples
    for (ids, labels), (want_ids, mask) in zip(seen, encoded):
        assert ids == want_ids[:-1]
        # Exactly the completion tokens and the eos are targets.
        assert labels == [t if m else IGNORE_INDEX for t, m in zip(want_ids[1:], mask[1:])]
        assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == tok.decode(want_ids[-sum(mask):])


def test_overlong_examples_are_truncated_or_dropped_and_counted(shards, tmp_path):
    rows = PAIRS[:5] + [{"prompt": "x", "completion": "y = 1\n" * 40}, {"prompt": "z " * 60, "completion": "ok"}]
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    cut = open_(shards, f, seq_len=32).dataset
    # The long completion keeps its first 33 tokens; the long prompt leaves no target within 33 tokens: dropped.
    assert cut.stats == {"examples": 6, "truncated": 1, "dropped": 1}
    dropped = open_(shards, f, seq_len=32, overlong="drop").dataset
    assert dropped.stats == {"examples": 5, "truncated": 0, "dropped": 2}


def test_packed_examples_do_not_attend_to_each_other(shards, tmp_path):
    """Logits of an example inside a packed sample equal its logits alone: the position_ids restart isolates it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers import TARGET

    f = write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:6])
    ds = open_(shards, f, seq_len=64).dataset
    s = ds[0]
    starts = [j for j, p in enumerate(s["position_ids"].tolist()) if p == 0]
    assert len(starts) >= 3
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TARGET)).eval()
    with torch.no_grad():
        packed = model(input_ids=s["input_ids"][None], position_ids=s["position_ids"][None]).logits[0]
        a, b = starts[1], starts[2]
        alone = model(input_ids=s["input_ids"][None, a:b]).logits[0]
    assert torch.allclose(packed[a:b], alone, atol=1e-5)
    # Without the restart the second example would see the first: the check above can fail.
    with torch.no_grad():
        leaky = model(input_ids=s["input_ids"][None]).logits[0]
    assert not torch.allclose(leaky[a:b], alone, atol=1e-3)


def test_chat_messages_source_masks_assistant_turns(shards, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"add {i}"}, {"role": "assistant", "content": f"x + {i}"}]}
            for i in range(10)]
    ds = open_(shards, write_jsonl(tmp_path / "chat.jsonl", rows), seq_len=64).dataset
    tok = sft.load_tokenizer(shards / "tok")
    targets = [t for i in range(len(ds)) for t in ds[i]["labels"].tolist() if t != IGNORE_INDEX]
    text = tok.decode(targets)
    assert all(f"x + {i}" in text for i in range(10)) and "add" not in text and "user" not in text
    assert np.sum(np.array(targets) == tok.eos_token_id) == 10  # each assistant turn ends with a target eos


def test_rows_that_are_not_utf8_name_file_and_line_or_are_skipped(shards, tmp_path):
    """Hole 5: such a row was read with replacement characters, silently."""
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in TEXTS[:3])
                  + b'{"text": "caf\xe9 = 1\\n"}\n\n' + json.dumps({"text": "a\u2028b"}, ensure_ascii=False).encode()
                  + b"\n" + b"".join(json.dumps({"text": t}).encode() + b"\n" for t in TEXTS[3:]))
    with pytest.raises(UserError, match=rf"{f}:4: not UTF-8 \(byte 0xe9 at byte 14 of the line\)"):
        open_(shards, f)
    src = open_(shards, f, bad_rows="skip")
    assert src.skipped == 1 and src.skip_examples[0].startswith(f"{f}:4: not UTF-8")
    tok = sft.load_tokenizer(shards / "tok")
    # Every other row is kept whole, the U+2028 one (read by the line-by-line fallback) included.
    texts = TEXTS[:3] + ["a\u2028b"] + TEXTS[3:]
    assert src.dataset.meta["rows"] == len(texts)
    assert src.dataset.num_tokens == sum(len(tok.encode(t, add_special_tokens=False)) + 1 for t in texts)


def test_text_rows_keep_special_token_text_and_record_the_largest_id(shards, tmp_path):
    """Hole 10b: "<|endoftext|>" inside a row is text; documents end where rows end. Hole 4: max_token_id."""
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": 'EOS = "<|endoftext|>"\n' + t} for t in TEXTS])
    src = open_(shards, f)
    tok = sft.load_tokenizer(shards / "tok")
    shard = src.dataset.shards[0]
    assert int((shard.tokens == tok.eos_token_id).sum()) == len(TEXTS)  # one eos per row, after it
    assert shard.max_token_id == int(shard.tokens.max())
    first = shard.tokens[: shard.offsets[1]].tolist()
    assert tok.decode(first[:-1]) == 'EOS = "<|endoftext|>"\n' + TEXTS[0] and first[-1] == tok.eos_token_id


def _documents(ds) -> list[tuple[int, ...]]:
    """The documents of a dataset's token stream, in order."""
    stream = ds._read(0, ds.num_tokens).tolist()
    bounds = list(ds._doc_starts) + [ds.num_tokens]
    return [tuple(stream[a:b]) for a, b in zip(bounds, bounds[1:])]


def test_val_fraction_holds_out_a_fixed_disjoint_part_of_a_source(shards, tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    cfg = DataConfig(seq_len=16)
    every = _documents(open_(shards, f).dataset)
    src = open_source("s", [str(f)], "train", "auto", "text", 16, cfg, shards / "tok", "data.sources[0] (s)",
                      val_fraction=0.2)
    train, held = _documents(src.dataset), _documents(src.held_out)
    assert len(every) == 40 and len(held) == 8 and len(train) == 32  # round(0.2 * 40)
    assert not set(train) & set(held) and sorted(train + held) == sorted(every)
    assert train == [d for d in every if d not in held]  # in their order, and spread over the file, not its tail
    assert [every.index(d) for d in held] != list(range(32, 40))
    # Samples are windows over the kept documents alone, positions restarting at each of them.
    stream = [t for d in train for t in d]
    starts = {sum(map(len, train[:k])) for k in range(len(train))}
    for i in range(len(src.dataset)):
        s = src.dataset[i]
        assert s["input_ids"].tolist() == stream[i * 16:(i + 1) * 16]
        assert [j for j, p in enumerate(s["position_ids"].tolist()) if p == 0] == \
               [j - i * 16 for j in range(i * 16, (i + 1) * 16) if j in starts]
    # The same split every time (no seed, no rank, no run state takes part), for an SFT source as for text.
    again = open_source("s", [str(f)], "train", "auto", "text", 16, cfg, shards / "tok", "k", val_fraction=0.2)
    assert _documents(again.held_out) == held
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    sft_src = open_source("p", [str(pairs)], "train", "auto", "text", 48, DataConfig(seq_len=48), shards / "tok", "k",
                          val_fraction=0.25)
    assert isinstance(sft_src.held_out, ExampleDataset)
    examples = sft_src.dataset.stats["examples"] + sft_src.held_out.stats["examples"]
    assert examples == len(PAIRS) and sft_src.held_out.stats["examples"] == round(0.25 * len(PAIRS))
    assert not set(_documents(sft_src.dataset)) & set(_documents(sft_src.held_out))


def test_held_out_parts_interleave_and_a_source_too_small_to_split_is_refused(shards, tmp_path):
    from treadle.data.holdout import Interleaved, held_out

    f = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    cfg = DataConfig(seq_len=8)
    a = open_source("a", [str(f)], "train", "auto", "text", 8, cfg, shards / "tok", "a", val_fraction=0.5).held_out
    b = open_source("b", [str(f)], "train", "auto", "text", 8, cfg, shards / "tok", "b", val_fraction=0.1).held_out
    both = Interleaved([a, b])
    assert len(both) == len(a) + len(b) and len(a) >= 3 * len(b) > 0
    owners = both._owner.tolist()
    half = owners[: len(owners) // 2]  # any prefix samples both parts in proportion
    assert abs(half.count(1) - len(b) / 2) <= 1
    assert [t.tolist() for t in both[0].values()] == [t.tolist() for t in a[0].values()]
    assert held_out(10, 0.01, "x").sum() == 1  # at least one document
    with pytest.raises(UserError, match=r"data.val_fraction = 0.5 would hold out 1 of the 1 document\(s\) of one"):
        held_out(1, 0.5, "one")
