"""``treadle features CONFIG --out DIR``: run a draft run's frozen target once over its data and store what the draft
reads from it (drafts/features/store.py has the layout, drafts/features/run.py what a run does with it).

The run's config decides everything stored: the draft kind (what it reads), the target, the data and its packing
(the windows the run's loader will draw), ``train.micro_batch_size`` (rows per target forward) and ``model.dtype``
(bf16: the target runs under bf16 autocast, as the run's own forward would). Under torchrun the shards are spread
over the ranks (shard j on rank j mod world size). A killed command continues where it stopped when run again: a
shard that exists whole is kept, a torn one (its header says more bytes than the file has) and temporary files are
written again, and the files come out as an uninterrupted command writes them (the same rows per forward).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treadle import distributed
from treadle.drafts.features.run import data_settings, fingerprints, refuse_unstorable
from treadle.drafts.features.store import (DTYPES, FORMAT, MANIFEST, TOKEN_KEYS, VERSION, bytes_per_token,
                                           data_differences, encode, first_difference, shard_complete, shard_name,
                                           stored_settings)
from treadle.errors import UserError
from treadle.fsutil import fsync, write_atomic

SHARD_BYTES = 1 << 30  # the default shard size: about 1 GiB, few files and little memory per shard


@dataclass
class FeaturesReport:
    out: Path
    windows: int  # training and validation windows in the store
    written: int  # of those, written by this command (the rest were kept from an interrupted one)
    tokens: int
    bytes: int
    seconds: float

    def summary_line(self) -> str:
        per = self.bytes / max(self.tokens, 1)
        return (f"treadle: features: {self.windows:,} windows ({self.tokens:,} tokens), {self.written:,} written now "
                f"and {self.windows - self.written:,} kept; {self.bytes / 2**20:,.1f} MiB, {per:,.0f} bytes per token, "
                f"in {self.seconds:.1f} s; train from it with --draft.features={self.out}")


def _save(tensors: dict[str, torch.Tensor], path: Path) -> int:
    """``tensors`` as the safetensors file ``path``, whole or not at all (a temporary name, then a rename)."""
    from safetensors.torch import save

    data = save(tensors)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)
    return len(data)


def _claim(out: Path, manifest: dict) -> None:
    """Rank 0: ``out`` is empty, absent, or an earlier store of the same fingerprints (to continue); its temporary
    files are removed. Anything else is refused: a user's directory is never touched."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; accepted: a new or empty directory, or a store to continue")
    if out.is_dir() and any(out.iterdir()):
        try:
            old = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict) or old.get("format") != FORMAT:
            raise UserError(f"--out {out} holds files and is not a treadle feature store (no {MANIFEST} of format "
                            f"{FORMAT!r}); accepted: a new or empty directory")
        found = first_difference({k: old.get(k) for k in ("fingerprints", "dtype", "shard_samples", "reads")},
                                 {k: manifest[k] for k in ("fingerprints", "dtype", "shard_samples", "reads")})
        if found is not None:
            found, _ = data_differences(found.removeprefix("fingerprints."), stored_settings(old), manifest["settings"])
            raise UserError(f"--out {out} holds a feature store written for another run ({found}); accepted: the "
                            "same config, --dtype and --shard-samples to continue it, or another --out")
        for tmp in out.glob(".*.tmp"):
            tmp.unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / MANIFEST, json.dumps({**manifest, "complete": False}, indent=1) + "\n")


def _reads(model, rows: list[dict], autocast) -> dict[str, torch.Tensor]:
    ids = torch.stack([r["input_ids"] for r in rows]).to(model_device(model))
    pos = torch.stack([r["position_ids"] for r in rows]).to(ids.device)
    with torch.no_grad(), autocast():
        return model.target_reads(ids, pos)


def model_device(model) -> torch.device:
    return next(model.target.parameters()).device


def _write_shard(model, ds, split: str, j: int, n: int, micro: int, dtype: str, out: Path, autocast) -> int:
    rows = [ds[i] for i in range(j * n, min(len(ds), (j + 1) * n))]
    tensors = {k: torch.stack([r[k] for r in rows]).to(torch.int32) for k in TOKEN_KEYS}
    parts: dict[str, list[torch.Tensor]] = {}
    for s in range(0, len(rows), micro):
        for name, x in _reads(model, rows[s:s + micro], autocast).items():
            for key, t in encode(name, x.cpu(), dtype).items():
                parts.setdefault(key, []).append(t)
    tensors.update({k: torch.cat(v) for k, v in parts.items()})
    return _save(tensors, out / shard_name(split, j))


def write_features(cfg, out: Path, dtype: str = "bf16", shard_samples: int = 0, progress: bool = True) -> FeaturesReport:
    """Write the store of ``cfg``'s draft run to ``out`` (see the module docstring); every rank of a launch calls it."""
    from treadle.drafts.registry import build_draft
    from treadle.models.hf import greedy_continuations
    from treadle.train.draft import eval_prompts
    from treadle.train.run import checked_config, seed_everything
    from treadle.train.run_data import open_data

    cfg = checked_config(cfg)
    if not cfg.draft.kind:
        raise UserError("treadle features stores what a draft reads from its target: the config needs draft.kind "
                        "and draft.target (a draft run's config)")
    if cfg.draft.beside:
        raise UserError("treadle features with draft.target = 'self': a draft beside its target reads the target's "
                        "training forward of each step, never a store; accepted: a draft run's config (draft.target = "
                        "a frozen target's directory)")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    refuse_unstorable(cfg, "treadle features")
    out = Path(out)
    t0 = time.perf_counter()
    created = not torch.distributed.is_initialized()  # a group this call joins is left at its end
    info = distributed.init_distributed(cfg.train.device, num_threads=cfg.train.threads or None,
                                        timeout=datetime.timedelta(seconds=cfg.distributed.timeout_s))
    joined = info.world_size > 1
    try:
        seed_everything(cfg.train.seed)
        data = distributed.on_main(open_data, cfg) or open_data(cfg)
        live = cfg.draft.model_copy(update={"features": None})  # this command runs the target
        model, target_dir, identity = build_draft(live, data.train.vocab_size, data.train.tokenizer_fingerprint)
        model = model.to(info.device).eval()
        bf16 = cfg.model.dtype == "bf16"
        autocast = lambda: torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
        first = data.train[0]
        sample = _reads(model, [{k: v[:8] for k, v in first.items()}], autocast)
        reads = {name: list(x.shape[2:]) for name, x in sample.items()}
        seq_len = cfg.data.seq_len
        n = shard_samples or max(1, SHARD_BYTES // (bytes_per_token(reads, dtype) * seq_len))
        splits = {"train": data.train, **({"val": data.val} if data.val is not None else {})}
        manifest = {"format": FORMAT, "version": VERSION, "kind": cfg.draft.kind, "dtype": dtype,
                    "shard_samples": n, "seq_len": seq_len, "reads": reads, "target_dtype": "bf16" if bf16 else "fp32",
                    "fingerprints": fingerprints(cfg, model, target_dir, identity, data.train, data.val),
                    "settings": data_settings(cfg)}
        distributed.on_main(_claim, out, manifest)
        distributed.barrier()
        jobs = [(split, j) for split, ds in splits.items() for j in range(math.ceil(len(ds) / n))]
        mine = [job for k, job in enumerate(jobs) if k % info.world_size == info.rank]
        written, shown = 0, time.perf_counter()
        for done, (split, j) in enumerate(mine, 1):
            if shard_complete(out / shard_name(split, j)):
                continue
            _write_shard(model, splits[split], split, j, n, cfg.train.micro_batch_size, dtype, out, autocast)
            written += min(n, len(splits[split]) - j * n)
            if progress and info.is_main and (time.perf_counter() - shown > 10 or done == len(mine)):
                shown = time.perf_counter()
                print(f"treadle: features: {split} shard {j + 1} of {math.ceil(len(splits[split]) / n)} "
                      f"({done}/{len(mine)} on this rank, {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if joined:
            written = int(distributed.all_reduce_sum(torch.tensor([written], device=info.device), info.device)[0])
        distributed.barrier()
        if info.is_main:
            eval_file = out / "eval.safetensors"
            if not shard_complete(eval_file):
                prompts = eval_prompts(data.val or data.train, cfg.draft.eval_prompts, cfg.draft.eval_prompt_len)
                texts = greedy_continuations(model.target, prompts.to(info.device), cfg.draft.eval_new_tokens)
                got = _reads(model, [{"input_ids": t, "position_ids": torch.arange(len(t))} for t in texts], autocast)
                tensors = {"texts": texts.cpu()}
                for name, x in got.items():
                    tensors.update(encode(name, x.cpu(), dtype))
                _save(tensors, eval_file)
            manifest["splits"] = {
                split: {"samples": len(ds), "shards": [
                    {"file": shard_name(split, j), "first": j * n, "count": min(n, len(ds) - j * n),
                     "bytes": (out / shard_name(split, j)).stat().st_size} for j in range(math.ceil(len(ds) / n))]}
                for split, ds in splits.items()}
            manifest["eval"] = {"file": eval_file.name, "bytes": eval_file.stat().st_size}
            write_atomic(out / MANIFEST, json.dumps({**manifest, "complete": True}, indent=1) + "\n")
        windows = sum(len(ds) for ds in splits.values())
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        report = FeaturesReport(out, windows, written, windows * seq_len, size, time.perf_counter() - t0)
        distributed.barrier()
        return report
    finally:
        if created:
            distributed.destroy()
