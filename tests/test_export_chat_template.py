"""An SFT run's export carries the chat template it trained with (issue 13.2): the exported tokenizer's
``apply_chat_template`` gives exactly the ids training saw, and its generation prompt is what ``treadle generate``
feeds the model. Both for the run's own ``hf/`` and for ``treadle export`` of a checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from tests.helpers import args
from treadle.cli import main
from treadle.data import sft

# Real conversations plus the whitespace that a piece-by-piece encoding tokenizes differently from one rendering
# (trailing spaces before a header, an answer that starts with blank lines).
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You write Python."},
                  {"role": "user", "content": f"Add {i} to x."},
                  {"role": "assistant", "content": f"x = x + {i}"}]} for i in range(24)
] + [
    {"messages": [{"role": "user", "content": "hi  "}, {"role": "assistant", "content": "\n\n x "},
                  {"role": "user", "content": "again\n"}, {"role": "assistant", "content": "ok"}]},
    {"messages": [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "fine"}]},
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _sft_run(shards, tmp_path, name: str, tokenizer, *extra: str, rows=CONVERSATIONS):
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in rows))
    run = tmp_path / name
    argv = [a for a in args(shards, run, "--train.max_steps=2") if not a.startswith(("--data.train=", "--data.val="))]
    assert main(argv + [f"--data.train={data}", "--data.val=[]", f"--data.tokenizer={tokenizer}", *extra]) == 0
    return run


def _ids(tokenizer, messages, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    return list(out)


def _assert_renders_as_training(exported, trained_with, template: str, rows=CONVERSATIONS) -> None:
    """``exported`` (an export's tokenizer) encodes every conversation as treadle did with ``trained_with``."""
    for c in rows:
        ids, _ = sft.encode_sft(trained_with, c, template=template)
        assert _ids(exported, c["messages"]) == ids
        if c["messages"][0]["role"] != "assistant":
            asked = {"messages": c["messages"][:-1]}
            assert _ids(exported, asked["messages"], add_generation_prompt=True) == \
                sft.encode_prompt(trained_with, asked, template=template)


def test_builtin_template_is_exported_by_the_run_and_by_treadle_export(shards, tmp_path):
    run = _sft_run(shards, tmp_path, "sft", shards / "tok")
    trained_with = sft.load_tokenizer(shards / "tok")
    assert not sft.has_chat_template(trained_with)  # so training used the built-in template
    assert (run / "hf" / "chat_template.jinja").read_text() == sft.BUILTIN_CHAT_TEMPLATE
    _assert_renders_as_training(AutoTokenizer.from_pretrained(run / "hf"), trained_with, "auto")
    out = tmp_path / "exported"
    assert main(["export", str(run / "checkpoints" / "step_2"), str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == sft.BUILTIN_CHAT_TEMPLATE
    _assert_renders_as_training(AutoTokenizer.from_pretrained(out), trained_with, "auto")


@pytest.fixture
def chatml_tok(shards, tmp_path):
    """The test BPE with <|im_start|>/<|im_end|> special tokens and its own ChatML template."""
    d = tmp_path / "chatml"
    shutil.copytree(shards / "tok", d)
    t = sft.load_tokenizer(d)
    t.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    t.chat_template = CHATML
    t.save_pretrained(d)
    return d


def test_a_tokenizers_own_template_is_kept_unless_training_forced_the_builtin(shards, tmp_path, chatml_tok):
    trained_with = sft.load_tokenizer(chatml_tok)
    forced = _sft_run(shards, tmp_path, "forced", chatml_tok, "--data.chat_template=builtin")
    exported = AutoTokenizer.from_pretrained(forced / "hf")
    assert exported.chat_template == sft.BUILTIN_CHAT_TEMPLATE  # the template training used, not the tokenizer's
    _assert_renders_as_training(exported, trained_with, "builtin")
    # A template's own rendering cannot locate an answer that opens the conversation: that row is left out.
    rows = [c for c in CONVERSATIONS if c["messages"][0]["role"] != "assistant"]
    own = _sft_run(shards, tmp_path, "own", chatml_tok, rows=rows)
    exported = AutoTokenizer.from_pretrained(own / "hf")
    assert exported.chat_template == CHATML
    _assert_renders_as_training(exported, trained_with, "auto", rows)
