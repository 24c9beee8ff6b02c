"""``treadle features``' command line, without torch: the CLI builds this parser and checks every path the config
names before train/features.py (which writes the store) and torch load, as `treadle train` does."""

from __future__ import annotations

import argparse

DTYPES = ("fp32", "bf16", "fp8")  # how a store holds its reads (store.py: the layout)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("treadle features [-h] [config.toml] [--section.key=value ...] --out DIR "
                    "[--dtype {fp32,bf16,fp8}] [--shard-samples N]")
    parser.description = ("Run a draft run's frozen target once over its data and store what the draft reads from "
                          "it; train from the store with --draft.features=DIR (the same config).")
    parser.add_argument("config", nargs="?", help="the draft run's TOML config")
    parser.add_argument("--out", required=True, help="the store directory (new, empty, or a store to continue)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="how reads are stored: fp32 (exact), bf16 (default: half of fp32; the draft's loss "
                             "unchanged within noise, docs/benchmarks.md), fp8 (e4m3, a scale per token: a quarter)")
    parser.add_argument("--shard-samples", type=int, default=0,
                        help="windows per shard file (default: about 1 GiB per shard)")
