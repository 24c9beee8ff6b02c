"""``treadle generate``: resumable, strictly accounted generation with a real tiny Llama (no mocks)."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.preloaded import Forked
from treadle.data import generate, generation_batches
from treadle.cli import main
from treadle.data.sft import encode_prompt, load_tokenizer
from treadle.model_dirs import model_fingerprint
from treadle.models.hf import load_causal_lm
from treadle.speculative.decode import target_generate

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
NEW = 48
SUMMARY = re.compile(r"^generate: (\d+) input rows: (\d+) succeeded, (\d+) failed, (\d+) skipped \(already in .*?\)"
                     r"(?:, (\d+) not reached \(interrupted; run again to continue\))?$")

GOOD = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    if i % 2:",
    "with open(path) as f:\n    for line in f:\n        yield line.",
    "try:\n    import json\nexcept ImportError:\n    json = None\n",
    "x",
    "# Copyright (c) Python Software Foundation.\n\"\"\"Utilities for",
    "async def fetch(session, url):\n    async with session.get(url) as response:\n        return await",
    "raise ValueError(f\"bad value {value!r}\")",
    "s = 'line\u2028separator\x85inside'  # str.splitlines would cut this JSON line",
]
CONVERSATION = {"messages": [{"role": "system", "content": "You write Python."},
                             {"role": "user", "content": "Sort a list in place."},
                             {"role": "assistant", "content": "an old answer, to be replaced"}], "id": "chat-1"}
# (line text, expected failure reason prefix) for the rows that cannot be generated
BAD = {
    "invalid": ('{"prompt": "unterminated', "not valid JSON"),
    "no_prompt": ('{"text": "a document, not a prompt"}', "missing 'messages' or 'prompt'"),
    "too_long": (json.dumps({"prompt": "x = 1\n" * 400}), "prompt of "),
}


def write_prompts(path: Path) -> dict:
    """The prompts file: good rows with bad ones and blank lines between them; index -> (line, kind)."""
    lines, layout = [], {}

    def add(text, kind):
        layout[len(layout)] = (len(lines) + 1, kind)
        lines.append(text)

    for i, prompt in enumerate(GOOD):
        add(json.dumps({"prompt": prompt, "completion": "stale", "source": f"row-{i}"}, ensure_ascii=False), "good")
        if i == 2:
            add(BAD["invalid"][0], "invalid")
            lines.append("")  # blank: not a row, not counted
        if i == 5:
            add(BAD["no_prompt"][0], "no_prompt")
            add(json.dumps(CONVERSATION), "good")
        if i == 7:
            lines.append("   ")
            add(BAD["too_long"][0], "too_long")
    path.write_text("\n".join(lines) + "\n\n")
    return layout


def argv(model, prompts, out, *extra):
    return ["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", str(NEW), "--batch-size", "2", "--device", "cpu", *extra]


def summary(text: str) -> tuple[int, ...]:
    lines = [line for line in text.splitlines() if line.startswith("generate:")]
    assert len(lines) == 1, text
    match = SUMMARY.match(lines[0])
    assert match, lines[0]
    return tuple(int(g or 0) for g in match.groups())


def out_rows(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().split("\n") if line]
    by_index = {r["index"]: r for r in rows}
    assert len(by_index) == len(rows), "an index appears twice"
    return by_index


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    return path, write_prompts(path)


@pytest.fixture(scope="module")
def reference(target_dir, prompts, tmp_path_factory):
    """An uninterrupted run's output, by index."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    assert main(argv(target_dir, prompts[0], out)) == 1  # some rows fail
    return out_rows(out)


def test_interrupted_run_resumes_with_complete_accounting(target_dir, prompts, reference, tmp_path, capsys):
    path, layout = prompts
    n = len(layout)
    good = {i for i, (_, kind) in layout.items() if kind == "good"}
    out = tmp_path / "out.jsonl"

    # A real SIGTERM to a real run, as soon as its first batch is on disk.
    # (a process of its own, forked from one that has imported treadle: tests/preloaded.py)
    proc = Forked(argv(target_dir, path, out), {**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    deadline = time.monotonic() + 60
    while not (out.exists() and b"\n" in out.read_bytes()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    total, ok, failed, skipped, not_reached = summary(stdout)
    assert (total, failed, skipped) == (n, len(BAD), 0)
    assert not_reached > 0, "the run finished before SIGTERM arrived: give it more work"
    assert ok + failed + skipped + not_reached == n
    assert len(out_rows(out)) == ok

    # A crash mid-write leaves a torn last line: it is cut, and its row generated again.
    with open(out, "a") as f:
        f.write('{"prompt": "def add(a, b):\\n    return", "completion": "tor')

    capsys.readouterr()
    code = main(argv(target_dir, path, out))
    captured = capsys.readouterr()
    assert code == 1  # failed rows
    total2, ok2, failed2, skipped2, not_reached2 = summary(captured.out)
    assert (total2, failed2, skipped2, not_reached2) == (n, len(BAD), ok, 0)
    assert ok2 + skipped2 + failed2 == n
    assert "torn last line" in captured.err

    # Every good row exactly once, equal to the uninterrupted run (greedy is deterministic across a resume).
    rows = out_rows(out)
    assert set(rows) == good
    assert len(out.read_text().splitlines()) == len(rows)  # no raw U+2028 / U+0085 for naive readers
    assert rows == reference

    failures = [json.loads(line) for line in Path(f"{out}.failed.jsonl").read_text().splitlines()]
    expected = {i: (line, BAD[kind][1]) for i, (line, kind) in layout.items() if kind != "good"}
    assert {f["index"]: f["line"] for f in failures} == {i: line for i, (line, _) in expected.items()}
    for f in failures:
        assert f["reason"].startswith(expected[f["index"]][1]), f
    too_long = next(f for f in failures if layout[f["index"]][1] == "too_long")
    assert "exceeds the model's context of 512 tokens minus --max-new-tokens 48" in too_long["reason"]

    # A finished file: everything is skipped and nothing changes.
    before = out.read_bytes()
    assert main(argv(target_dir, path, out)) == 1
    assert summary(capsys.readouterr().out) == (n, 0, len(BAD), len(good), 0)
    assert out.read_bytes() == before


def test_greedy_rows_are_the_models_own_continuation(target_dir, prompts, reference):
    path, layout = prompts
    tokenizer = load_tokenizer(target_dir)
    model = load_causal_lm(target_dir, "--model")
    lines = path.read_text().split("\n")
    for index, row in reference.items():
        source = json.loads(lines[layout[index][0] - 1])
        tokens, _ = target_generate(model, torch.tensor([encode_prompt(tokenizer, source)]), NEW,
                                    tokenizer.eos_token_id)
        ends_at_eos = tokens[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(tokens[:-1] if ends_at_eos else tokens, skip_special_tokens=True)
        assert row["finish"] == ("eos" if ends_at_eos else "length")
        if "messages" in source:
            assert row["messages"] == source["messages"][:2] + [{"role": "assistant", "content": text}]
            assert row["id"] == "chat-1"
        else:
            assert row == {**source, "completion": text, "index": index, "finish": row["finish"]}


def test_sampling_is_per_row_reproducible_and_bounded(target_dir, tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": GOOD[0]}, CONVERSATION, {"messages": [{"role": "user", "content": "Hi"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7", "--max-new-tokens", "6"]
    outs = []
    for name, batch_size in (("a", "2"), ("b", "2")):
        out = tmp_path / f"{name}.jsonl"
        assert main(argv(target_dir, path, out, *sampled, "--batch-size", batch_size)) == 0
        assert summary(capsys.readouterr().out) == (3, 3, 0, 0, 0)
        outs.append(out_rows(out))
    assert outs[0] == outs[1]  # same seed, same rows
    greedy = tmp_path / "greedy.jsonl"
    assert main(argv(target_dir, path, greedy, "--max-new-tokens", "6")) == 0
    assert out_rows(greedy) != outs[0]
    chat = outs[0][1]["messages"]
    assert chat[:2] == CONVERSATION["messages"][:2] and chat[2]["role"] == "assistant" and len(chat) == 3
    assert outs[0][2]["messages"][-1]["role"] == "assistant"

    # Token level: at most max_new_tokens, and a row draws the same tokens alone as in a batch.
    tokenizer = load_tokenizer(target_dir)
    model = load_causal_lm(target_dir, "--model")
    ids = [encode_prompt(tokenizer, r) for r in rows]
    settings = generation_batches.Settings(max_new_tokens=6, temperature=0.9, top_p=0.95, seed=7, pad_id=0, eos_ids=[0],
                                  device=torch.device("cpu"))
    batch = generation_batches.generate_batch(model, settings, ids, [0, 1, 2], generation_batches.Stop())
    assert all(len(tokens) <= 6 for tokens, _ in batch)
    assert all(len(tokens) == 6 for tokens, finish in batch if finish == "length")
    assert generation_batches.generate_batch(model, settings, ids[1:2], [1], generation_batches.Stop()) == batch[1:2]
    other_seed = generation_batches.Settings(**{**settings.__dict__, "seed": 8})
    assert generation_batches.generate_batch(model, other_seed, ids, [0, 1, 2], generation_batches.Stop()) != batch


def test_a_row_that_breaks_generation_fails_alone(target_dir, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import TARGET

    # A model with fewer embeddings than its tokenizer has tokens: a prompt using the high ids cannot be
    # embedded, so its batch raises; retried row by row, only that row fails.
    model = tmp_path / "small-vocab"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TARGET, "vocab_size": 257})).save_pretrained(model)
    load_tokenizer(target_dir).save_pretrained(model)
    path, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["x", "import os", "y z"]))
    assert main(argv(model, path, out, "--batch-size", "4", "--max-new-tokens", "4")) == 1
    assert summary(capsys.readouterr().out) == (3, 2, 1, 0, 0)
    assert set(out_rows(out)) == {0, 2}
    (failure,) = [json.loads(line) for line in Path(f"{out}.failed.jsonl").read_text().splitlines()]
    assert failure["index"] == 1 and failure["line"] == 2 and failure["reason"].startswith("generation failed: ")


def test_settings_are_recorded_beside_the_output(target_dir, tmp_path, capsys):
    """Hole 10c: the flags that shape a row are recorded before the first batch and must match on resume;
    --batch-size may change, and an output with no rows yet takes new flags."""
    path, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["x", "import os", "y z"]))
    assert main(argv(target_dir, path, out, "--max-new-tokens", "3")) == 0
    capsys.readouterr()
    record = json.loads(Path(f"{out}.settings.json").read_text())
    assert record["written_by"] == "treadle generate"
    settings = record["settings"]
    assert {k: settings[k] for k in ("max_new_tokens", "temperature", "top_p", "seed", "chat_template",
                                     "max_prompt_tokens")} == {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0,
                                                               "seed": 0, "chat_template": "auto",
                                                               "max_prompt_tokens": None}
    assert settings["model"] == model_fingerprint(target_dir) and "batch_size" not in settings

    rows = out.read_bytes()
    assert main(argv(target_dir, path, out, "--max-new-tokens", "3", "--batch-size", "1")) == 0
    assert summary(capsys.readouterr().out) == (3, 0, 0, 3, 0) and out.read_bytes() == rows
    assert main(argv(target_dir, path, out, "--max-new-tokens", "4")) == 2
    assert "--max-new-tokens 3 -> 4" in capsys.readouterr().err and out.read_bytes() == rows

    out.write_bytes(b"")  # no rows yet: nothing to mix, new flags are recorded
    assert main(argv(target_dir, path, out, "--max-new-tokens", "4")) == 0
    assert json.loads(Path(f"{out}.settings.json").read_text())["settings"]["max_new_tokens"] == 4


@pytest.mark.parametrize("case", ["no_model_dir", "not_a_model", "no_prompts", "out_dir_missing", "temperature",
                                  "top_p_zero", "top_p_big", "batch_size", "damaged_out"])
def test_bad_input_is_one_line_and_touches_nothing(case, target_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    out = tmp_path / "out.jsonl"
    model, extra = target_dir, []
    if case == "no_model_dir":
        model = tmp_path / "missing"
    elif case == "not_a_model":
        model = tmp_path / "empty"
        model.mkdir()
    elif case == "no_prompts":
        prompts = tmp_path / "missing.jsonl"
    elif case == "out_dir_missing":
        out = tmp_path / "missing" / "out.jsonl"
    elif case == "damaged_out":
        out.write_text('{"index": 0, "prompt": "x"\n{"index": 0}\n')
    extra = {"temperature": ["--temperature", "-0.5"], "top_p_zero": ["--top-p", "0"],
             "top_p_big": ["--top-p", "1.5"], "batch_size": ["--batch-size", "0"]}.get(case, [])
    before = out.read_bytes() if out.exists() else None
    assert main(argv(model, prompts, out, *extra)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("treadle: error: "), captured.err
    assert (out.read_bytes() if out.exists() else None) == before
    assert not Path(f"{out}.failed.jsonl").exists()
