"""`treadle prepare`: inputs, determinism, output layout, and errors that touch nothing."""

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from treadle.corpus import corpus_files, train_tokenizer
from treadle.tokenizer import load_backend_tokenizer, tokenizer_fingerprint
from treadle.data import prepare as prep
from treadle.data.prepare import prepare, token_dtype
from treadle.errors import UserError


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    """A small BPE (vocab 400) trained on a few stdlib files: fast, and real."""
    out = tmp_path_factory.mktemp("tok") / "tok"
    return train_tokenizer([p for _, p in corpus_files()][:12], out, vocab_size=400)


def _wordlevel_tokenizer(path: Path, vocab_size: int) -> Path:
    """A word-level tokenizer whose ids we control: "w<i>" -> i, eos = the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{vocab_size - 1}"}))
    return path


def _read_shard(out: Path):
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.fromfile(out / "tokens.bin", dtype=meta["dtype"])
    offsets = np.load(out / "offsets.npy")
    return meta, tokens, offsets


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_token_dtype_boundary():
    # ids run 0..vocab_size-1 and uint16 holds 0..65535.
    assert token_dtype(1) == np.uint16
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert np.iinfo(token_dtype(65536)).max == 65535


@pytest.mark.parametrize("vocab_size,dtype", [(65536, "uint16"), (65537, "uint32")])
def test_real_prepare_dtype_keeps_largest_id(tmp_path, vocab_size, dtype):
    tok = _wordlevel_tokenizer(tmp_path / "tok", vocab_size)
    top = vocab_size - 2  # largest non-eos id: 65534 or 65535
    (tmp_path / "a.txt").write_text(f"w1 w{top} w65535 w7")
    meta = prepare([str(tmp_path / "a.txt")], tmp_path / "out", tok, workers=1)
    assert meta["dtype"] == dtype and meta["vocab_size"] == vocab_size
    _, tokens, _ = _read_shard(tmp_path / "out")
    assert tokens.tolist() == [1, top, 65535, 7, vocab_size - 1]  # nothing wrapped around


def test_many_inputs_dir_glob_jsonl(tmp_path, small_tok):
    src = tmp_path / "src"
    (src / "docs" / "sub").mkdir(parents=True)
    (src / "docs" / ".hidden").mkdir()
    (src / "docs" / "a.txt").write_text("alpha text\n")
    (src / "docs" / "b.md").write_text("# beta\n")
    (src / "docs" / "sub" / "c.py").write_text("print('gamma')\n")
    (src / "docs" / "skip.bin").write_text("not taken: wrong suffix")
    (src / "docs" / ".hidden" / "h.txt").write_text("not taken: hidden")
    (src / "docs" / "empty.txt").write_text("")
    (src / "more").mkdir()
    (src / "more" / "m1.txt").write_text("delta one")
    (src / "more" / "m2.txt").write_text("delta two")
    records = [{"body": "first record", "id": 1}, {"body": ""}, {"body": "third ✓", "x": [1]}]
    (src / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")

    inputs = [str(src / "docs"), str(src / "more" / "*.txt"), str(src / "data.jsonl"),
              str(src / "docs" / "a.txt")]  # a.txt twice: deduplicated
    meta = prepare(inputs, tmp_path / "out", small_tok, text_field="body", workers=2)

    # Sorted absolute paths: data.jsonl, docs/{a.txt,b.md,empty.txt,sub/c.py}, more/{m1,m2}.txt
    expected_docs = ["first record", "third ✓", "alpha text\n", "# beta\n", "print('gamma')\n",
                     "delta one", "delta two"]
    assert meta["sources"] == 7
    assert meta["num_documents"] == len(expected_docs)
    assert meta["num_skipped_empty"] == 2  # the empty JSONL record and empty.txt

    meta2, tokens, offsets = _read_shard(tmp_path / "out")
    assert meta2 == meta
    backend = load_backend_tokenizer(small_tok)
    eos = backend.token_to_id("<|endoftext|>")
    assert meta["eos_id"] == eos
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(small_tok)
    assert meta["tokenizer_dir"] == str(small_tok.absolute())
    assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == meta["num_tokens"] == tokens.size
    assert len(offsets) == meta["num_documents"] + 1
    for d, text in enumerate(expected_docs):
        doc = tokens[offsets[d]:offsets[d + 1]].tolist()
        assert doc[-1] == eos and eos not in doc[:-1]
        assert backend.decode(doc[:-1]) == text


def test_worker_count_does_not_change_output(tmp_path, small_tok, monkeypatch):
    files = [str(p) for _, p in corpus_files()[:30]]
    # Force many small chunks so that two workers really interleave their work.
    monkeypatch.setattr(prep, "_MIN_CHUNK_BYTES", 1)
    assert len(prep._chunk([Path(f) for f in files], 2)) > 4
    m1 = prepare(files, tmp_path / "w1", small_tok, workers=1)
    m2 = prepare(files, tmp_path / "w2", small_tok, workers=2)
    assert m1 == m2
    for name in ("tokens.bin", "offsets.npy", "meta.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    assert m1["num_documents"] == 30


def test_prepare_from_a_script_without_a_main_guard(tmp_path, small_tok):
    """A notebook or a short script has no ``if __name__ == "__main__":`` guard. Preparing data from it (what
    ``fit`` does on a fresh cache) must neither re-run the script nor die (a spawn process pool did both)."""
    files = [str(p) for _, p in corpus_files()[:30]]
    (tmp_path / "script.py").write_text(
        "from treadle.data import prepare as prep\n"
        "print('script body ran', flush=True)\n"
        "prep._MIN_CHUNK_BYTES = 1  # many chunks, so that both workers get some\n"
        f"meta = prep.prepare({files!r}, 'out', {str(small_tok)!r}, workers=2)\n"
        "print('documents', meta['num_documents'])\n")
    proc = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("script body ran") == 1, proc.stdout  # the user's main module ran once, in its process
    assert "documents 30" in proc.stdout
    assert _read_shard(tmp_path / "out")[0]["num_documents"] == 30


def test_no_eos(tmp_path, small_tok):
    (tmp_path / "a.txt").write_text("x = 1\n")
    (tmp_path / "b.txt").write_text("y = 2\n")
    meta = prepare([str(tmp_path / "*.txt")], tmp_path / "out", small_tok, workers=1, append_eos=False)
    _, tokens, offsets = _read_shard(tmp_path / "out")
    backend = load_backend_tokenizer(small_tok)
    expected = backend.encode("x = 1\n").ids + backend.encode("y = 2\n").ids
    assert tokens.tolist() == expected
    assert offsets.tolist() == [0, len(backend.encode("x = 1\n").ids), len(expected)]
    assert meta["append_eos"] is False


@pytest.mark.parametrize("line,needle", [
    ('{"text": "ok"', "malformed JSON"),
    ('{"other": "x"}', "field 'text' is missing"),
    ('{"text": 3}', "field 'text' is int"),
    ('["text"]', "not a JSON object"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, small_tok, line, needle):
    bad = tmp_path / "in" / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(UserError) as info:
        prepare([str(bad)], tmp_path / "out", small_tok, workers=1)
    msg = str(info.value)
    assert f"{bad}:3" in msg and needle in msg and "'text'" in msg
    assert "\n" not in msg
    # Nothing was created: no output, no temporary directory left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_existing_output_is_never_damaged(tmp_path, small_tok):
    (tmp_path / "a.txt").write_text("first = 1\n")
    (tmp_path / "b.txt").write_text("second = 2\n")
    out = tmp_path / "out"
    prepare([str(tmp_path / "a.txt")], out, small_tok, workers=1)
    before = _snapshot(out)

    with pytest.raises(UserError, match="not empty.*--overwrite"):
        prepare([str(tmp_path / "b.txt")], out, small_tok, workers=1)
    assert _snapshot(out) == before

    # A failure part-way (bad input found by a worker) with --overwrite keeps the old output too.
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(UserError, match="bad.jsonl:1"):
        prepare([str(tmp_path / "bad.jsonl")], out, small_tok, workers=1, overwrite=True)
    assert _snapshot(out) == before

    meta = prepare([str(tmp_path / "b.txt")], out, small_tok, workers=1, overwrite=True)
    assert _snapshot(out) != before and meta["num_documents"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]

    # --overwrite only ever replaces a shard directory, never some other directory.
    other = tmp_path / "precious"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    with pytest.raises(UserError, match="holds thesis.tex and is not treadle"):
        prepare([str(tmp_path / "a.txt")], other, small_tok, workers=1, overwrite=True)
    assert (other / "thesis.tex").read_text() == "years of work"


def test_overwrite_replaces_only_what_prepare_wrote(tmp_path, small_tok):
    """The marker lists every file prepare wrote; a file added since (or a shard dir without the marker
    holding other files) keeps --overwrite from deleting anything."""
    (tmp_path / "a.txt").write_text("first = 1\n")
    out = tmp_path / "out"
    prepare([str(tmp_path / "a.txt")], out, small_tok, workers=1)
    marker = json.loads((out / ".treadle.json").read_text())
    assert marker["written_by"] == "treadle prepare" and marker["kind"] == "shards"
    assert sorted(marker["files"]) == ["meta.json", "offsets.npy", "tokens.bin"]
    assert marker["files"]["tokens.bin"] == (out / "tokens.bin").stat().st_size

    (out / "thesis.txt").write_text("mine")  # meta.json is still there: the old rule wiped this directory
    before = _snapshot(out)
    with pytest.raises(UserError, match="holds thesis.txt, which treadle did not write"):
        prepare([str(tmp_path / "a.txt")], out, small_tok, workers=1, overwrite=True)
    assert _snapshot(out) == before
    (out / "thesis.txt").unlink()

    # A shard directory from before the marker (shard files only) is still treadle's own.
    (out / ".treadle.json").unlink()
    prepare([str(tmp_path / "a.txt")], out, small_tok, workers=1, overwrite=True)
    assert (out / ".treadle.json").is_file()
    # A file where a directory goes: refused, kept, no hidden copy beside it.
    thesis = tmp_path / "thesis.txt"
    thesis.write_text("mine")
    with pytest.raises(UserError, match="is a file"):
        prepare([str(tmp_path / "a.txt")], thesis, small_tok, workers=1, overwrite=True)
    assert thesis.read_text() == "mine" and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_inputs_that_match_nothing(tmp_path, small_tok):
    (tmp_path / "empty_dir").mkdir()
    cases = {
        str(tmp_path / "missing.txt"): "no such file",
        str(tmp_path / "nothing-*.jsonl"): "matches no files",
        str(tmp_path / "empty_dir"): "holds no files",
    }
    for spec, needle in cases.items():
        with pytest.raises(UserError, match=needle):
            prepare([spec], tmp_path / "out", small_tok, workers=1)
    assert not (tmp_path / "out").exists()


def test_bad_outputs_and_inputs(tmp_path, small_tok):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "blocker").write_text("a file, not a directory")
    with pytest.raises(UserError, match="cannot write"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "blocker" / "out", small_tok, workers=1)
    with pytest.raises(UserError, match="not a directory"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "blocker", small_tok, workers=1)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt:1: not UTF-8 \(byte 0xe9 at byte 4 of the line\)"):
        prepare([str(tmp_path / "latin1.txt")], tmp_path / "out", small_tok, workers=1)
    with pytest.raises(UserError, match="no such directory"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", tmp_path / "no-tokenizer", workers=1)
    assert (tmp_path / "blocker").read_text() == "a file, not a directory"
    assert not (tmp_path / "out").exists()


def test_eos_lookup_matches_transformers(small_tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(small_tok)
    vocab_size, eos_id, fp = prep._load_tokenizer_info(small_tok)
    assert (vocab_size, eos_id, fp) == (len(hf), hf.eos_token_id, tokenizer_fingerprint(hf))


def test_cli_entry(tmp_path, small_tok, capsys):
    (tmp_path / "a.jsonl").write_text('{"content": "one"}\n{"content": "two"}\n')
    parser = argparse.ArgumentParser()
    prep.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"), "--tokenizer",
                              str(small_tok), "--text-field", "content", "--workers", "1", "--no-eos"])
    assert prep.run(args) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "2 documents" in line and "uint16" in line and str(tmp_path / "out") in line
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["num_documents"] == 2 and meta["append_eos"] is False


def test_meta_records_the_largest_token_id(tmp_path):
    tok = _wordlevel_tokenizer(tmp_path / "tok", 50)
    (tmp_path / "a.txt").write_text("w3 w17 w2")
    (tmp_path / "b.txt").write_text("w5")
    assert prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tmp_path / "out", tok, workers=1,
                   append_eos=False)["max_token_id"] == 17
    assert prepare([str(tmp_path / "b.txt")], tmp_path / "out2", tok, workers=1)["max_token_id"] == 49  # the eos
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["max_token_id"] == 17


def test_jsonl_rows_with_line_separators_stay_whole(tmp_path, small_tok):
    """Hole 10a: U+2028, U+2029 and U+0085 are legal raw inside JSON strings; str.splitlines cut rows there."""
    texts = ["a\u2028b = 1\n", "c\u2029d\x85e\n", "plain\n"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
                                         encoding="utf-8")
    meta = prepare([str(tmp_path / "rows.jsonl")], tmp_path / "out", small_tok, workers=1, append_eos=False)
    _, tokens, offsets = _read_shard(tmp_path / "out")
    assert meta["num_documents"] == len(texts)
    backend = load_backend_tokenizer(small_tok)
    assert [backend.decode(tokens[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])] == texts


def test_special_token_text_in_a_document_is_plain_text(tmp_path, small_tok):
    """Hole 10b: a document quoting "<|endoftext|>" keeps those characters; the eos goes only at its end."""
    text = 'SEP = "<|endoftext|>"\nprint(SEP)\n'
    (tmp_path / "a.py").write_text(text)
    meta = prepare([str(tmp_path / "a.py")], tmp_path / "out", small_tok, workers=1)
    _, tokens, offsets = _read_shard(tmp_path / "out")
    eos = meta["eos_id"]
    assert offsets.tolist() == [0, len(tokens)] and tokens.tolist().count(eos) == 1 and tokens[-1] == eos
    assert load_backend_tokenizer(small_tok).decode(tokens[:-1].tolist(), skip_special_tokens=False) == text


def test_non_utf8_jsonl_line_is_named(tmp_path, small_tok):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(UserError, match=rf"{bad}:3: not UTF-8 \(byte 0xe9 at byte 14 of the line\)"):
        prepare([str(bad)], tmp_path / "out", small_tok, workers=1)


def test_sft_rows_are_sent_to_training_not_to_prepare(tmp_path, small_tok):
    """Issue 13.8: prepare makes pre-training shards; an SFT file is trained from directly, and the line says so."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                    + "\n")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    for path, kind in ((chat, "messages"), (pairs, "prompt/completion")):
        with pytest.raises(UserError, match=rf"{path}:1: an SFT row \({kind}\).*trained from directly.*"
                                            rf'data.train = \["{path}"\]'):
            prepare([str(path)], tmp_path / "out", small_tok, workers=1)
        assert not (tmp_path / "out").exists()
    # A chosen field that the rows hold is text to prepare, SFT-shaped or not.
    assert prepare([str(pairs)], tmp_path / "out", small_tok, workers=1, text_field="prompt")["num_documents"] == 1
