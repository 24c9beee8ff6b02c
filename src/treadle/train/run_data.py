"""The run's data, opened before anything is written: its sources (data files tokenized into the cache on first use),
their mixture and the validation set, checked to share one tokenizer; the tokenizer exported with the model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from treadle.config import Config, SourceConfig
from treadle.data.holdout import Interleaved
from treadle.data.mixture import Mixture, Phase
from treadle.data.packed import ExampleDataset, PackedDataset
from treadle.data.shards import read_meta
from treadle.data.sources import OpenedSource, file_tokenizer, open_source, resolve
from treadle.drafts.features.run import is_speculators_store, speculators_samples
from treadle.errors import UserError
from treadle.tokenizer import tokenizer_fingerprint


@dataclass
class RunData:
    """The run's opened sources, their mixture, and the validation set."""

    sources: list[OpenedSource]
    mixture: Mixture
    val: PackedDataset | ExampleDataset | Interleaved | None
    tokenizer_dir: Path | None  # exported with the model

    @property
    def train(self):  # the first source: what a single-source run trains on (its meta, vocab, tokenizer)
        return self.sources[0].dataset

    @property
    def chat_template(self) -> str | None:
        """The Jinja the SFT sources' conversations were rendered with (one data.chat_template, one tokenizer)."""
        return next((o.dataset.meta.get("chat_template_text") for o in self.sources if o.kind == "sft"), None)


def _recorded_tokenizer(shard_dir: Path) -> str | None:
    """The tokenizer a shard directory's meta.json names (a broken meta.json is one line naming it)."""
    return read_meta(shard_dir).get("tokenizer_dir")


def check_shard_token_ids(data: RunData, vocab_size: int) -> None:
    """Every shard's recorded largest token id is below the model's vocabulary, before anything is written.

    Shards without the record (older treadle, other tools) are checked by the loader, micro-batch by micro-batch.
    """
    datasets = [o.dataset for o in data.sources] + ([data.val] if data.val is not None else [])
    for shard in (s for ds in datasets for s in ds.shards):
        if shard.max_token_id is not None and shard.max_token_id >= vocab_size:
            raise UserError(
                f"shard directory {shard.path}: its largest token id is {shard.max_token_id} (meta.json max_token_id), "
                f"but the model's vocab_size is {vocab_size}; accepted: token ids below {vocab_size} (data tokenized "
                "with the model's tokenizer, or a model whose vocabulary covers them)"
            )


def open_data(cfg: Config) -> RunData:
    """Every source opened (data files tokenized into the cache on first use), checked to share one tokenizer; with
    speculators' offline data as ``draft.features``, that data alone (it holds its own tokens)."""
    d = cfg.data
    if is_speculators_store(cfg):
        train = speculators_samples(cfg)
        return RunData([OpenedSource("train", train, "speculators")], Mixture.single("train"), None,
                       train.tokenizer_dir)
    specs = d.sources or [SourceConfig(name="train", path=d.train)]
    key = (lambda i: f"data.sources[{i}] ({specs[i].name})") if d.sources else (lambda i: "data.train")
    paths = [resolve(s.path, "train", key(i)) for i, s in enumerate(specs)]  # (shard dirs, data files) each
    # Data files are tokenized with data.tokenizer, else the target's / model's, else the shards', else the built-in.
    recorded = next((_recorded_tokenizer(p) for dirs, _ in paths for p in dirs), None)
    frozen_target = cfg.draft.target if cfg.draft.frozen_target else None  # 'self' names no directory
    tokenizer = file_tokenizer(d.tokenizer, [frozen_target, cfg.model.path, recorded])
    opened = [open_source(s.name, s.path, "train", s.format, s.text_field, d.seq_len, d, tokenizer, key(i), paths[i],
                          d.val_fraction) for i, s in enumerate(specs)]
    if d.val_fraction:  # the sources' held-out documents replace data.val
        held = [o.held_out for o in opened]
        val = held[0] if len(held) == 1 else Interleaved(held)
    else:
        val = (open_source("val", d.val, "val", "auto", "text", d.seq_len, d, tokenizer, "data.val").dataset
               if d.val else None)
    first = opened[0].dataset
    for name, ds in [(o.name, o.dataset) for o in opened[1:]] + [("data.val", val)]:
        if ds is not None and ds.tokenizer_fingerprint != first.tokenizer_fingerprint:
            raise UserError(f"{name} was tokenized with another tokenizer (fingerprint {ds.tokenizer_fingerprint}) "
                            f"than {opened[0].name} ({first.tokenizer_fingerprint}); accepted: data of one tokenizer")
    base = [s.weight for s in specs]
    phases = [Phase(p.start_step, tuple(p.weights.get(s.name, w) for s, w in zip(specs, base)), p.lr_scale)
              for p in d.phases]
    mixture = Mixture([s.name for s in specs], base, phases, d.temperature)
    return RunData(opened, mixture, val, _tokenizer_dir(cfg, first))


def _tokenizer_dir(cfg: Config, train) -> Path | None:
    """The tokenizer exported with the model: the configured one, else the one the data was made with."""
    if cfg.data.tokenizer == "auto":
        recorded = Path(train.tokenizer_dir) if train.tokenizer_dir else None
        return recorded if recorded is not None and recorded.is_dir() else None
    path = Path(cfg.data.tokenizer)
    if tokenizer_fingerprint(path) != train.tokenizer_fingerprint:
        raise UserError(f"data.tokenizer {path} is not the tokenizer the training data was made with "
                        f"(fingerprint {train.tokenizer_fingerprint})")
    return path
