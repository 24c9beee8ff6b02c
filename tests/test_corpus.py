"""The built-in corpus, its split, and the built-in tokenizer."""

import json
import os
import subprocess
import sys

import pytest

from treadle import corpus
from treadle.errors import UserError
from treadle.data.builtin import builtin_shards
from treadle.tokenizer import tokenizer_fingerprint
from treadle.corpus import (
    EOS_TOKEN,
    builtin_tokenizer_dir,
    cache_dir,
    corpus_files,
    split_of,
    train_tokenizer,
)

SNIPPET = 'def greet(name: str) -> str:\n    """Say hi."""\n    return f"héllo, {name} ✓"\t# tab\n\n'


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """A private TREADLE_CACHE for the whole session, so the full tokenizer trains once."""
    path = tmp_path_factory.mktemp("treadle-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREADLE_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def builtin_tok(session_cache):
    return builtin_tokenizer_dir()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TREADLE_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "treadle"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "treadle"


def test_corpus_files_and_split():
    files = corpus_files()
    rels = [rel for rel, _ in files]
    assert len(files) > 500
    assert rels == sorted(rels) and len(set(rels)) == len(rels)
    assert not any("site-packages" in r.split("/") or "__pycache__" in r for r in rels)
    assert all(path.is_absolute() and path.suffix == ".py" for _, path in files)

    splits = [split_of(r) for r in rels]
    val = splits.count("val")
    assert set(splits) == {"train", "val"}
    # 2% expected; with ~1,800 files the binomial sd is ~0.3%.
    assert 0.01 < val / len(rels) < 0.035
    # The fraction is honoured, not hard-wired.
    half = sum(split_of(r, 0.5) == "val" for r in rels) / len(rels)
    assert 0.45 < half < 0.55


def test_split_is_stable_across_processes():
    # A salted hash() would give a different split per process; sha256 must not.
    rels = [rel for rel, _ in corpus_files()][:300]
    code = "import sys, json; from treadle.corpus import split_of; print(json.dumps([split_of(r) for r in json.loads(sys.stdin.read())]))"
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], input=json.dumps(rels), capture_output=True,
                             text=True, env=env, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1] == [split_of(r) for r in rels]


def test_train_tokenizer_is_deterministic(tmp_path):
    files = [path for _, path in corpus_files()][:25]
    a = train_tokenizer(files, tmp_path / "a", vocab_size=600)
    b = train_tokenizer(files, tmp_path / "b", vocab_size=600)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    c = train_tokenizer(files, tmp_path / "c", vocab_size=700)
    assert tokenizer_fingerprint(c) != tokenizer_fingerprint(a)


def test_builtin_tokenizer_loads_and_roundtrips(builtin_tok, session_cache):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin_tok)
    assert len(tok) == 8192
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id is not None
    ids = tok.encode(SNIPPET, add_special_tokens=False)
    assert tok.decode(ids) == SNIPPET
    assert len(ids) < len(SNIPPET.encode()) / 2  # BPE actually merged something
    # The three ways of naming the same tokenizer agree.
    fp = tokenizer_fingerprint(builtin_tok)
    assert fp == tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok.backend_tokenizer)
    # Cached: the same directory comes back, and no temporary directory is left.
    assert builtin_tokenizer_dir() == builtin_tok
    assert builtin_tok.parent == session_cache
    assert not [p for p in session_cache.iterdir() if p.name.startswith(".tmp-")]


def test_builtin_val_shards(builtin_tok, session_cache):
    from treadle.data.packed import PackedDataset

    shards = builtin_shards("val", builtin_tok)
    meta = json.loads((shards / "meta.json").read_text())
    n_val = sum(split_of(rel) == "val" for rel, _ in corpus_files())
    assert meta["sources"] == n_val
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(builtin_tok)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 8192
    assert builtin_shards("val", builtin_tok) == shards  # second call hits the cache
    ds = PackedDataset([shards], seq_len=128)
    assert len(ds) == (meta["num_tokens"] - 1) // 128
    with pytest.raises(UserError, match="unknown corpus split"):
        builtin_shards("test", builtin_tok)


def test_publish_race_keeps_the_winner(tmp_path):
    final = tmp_path / "entry"
    final.mkdir()
    (final / "f").write_text("winner")
    tmp = tmp_path / ".tmp-entry-1"
    tmp.mkdir()
    (tmp / "f").write_text("loser")
    assert corpus._publish_dir(tmp, final) == final
    assert (final / "f").read_text() == "winner"
    assert not tmp.exists()
