"""Supervised fine-tuning rows -> token ids and a loss mask.

An SFT data set is JSONL, one object per line, in one of two shapes:

* ``{"prompt": str, "completion": str}``
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``

(a row with ``"messages"`` is read as a conversation even if it also has
``"prompt"``). ``encode_sft`` turns a row into ``ids`` and ``mask`` of the same
length; ``mask[i] == 1`` means token ``i`` is a *target*: the model's
prediction of it (from tokens ``0..i-1``) carries loss. Nothing is truncated
here; sequence-length policies are applied by the data set.

**prompt / completion.** ``ids = encode(prompt) + encode(completion) + [eos]``.
The two texts are encoded separately, without the tokenizer's own special
tokens (no BOS is added even if the tokenizer has one), so the boundary is
exact. The prompt gets mask 0; the completion and the eos get mask 1. No chat
template is applied to these rows, whatever the tokenizer.

**messages.** Loss is on the assistant messages only: their content and the
token(s) that end each assistant turn. System and user text, and every role
header, get mask 0. Messages after the last assistant message are kept (mask
0); a conversation without an assistant message is rejected. Two renderings,
chosen by ``template``:

* ``"auto"`` (default): the tokenizer's own chat template if it has one, else
  the built-in template.
* ``"builtin"``: always the built-in template.

The built-in template renders each message as ``<|ROLE|>\\n`` + content + end,
where end is the eos token for an assistant message and ``\\n`` for the others
(see ``describe_builtin_template``); the generation prompt is ``<|assistant|>\\n``.
It is a Jinja chat template (``BUILTIN_CHAT_TEMPLATE``), rendered and tokenized like
a tokenizer's own, so an exported tokenizer that carries it (``chat_template_text``)
gives ``apply_chat_template`` exactly the ids training saw. With treadle's built-in
tokenizer the role markers are plain text (its only special token is
``<|endoftext|>``, the eos).

**Special-token text in content is plain text.** A message, prompt or completion
that contains the text of a special token (``<|endoftext|>``, a template's
``<|im_end|>``) is encoded as the ordinary characters of that text, never as the
control token: user data cannot end an answer or open a turn. The template's own
markup keeps its special tokens (``encode_text`` for content, ``_encode_rendering``
for a template's rendering). (``apply_chat_template`` itself matches such text as
the control token: only there can its ids differ from training's.)

With either template, the whole conversation is rendered to text
with ``apply_chat_template`` and tokenized once. The character span of
assistant message ``i`` runs from the end of the rendering of messages
``[:i]`` *with* the generation prompt (so the assistant header is outside it)
to the end of the rendering of messages ``[:i+1]``, so it covers the content
and the template's end-of-turn markup. A token is a target if it starts inside
such a span. This relies on each shorter rendering being a prefix of the
longer one; templates that rewrite earlier turns break that and are reported
(use ``data.chat_template = "builtin"`` for them).

``encode_prompt`` gives the ids a model should continue for generation: a
``prompt`` row's prompt, or a conversation up to (not including) its trailing
assistant message(s), followed by the assistant header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle.errors import UserError, first_line

BUILTIN_TEMPLATE_NAME = "builtin"
AUTO_TEMPLATE_NAME = "auto"
ROLES = ("system", "user", "assistant")

# The built-in template, as Jinja so that an export can carry it (tokenizer_config / chat_template.jinja) and
# transformers, vLLM or TGI render exactly what training saw. Whitespace control ("-") everywhere: the text is
# only what the expressions print, whatever the Jinja environment's trim settings.
BUILTIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
_BUILTIN_GENERATION_PROMPT = "<|assistant|>\n"


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer(tokenizer_dir: str | Path):
    """A fast tokenizer from a Hugging Face tokenizer directory ('builtin': treadle's own).

    Raises ``UserError`` (one line) if it cannot be loaded or is not a fast
    tokenizer: offsets, which the chat-template path needs, exist only there.
    """
    if str(tokenizer_dir) == BUILTIN_TEMPLATE_NAME:
        from treadle.corpus import builtin_tokenizer_dir

        tokenizer_dir = builtin_tokenizer_dir()
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise UserError(f"tokenizer {path}: no such directory (expected a Hugging Face tokenizer directory or 'builtin')")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types, with pages of text
        raise UserError(f"tokenizer {path}: cannot load it with AutoTokenizer ({first_line(e)})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"tokenizer {path}: only fast (tokenizers-backed) tokenizers are supported")
    return tokenizer


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def describe_builtin_template() -> str:
    return (
        "each message is rendered as '<|ROLE|>' + newline + content, followed by the eos token for an "
        "assistant message and by a newline for a system or user message (ROLE is system, user or "
        "assistant); loss is on assistant content and its eos; the generation prompt is '<|assistant|>' + newline"
    )


# --------------------------------------------------------------------------- row checks


def row_kind(row: dict) -> str | None:
    """"messages", "prompt_completion", "text" or None, by the keys present (in that order)."""
    if not isinstance(row, dict):
        return None
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "text" in row:
        return "text"
    return None


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return "'messages' is not a list"
    if not messages:
        return "'messages' is empty"
    for n, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            return f"message {n} is not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"message {n}: role {role!r} is not one of {'/'.join(ROLES)}"
        content = message.get("content")
        if not isinstance(content, str):
            return f"content of message {n} is not a string"
        if role == "assistant" and not content:
            return f"message {n}: empty assistant content"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message"
    return None


def check_row(row: Any) -> str | None:
    """None if ``row`` can be encoded for SFT, else a short reason."""
    if not isinstance(row, dict):
        return "row is not a JSON object"
    kind = row_kind(row)
    if kind == "messages":
        return _check_messages(row["messages"])
    if kind == "prompt_completion":
        if not isinstance(row["prompt"], str):
            return "'prompt' is not a string"
        if not isinstance(row["completion"], str):
            return "'completion' is not a string"
        if not row["completion"]:
            return "empty completion"
        return None
    if "prompt" in row:
        return "missing 'completion'"
    if kind == "text":
        # A plain document has no prompt/answer split to mask; it belongs in pretraining data.
        return "a 'text' row has no prompt to mask: SFT needs 'messages' or 'prompt'/'completion'"
    return "missing 'messages' or 'prompt'/'completion'"


def _checked(row: Any) -> None:
    reason = check_row(row)
    if reason is not None:
        raise ValueError(reason)


def _use_builtin(tokenizer, template: str) -> bool:
    if template == BUILTIN_TEMPLATE_NAME:
        return True
    if template == AUTO_TEMPLATE_NAME:
        return not has_chat_template(tokenizer)
    raise ValueError(f"unknown chat template {template!r}: expected '{AUTO_TEMPLATE_NAME}' or '{BUILTIN_TEMPLATE_NAME}'")


def chat_template_text(tokenizer, template: str) -> str:
    """The Jinja text conversations are rendered with under ``data.chat_template = template``: what an SFT
    source records and an export gives its tokenizer, so that it renders conversations as training did."""
    return BUILTIN_CHAT_TEMPLATE if _use_builtin(tokenizer, template) else tokenizer.chat_template


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of user text (a message, a prompt, a completion, a document) as plain text.

    The text of a special token in it ("<|endoftext|>", a template's "<|im_end|>") is encoded as the
    ordinary characters it is made of, never as the control token itself: data must not end a document
    or a turn where the template did not. ``split_special_tokens`` switches off matching of *special*
    added tokens only; the rest of the pipeline (normalizer, pre-tokenizer, model) is unchanged.
    """
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if text else []


def _eos_id(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        # A tokenizer problem, not a row problem: every row would fail the same way.
        raise UserError("the tokenizer has no eos token; SFT needs one to end each answer")
    return int(eos)


def _messages(row: dict) -> list[dict[str, str]]:
    # Only role and content reach a template: that is all check_row validated.
    return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]


# --------------------------------------------------------------------------- encoding


def encode_sft(tokenizer, row: dict, template: str = AUTO_TEMPLATE_NAME) -> tuple[list[int], list[int]]:
    """(ids, mask) for one SFT row; ``ValueError(reason)`` for a row that cannot be used."""
    jinja = chat_template_text(tokenizer, template)
    _checked(row)
    if row_kind(row) == "prompt_completion":
        return _encode_prompt_completion(tokenizer, row["prompt"], row["completion"])
    return _encode_chat_template(tokenizer, jinja, _messages(row))


def encode_prompt(tokenizer, row: dict, template: str = AUTO_TEMPLATE_NAME) -> list[int]:
    """Ids for generation: a row's prompt, or its conversation before the trailing assistant
    message(s) plus the assistant header. ``ValueError(reason)`` for an unusable row."""
    jinja = chat_template_text(tokenizer, template)
    if not isinstance(row, dict):
        raise ValueError("row is not a JSON object")
    if "messages" not in row:
        if "prompt" not in row:
            raise ValueError("missing 'messages' or 'prompt'")
        if not isinstance(row["prompt"], str):
            raise ValueError("'prompt' is not a string")
        return encode_text(tokenizer, row["prompt"])
    # A conversation to be answered need not contain an assistant message yet.
    reason = _check_messages(row["messages"])
    if reason is not None and reason != "no assistant message":
        raise ValueError(reason)
    messages = _messages(row)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise ValueError("nothing before the assistant's answer to use as a prompt")
    text = _render(tokenizer, jinja, messages, add_generation_prompt=True)
    return _encode_rendering(tokenizer, jinja, messages, text, add_generation_prompt=True)[0]


def _encode_prompt_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    prompt_ids = encode_text(tokenizer, prompt)
    target_ids = encode_text(tokenizer, completion) + [_eos_id(tokenizer)]
    return prompt_ids + target_ids, [0] * len(prompt_ids) + [1] * len(target_ids)


def _render(tokenizer, jinja: str, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=jinja, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors: templates often raise on shapes they do not support
        raise ValueError(f"the tokenizer's chat template cannot render this conversation ({first_line(e)})") from None
    if not isinstance(text, str):  # a batch (list) would mean we passed the wrong shape
        raise ValueError(f"the tokenizer's chat template rendered {type(text).__name__}, not text")
    return text


def _not_prefix(what: str) -> ValueError:
    return ValueError(
        f"the tokenizer's chat template is not prefix-stable ({what}), so assistant turns cannot be "
        f"located for the loss mask; set data.chat_template = \"{BUILTIN_TEMPLATE_NAME}\""
    )


def _assistant_spans(tokenizer, jinja: str, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant turn (content + end-of-turn markup) in ``full``."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i > 0:
            before = _render(tokenizer, jinja, messages[:i], add_generation_prompt=True)
        elif jinja == BUILTIN_CHAT_TEMPLATE:
            before = _BUILTIN_GENERATION_PROMPT  # transformers refuses to render zero messages
        else:
            # There is no rendering of zero messages to find where the header ends.
            raise ValueError("the conversation starts with an assistant message, which the tokenizer's chat "
                             f"template cannot locate; set data.chat_template = \"{BUILTIN_TEMPLATE_NAME}\" or add a user message")
        upto = full if i == len(messages) - 1 else _render(tokenizer, jinja, messages[: i + 1])
        if not full.startswith(upto):
            raise _not_prefix(f"messages 1..{i + 1} do not render as a prefix of the whole conversation")
        if not upto.startswith(before):
            raise _not_prefix(f"messages 1..{i} with the generation prompt are not a prefix of messages 1..{i + 1}")
        spans.append((len(before), len(upto)))
    return spans


def _encode_chat_template(tokenizer, jinja: str, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, jinja, messages)
    spans = _assistant_spans(tokenizer, jinja, messages, full)
    ids, offsets = _encode_rendering(tokenizer, jinja, messages, full)
    # A token straddling a span boundary counts where it starts.
    mask = [int(any(a <= start < b for a, b in spans)) for start, _end in offsets]
    return ids, mask


# --------------------------------------------------------------------------- special tokens in content


def _special_tokens(tokenizer) -> dict[int, str]:
    """id -> text of the tokenizer's special added tokens: those ``split_special_tokens`` leaves as text."""
    return {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def _content_spans(tokenizer, jinja: str, messages: list[dict[str, str]], full: str,
                   add_generation_prompt: bool) -> list[tuple[int, int]]:
    """Character spans [start, end) of every message's content in ``full``, its rendering.

    The conversation is rendered again with a placeholder for each content; filling the contents back in
    must give ``full`` exactly, which also proves the template neither edits nor repeats a content.
    """
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use characters: no template tests them
    skeleton = _render(tokenizer, jinja, [{"role": m["role"], "content": mark} for m, mark in zip(messages, marks)],
                       add_generation_prompt)
    spans, rebuilt, at, length = [], [], 0, 0
    for m, mark in zip(messages, marks):
        k = skeleton.find(mark, at)
        if k < 0:
            break
        rebuilt += [skeleton[at:k], m["content"]]
        length += k - at
        spans.append((length, length + len(m["content"])))
        length += len(m["content"])
        at = k + len(mark)
    if len(spans) != len(messages) or "".join(rebuilt) + skeleton[at:] != full:
        raise ValueError("a message contains the text of a special token, which must stay plain text, but the "
                         "tokenizer's chat template changes or repeats message contents, so they cannot be located; "
                         f"set data.chat_template = \"{BUILTIN_TEMPLATE_NAME}\" or remove that text")
    return spans


def _encode_rendering(tokenizer, jinja: str, messages: list[dict[str, str]], text: str,
                      add_generation_prompt: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, character offsets) of a rendered conversation: the template's special tokens are special, the
    messages' contents plain text (a user's "<|im_end|>" must not end the turn).

    The tokenizer splits text at special tokens before anything else, so the text between two of the
    template's own special tokens is encoded on its own either way. Encoding each such stretch with
    ``split_special_tokens`` gives exactly the ids the contents would have if their special-token text were
    ordinary text, and leaves every other token as it was.
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    special = _special_tokens(tokenizer)
    if not any(t in m["content"] for m in messages for t in special.values()):
        return ids, offsets  # nothing to protect (nearly every row): the plain rendering's encoding
    contents = _content_spans(tokenizer, jinja, messages, text, add_generation_prompt)
    out_ids: list[int] = []
    out_offsets: list[tuple[int, int]] = []

    def plain(lo: int, hi: int) -> None:
        if hi > lo:
            piece = tokenizer(text[lo:hi], add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
            out_ids.extend(piece["input_ids"])
            out_offsets.extend((a + lo, b + lo) for a, b in piece["offset_mapping"])

    cut = 0
    for i, (start, end) in zip(ids, offsets):
        if i in special and not any(a <= start < b for a, b in contents):  # the template's own: kept
            plain(cut, start)
            out_ids.append(i)
            out_offsets.append((start, end))
            cut = end
    plain(cut, len(text))
    return out_ids, out_offsets
