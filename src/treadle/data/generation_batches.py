"""The batches of ``treadle generate``: left-padded ``model.generate`` with per-row seeded sampling.

Split from the command (``treadle.data.generate``) so that its flags, checks and ``--help`` load without torch
and transformers; see that module for what a row's output is and why batches are built this way.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from treadle.data.generation_files import Row, append_rows, output_row
from treadle.errors import first_line

if TYPE_CHECKING:
    from treadle.data.generate import GenerateReport

_PROGRESS_EVERY_S = 30.0


class Stop:
    """Set by SIGINT / SIGTERM; the batch in flight ends at its next decoding step and is discarded."""

    def __init__(self) -> None:
        self.signal: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None


@dataclass
class Settings:
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    pad_id: int
    eos_ids: list[int]
    device: torch.device


def row_seed(seed: int, index: int) -> int:
    """Row ``index``'s generator seed: distinct for every row of a run (up to 2**32 rows).

    torch's CPU generator keeps only the low 32 bits of a seed, so ``seed`` is
    folded in by an odd multiplier (a bijection mod 2**32), not by a shift.
    """
    return (seed * 0x9E3779B9 + index) % 2**32


class _RowGumbel(LogitsProcessor):
    """Adds Gumbel noise from one generator per row, seeded by (seed, index): argmax of the result is a
    draw from softmax(scores), and a row's draws do not depend on which rows share its batch."""

    def __init__(self, seed: int, indices: list[int], device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(row_seed(seed, i)) for i in indices]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # -log(Exp(1)) is Gumbel(0, 1); masked (-inf) scores stay -inf.
        noise = torch.stack([torch.empty(scores.shape[-1], device=scores.device, dtype=scores.dtype)
                             .exponential_(generator=g) for g in self.generators])
        return scores - noise.log()


class StopRequested(StoppingCriteria):
    """Ends every row of the batch at the next step once a stop is requested (the batch is then discarded)."""

    def __init__(self, stop: Stop) -> None:
        self.stop = stop

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.stop.requested, dtype=torch.bool, device=input_ids.device)


def _processors(settings: Settings, indices: list[int]) -> LogitsProcessorList | None:
    """None for greedy; else temperature, top-p, then the per-row noise that makes argmax a draw."""
    if settings.temperature == 0:
        return None
    warpers = [TemperatureLogitsWarper(settings.temperature)]
    if settings.top_p < 1:
        warpers.append(TopPLogitsWarper(settings.top_p))
    return LogitsProcessorList([*warpers, _RowGumbel(settings.seed, indices, settings.device)])


def generate_batch(model, settings: Settings, prompts: list[list[int]], indices: list[int],
                    stop: Stop) -> list[tuple[list[int], str]]:
    """Left-padded ``model.generate``: per row, (new tokens before the first end token, finish)."""
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), settings.pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, ids in enumerate(prompts):
        input_ids[r, width - len(ids):] = torch.tensor(ids)
        attention_mask[r, width - len(ids):] = 1
    config = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                              pad_token_id=settings.pad_id, eos_token_id=settings.eos_ids)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(settings.device), attention_mask=attention_mask.to(settings.device),
                             generation_config=config, logits_processor=_processors(settings, indices),
                             stopping_criteria=StoppingCriteriaList([StopRequested(stop)]))
    results = []
    for tokens in out[:, width:].tolist():
        ends = [k for k, t in enumerate(tokens) if t in settings.eos_ids]
        results.append((tokens[: ends[0]], "eos") if ends else (tokens, "length"))
    return results


def _batches(rows: list[Row], batch_size: int) -> list[list[Row]]:
    ready = sorted((r for r in rows if r.ids is not None), key=lambda r: (len(r.ids), r.index))
    return [ready[s : s + batch_size] for s in range(0, len(ready), batch_size)]


def _run_batch(model, tokenizer, settings: Settings, batch: list[Row], stop: Stop) -> list[dict] | None:
    """Output rows of one batch, without its failed rows (they get a reason); None when a stop cut it short."""

    def failed(row: Row, error: Exception) -> None:
        row.reason = f"generation failed: {first_line(error)}"

    try:
        results = generate_batch(model, settings, [r.ids for r in batch], [r.index for r in batch], stop)
    except Exception as e:
        if len(batch) == 1:
            failed(batch[0], e)
            return []
        # One bad row (or too big a batch) should not fail the others: each row alone.
        results = []
        for row in batch:
            if stop.requested:
                return None
            try:
                results += generate_batch(model, settings, [row.ids], [row.index], stop)
            except Exception as e:
                failed(row, e)
                results.append(None)
    if stop.requested:
        return None
    return [output_row(row, tokenizer.decode(res[0], skip_special_tokens=True), res[1])
            for row, res in zip(batch, results) if res is not None]


def generate_rows(model, tokenizer, rows: list[Row], done: set[int], settings: Settings, batch_size: int,
                  out: Path, report: GenerateReport, stop: Stop) -> None:
    """Generate every ready row not in ``done``, batch by batch, appending to ``out``; fills ``report``."""
    pending = {r.index for r in rows if r.ids is not None and r.index not in done}
    last_progress = time.monotonic()
    with open(out, "ab") as f:
        for batch in _batches(rows, batch_size):
            todo = [r for r in batch if r.index in pending]
            if not todo:
                continue
            if stop.requested:
                break
            produced = _run_batch(model, tokenizer, settings, batch, stop)
            if produced is None:
                break
            new = [r for r in produced if r["index"] in pending]
            if new:
                append_rows(f, sorted(new, key=lambda r: r["index"]))
            report.succeeded += len(new)
            pending -= {r.index for r in todo}
            if time.monotonic() - last_progress > _PROGRESS_EVERY_S:
                last_progress = time.monotonic()
                print(f"treadle: generate: {report.succeeded} rows written, {len(pending)} to go",
                      file=sys.stderr, flush=True)
