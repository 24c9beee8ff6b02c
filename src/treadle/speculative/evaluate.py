"""``treadle spec-eval``: measure a drafter against a target with speculative decoding.

For each prompt the target decodes on its own (the baseline for tokens/s and,
greedy, the reference output) and speculatively with the drafter, as a chain of
``--gamma`` drafts or a ``--tree``, the two phases interleaved prompt by prompt
in alternating order and repeated ``--repeats`` times for the speeds: a load
that comes and goes slows both alike, and the spread of the per-repeat speedup
shows what remains (issue 48: 0.09x under load, 0.36x quiet, tau unchanged);
a line warns when the machine was loaded (``treadle/machine_load.py``). tau and
the lossless check come from the first pass. Greedy, the speculative output
must equal the reference token for token ("lossless"); otherwise the command
names the prompt and position and exits 1. Sampled (``--temperature`` > 0), outputs differ
run to run by design: speculative sampling keeps the target's distribution
(tests/test_spec_sampling.py checks it statistically) and only tau and speed are
reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING, Callable

from treadle import machine_load
from treadle.errors import UserError, first_line
from treadle.fsutil import claim_output, write_atomic
from treadle.model_dirs import resolve_model_dir
from treadle.speculative.draft_options import (
    check_draft_options,
    check_draft_spec,
    not_a_treadle_draft,
    tree_text,
)

# torch, the models and the decoders load when a function runs, not with the module: `spec-eval --help` and a
# bad flag answer at once.
if TYPE_CHECKING:
    import torch

    from treadle.speculative.tree import DynamicTree

    from treadle.machine_load import Given, Watch
    from treadle.speculative.decode import Drafter

_WARMUP_TOKENS = 4
REPEATS = 3  # --repeats' default: timed passes of both phases (a median and a spread)
# --dtype: the torch dtype of the decoding weights. bf16 means bf16 weights, not autocast: the engines a draft is
# exported for load its checkpoint at dtype bfloat16 and run every activation in it (docs/drafts.md, precision).
DTYPES = ("fp32", "bf16")
WRITTEN_BY = "treadle spec-eval"
_RESULT_KEYS = {"drafter", "tau", "lossless", "speedup"}  # a result written before it carried WRITTEN_BY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, metavar="DIR",
                        help="Hugging Face model directory, or a treadle run directory (its hf/ export)")
    parser.add_argument("--draft", required=True, metavar="prompt-lookup|DIR",
                        help="'prompt-lookup'; a treadle draft export (a draft run's draft/) or draft run directory; "
                             "or a Hugging Face causal-LM directory sharing the target's tokenizer")
    parser.add_argument("--adapter", type=Path, default=None, metavar="DIR",
                        help="a LoRA adapter of the --draft (a draft LoRA run's adapter/): the base draft with it "
                             "applied by PEFT; refused when it was trained on another base draft")
    parser.add_argument("--gamma", type=int, default=None,
                        help="draft tokens per verification call (default: 4; with --tree, its depth)")
    parser.add_argument("--tree", metavar="B1,B2,...", default=None,
                        help="draft a static tree, branching B1 at depth 1, B2 at depth 2, ... (e.g. 4,2,2,1), "
                             "verified in one target forward (greedy, or sampled with --temperature); or "
                             "dynamic:K,D,N (EAGLE-2: top K per depth, depth D, N nodes kept; greedy or sampled); "
                             "drafters that cannot branch propose a chain")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default); > 0 = speculative sampling at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass with --temperature (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling with --temperature (default: 0)")
    parser.add_argument("--prompts", type=Path, metavar="FILE.jsonl",
                        help="JSONL rows with a 'prompt' (or 'text') field (default: the built-in corpus' held-out split)")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts to use, the first ones of --prompts (default: 8)")
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="tokens per held-out prompt; with --prompts, the most kept (its last ones) (default: 64)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as a JSON object here")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    parser.add_argument("--device", default="auto",
                        help="where target and draft decode: auto (an accelerator when there is one), cpu, cuda, "
                             "cuda:N (default: auto)")
    parser.add_argument("--dtype", default="fp32", metavar="fp32|bf16",
                        help="the weights target and draft decode with: fp32 (default), or bf16 (parameters in "
                             "bfloat16, every activation with them, rotary tables in fp32: what vLLM and SGLang serve "
                             "at dtype bfloat16)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0, metavar="P",
                        help="a DSpark draft's confidence early stop, as the engines serve it: verify only the "
                             "drafts its confidence head keeps at this threshold (default: 0, the whole block, "
                             "both engines' default)")
    parser.add_argument("--repeats", type=int, default=REPEATS, metavar="N",
                        help="timed passes over the prompts, each decoding every prompt speculatively and with the "
                             "target alone, interleaved; speeds are the median pass's, with the spread (default: "
                             f"{REPEATS}); tau and the lossless check come from the first pass")
    parser.add_argument("--confidence-rule", choices=("sglang", "vllm"), default="sglang",
                        help="with --confidence-threshold: sglang = up to the first draft whose confidence < P "
                             "(SGLang, DeepSpec); vllm = the drafts whose cumulative confidence >= P (default: sglang)")


# --------------------------------------------------------------------------- loading


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--target {model_dir}: no usable tokenizer in it ({first_line(e)})") from None


def _check_same_tokenizer(draft_dir: Path, tokenizer) -> None:
    """A draft with another tokenizer would propose ids that mean other text to the target."""
    from treadle.tokenizer import tokenizer_fingerprint

    if not (draft_dir / "tokenizer.json").is_file() or not hasattr(tokenizer, "backend_tokenizer"):
        return
    if tokenizer_fingerprint(draft_dir) != tokenizer_fingerprint(tokenizer):
        raise UserError(f"--draft {draft_dir}: its tokenizer differs from the target's")


# ---- Drafter registry: every accepted --draft value is resolved here. ----
def load_drafter(spec: str, target: torch.nn.Module, tokenizer) -> Drafter:
    """``--draft`` value -> Drafter: 'prompt-lookup', a treadle draft directory, or any HF causal LM."""
    from treadle.drafts.registry import drafter, read_draft_config
    from treadle.models.hf import load_causal_lm
    from treadle.speculative.drafters import ModelDrafter, PromptLookupDrafter

    if spec == "prompt-lookup":
        return PromptLookupDrafter()
    path = Path(spec)
    for candidate in (path, path / "draft"):  # a draft run directory holds its export in draft/
        if read_draft_config(candidate) is not None:
            return drafter(candidate, target)
    check_draft_spec(spec)
    draft_dir = resolve_model_dir(path, "--draft")
    _check_same_tokenizer(draft_dir, tokenizer)
    return ModelDrafter(load_causal_lm(draft_dir, "--draft"), name=f"lm:{draft_dir}")


def adapt_drafter(drafter: Drafter, spec: str, adapter: Path) -> None:
    """``--adapter``: a draft LoRA run's adapter applied by PEFT to the draft module of ``drafter`` (a treadle draft
    of ``spec``), in place; an adapter trained on another base draft is refused (its treadle_adapter.json)."""
    from treadle.drafts.kind import init_dir
    from treadle.drafts.registry import read_draft_config
    from treadle.models.lora import draft_base_identity, load_adapter

    model = getattr(drafter, "model", None)
    draft_dir = init_dir(spec)
    config = read_draft_config(draft_dir)
    if config is None or not hasattr(model, "draft_model"):  # spec_eval refused it before loading (check_draft_options)
        raise not_a_treadle_draft(adapter, spec)
    identity = draft_base_identity(config["treadle_draft_kind"], draft_dir, model.target.config)
    load_adapter(model.draft_model, adapter, identity)  # PEFT injects its layers into the draft module in place


# --------------------------------------------------------------------------- evaluation


def first_mismatch(reference: list[int], other: list[int]) -> int | None:
    """First position where the two token lists differ (a length difference counts), else None."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def evaluate_drafter(
    target: torch.nn.Module,
    drafter: Drafter,
    prompts: list[list[int]],
    gamma: int,
    max_new_tokens: int,
    eos_id: int | None,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    tree: tuple[int, ...] | DynamicTree | None = None,
    device: torch.device | None = None,
    repeats: int = 1,
    watch: Callable[[], Watch | Given] | None = None,
) -> dict:
    """Target-alone and speculative decoding of every prompt: acceptance, speed and (greedy) losslessness.

    ``tree``: branching per depth or a ``DynamicTree``, ``gamma`` its depth. ``lossless`` is None when sampled.
    ``device``: where the models already are; the decode loops' own tensors are made there too. ``repeats``: timed
    passes over the prompts (``_timed_passes``); ``watch``: the machine's load around them (default
    ``machine_load.watch``).
    """
    import torch

    from treadle.speculative.sampling import Sampler

    if not prompts:
        raise ValueError("evaluate_drafter: no prompts")
    device = torch.device("cpu") if device is None else device
    sampler = Sampler(temperature, top_p, torch.Generator(device).manual_seed(seed))
    with torch.device(device):  # the loops build their small tensors (ids, positions, masks) without naming a device
        return _evaluate(target, drafter, prompts, gamma, max_new_tokens, eos_id, sampler, tree, temperature, top_p,
                         repeats, watch or machine_load.watch)


def _timed_passes(target, drafter, prompts, max_new_tokens, eos_id, sampler, decode, repeats: int):
    """``repeats`` passes over ``prompts``, each prompt decoded by the target alone and speculatively, the two
    interleaved and their order alternating by prompt and by pass (a load that comes or goes lands on both alike).
    Returns the first pass's outputs (the target's references and the speculative results: tau and the lossless
    check are computed once), every pass's speeds, [(speculative tokens/s, target-alone tokens/s)], and the first
    pass's count of draft forwards."""
    import torch

    from treadle.speculative.decode import target_generate

    references, results, speeds = [], [], []
    forwards = _ForwardCounter(drafter)  # the first pass's draft forwards
    for r in range(repeats):
        totals = {"target": [0, 0.0], "spec": [0, 0.0]}  # tokens, seconds
        for index, prompt in enumerate(prompts):
            prompt_ids = torch.tensor([prompt])
            for phase in ("target", "spec") if (index + r) % 2 == 0 else ("spec", "target"):
                if phase == "target":
                    tokens, seconds = target_generate(target, prompt_ids, max_new_tokens, eos_id, sampler)
                    if r == 0:
                        references.append(tokens)
                else:
                    result = decode(prompt_ids, max_new_tokens)
                    tokens, seconds = result.tokens, result.seconds
                    if r == 0:
                        results.append(result)
                totals[phase][0] += len(tokens)
                totals[phase][1] += seconds
        if r == 0:
            forwards.remove()
        speeds.append(tuple(n / s for n, s in (totals["spec"], totals["target"])))
    return references, results, speeds, forwards


def speed_figures(speeds: list[tuple[float, float]]) -> dict:
    """The result's speed keys from every pass's (speculative, target-alone) tokens/s: the median pass's (by its
    speedup; the lower middle one of an even count), so speedup = tokens_per_s_spec / tokens_per_s_target holds, and
    the spread of the per-pass speedups."""
    speedups = [spec / alone for spec, alone in speeds]
    median = sorted(range(len(speeds)), key=speedups.__getitem__)[(len(speeds) - 1) // 2]
    return {"tokens_per_s_spec": speeds[median][0], "tokens_per_s_target": speeds[median][1],
            "speedup": speedups[median], "repeats": len(speeds), "speedup_min": min(speedups),
            "speedup_max": max(speedups), "speedup_repeats": speedups}


def _evaluate(target, drafter, prompts, gamma, max_new_tokens, eos_id, sampler, tree, temperature, top_p,
              repeats, watch) -> dict:
    import torch

    from treadle.speculative.acceptance import lookup_tau
    from treadle.speculative.decode import speculative_generate, summarize, target_generate

    def decode(prompt_ids, new_tokens):
        return speculative_generate(target, drafter, prompt_ids, gamma, new_tokens, eos_id, sampler, tree)

    # The first forwards of a process pay one-off costs (allocator, kernel
    # selection) that would otherwise land on whichever side is timed first.
    target_generate(target, torch.tensor([prompts[0]]), _WARMUP_TOKENS, eos_id, sampler)
    decode(torch.tensor([prompts[0]]), _WARMUP_TOKENS)
    watching = watch()
    references, results, speeds, forwards = _timed_passes(target, drafter, prompts, max_new_tokens, eos_id, sampler,
                                                          decode, repeats)
    verdict = watching.verdict()
    texts = [list(prompt) + list(reference) for prompt, reference in zip(prompts, references)]
    mismatches = []
    for index, (reference, result) in enumerate(zip(references, results)):
        position = first_mismatch(reference, result.tokens) if sampler.greedy else None
        if position is not None:
            mismatches.append({"prompt": index, "position": position})
    summary = summarize(results, gamma)
    summary.update(
        drafter=drafter.name,
        num_prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        **speed_figures(speeds),
        load={"loaded": verdict.loaded, "why": verdict.why},
        lossless=not mismatches if sampler.greedy else None,
        mismatches=mismatches,
        temperature=temperature,
        top_p=top_p,
        tree=None if tree is None else list(tree) if isinstance(tree, tuple) else str(tree),
    )
    # Prompt lookup's tau on the target's own continuations: near gamma + 1 they loop, and any drafter's tau with them
    # (speculative/acceptance.py, the draft run's warning). None when no continuation is longer than gamma.
    summary["prompt_lookup_tau"] = lookup_tau(texts, [len(p) for p in prompts], gamma)
    # A chain of gamma one-token drafts runs the draft gamma times in a row per call, a DFlash block once: the cost
    # model's count (None: a drafter without a model, prompt lookup).
    summary["draft_forwards_per_round"] = (forwards.calls / summary["verify_calls"]
                                           if forwards.module is not None and summary["verify_calls"] else None)
    return summary


class _ForwardCounter:
    """Counts the calls of the drafter's network: a treadle draft's ``draft_model`` (its decoder stack), or a
    ``ModelDrafter``'s whole model."""

    def __init__(self, drafter):
        model = getattr(drafter, "model", None)
        self.module = getattr(model, "draft_model", model)
        self.calls = 0
        self._hook = self.module.register_forward_pre_hook(self._count) if self.module is not None else None

    def _count(self, module, args) -> None:
        self.calls += 1

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()


# --------------------------------------------------------------------------- command


def parse_tree(text: str) -> tuple[int, ...] | DynamicTree:
    """``--tree 4,2,2,1`` -> (4, 2, 2, 1); ``--tree dynamic:K,D,N`` -> ``DynamicTree(K, D, N)``; anything else is
    one line naming what is accepted."""
    from treadle.speculative.tree import DynamicTree

    text = str(text)
    dynamic = text.startswith("dynamic:")
    try:
        numbers = tuple(int(part) for part in text.removeprefix("dynamic:").split(","))
    except ValueError:
        numbers = ()
    if not numbers or min(numbers) < 1 or (dynamic and len(numbers) != 3):
        raise UserError(f"--tree {text}: accepted: branching factors >= 1 per depth, comma-separated, e.g. 4,2,2,1; "
                        "or dynamic:K,D,N (top K per depth, depth D, N nodes kept; each >= 1), e.g. dynamic:4,4,16")
    return DynamicTree(*numbers) if dynamic else numbers


def _check_sampling(temperature: float, top_p: float, tree: tuple[int, ...] | DynamicTree | None,
                    gamma: int | None) -> None:
    if not temperature >= 0:
        raise UserError(f"--temperature {temperature}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p {top_p}: must be in (0, 1]")
    from treadle.speculative.tree import tree_depth

    if tree is not None and gamma is not None and gamma != tree_depth(tree):
        raise UserError(f"--gamma {gamma} with --tree {tree_text(tree)}: the tree's depth is "
                        f"{tree_depth(tree)}; leave --gamma out or give {tree_depth(tree)}")


def _check_args(gamma: int, num_prompts: int, prompt_len: int, max_new_tokens: int, threads: int,
                json_path: Path | None) -> None:
    for flag, value in (("--gamma", gamma), ("--num-prompts", num_prompts),
                        ("--prompt-len", prompt_len), ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    if threads < 0:
        raise UserError(f"--threads {threads}: must be >= 0 (0 = torch's default)")
    if json_path is not None and not json_path.parent.is_dir():
        raise UserError(f"--json {json_path}: directory {json_path.parent} does not exist")
    if json_path is not None:
        claim_output(json_path, "--json", "spec-eval", ours=is_spec_eval_json, file=True)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: accepted: fp32 (the default) or bf16 (bf16 weights, as the engines serve)")


def cast_weights(modules, dtype: str) -> None:
    """Every floating parameter of ``modules`` (shared ones once) to ``dtype``; buffers stay as they are. A model's
    buffers are its rotary frequencies: rounded to bf16 they would turn position p by up to p * 2^-9 radians too
    much, whereas the engines and transformers compute the rotary tables in fp32 and cast only cos / sin."""
    import torch

    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    params = {id(p): p for m in modules for p in m.parameters() if p.is_floating_point()}
    for p in params.values():
        p.data = p.data.to(want)


def _check_croppable(target, target_dir: Path) -> None:
    """The decode loop cuts the target's cache back to the accepted prefix after each verification; a linear-attention
    (Gated-DeltaNet) layer's recurrent state has no per-position history to cut, so such a target is refused here
    rather than failing inside transformers' cache."""
    types = getattr(target.config, "layer_types", None) or ()
    if "linear_attention" in types:
        raise UserError(f"--target {target_dir}: {types.count('linear_attention')} of its layers are linear attention "
                        "(layer_types), whose recurrent state spec-eval's decode loop cannot cut back after a "
                        "rejection; accepted: a target whose layers all keep a KV cache")


def is_spec_eval_json(path: Path) -> bool:
    """Whether ``path`` holds an earlier spec-eval result (which --json may replace)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and (obj.get("written_by") == WRITTEN_BY or _RESULT_KEYS <= obj.keys())


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _degenerate_warning(result: dict) -> str | None:
    """The draft run's warning on a target whose own continuations loop, with prompt lookup's tau beside the
    drafter's (None when they do not loop)."""
    from treadle.speculative.acceptance import degenerate_target_warning as warning

    sampled = "sampled continuations" if result["temperature"] > 0 else "greedy continuations"
    return warning(result.get("prompt_lookup_tau"), result["gamma"], "tau", result["tau"], sampled)


def _speed_rows(result: dict) -> list[tuple[str, str]]:
    """The table's speed rows: the median pass's tokens/s and speedup, with the spread over the passes (a result
    written before --repeats has no spread)."""
    repeats = result.get("repeats", 1)
    passes = "" if repeats == 1 else f" (the median of {repeats} interleaved passes)"
    spread = "" if repeats == 1 else (f" (median of {repeats} passes; {result['speedup_min']:.2f}x to "
                                      f"{result['speedup_max']:.2f}x)")
    return [("speculative", f"{result['tokens_per_s_spec']:,.1f} tokens/s{passes}"),
            ("target alone", f"{result['tokens_per_s_target']:,.1f} tokens/s"),
            ("speedup", f"{result['speedup']:.2f}x{spread}")]


def load_warning(result: dict) -> str | None:
    """One line when the machine was loaded while the speeds were timed (None when it was not)."""
    load = result.get("load") or {}
    if not load.get("loaded"):
        return None
    spread = (f"speedup {result['speedup_min']:.2f}x to {result['speedup_max']:.2f}x over {result['repeats']} passes"
              if result.get("repeats", 1) > 1 else f"speedup {result['speedup']:.2f}x")
    return (f"treadle: spec-eval: the machine was loaded while it timed the decoding ({load['why']}): the tokens/s and "
            f"the {spread} may be far off a quiet machine's; tau, acceptance and the lossless check do not depend "
            "on it")


def _print_report(result: dict, target_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    gamma = result["gamma"]
    table = Table(title=f"speculative decoding: {result['drafter']} -> {target_dir}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("prompts", f"{result['num_prompts']} ({result['generated_tokens']:,} tokens generated, "
                             f"{result['verify_calls']:,} verification calls)")
    if result["tree"]:
        from treadle.speculative.tree import tree_size

        if isinstance(result["tree"], str):
            table.add_row("draft", f"tree {result['tree']}: EAGLE-2 dynamic tree, depth {gamma}")
        else:
            table.add_row("draft", f"tree {','.join(map(str, result['tree']))}: "
                                   f"{tree_size(tuple(result['tree']))} nodes, depth {gamma}")
    else:
        table.add_row("draft", f"chain of gamma {gamma}")
    table.add_row("precision", {"bf16": "bf16 weights (--dtype bf16)"}.get(result.get("dtype"), "fp32 weights")
                  + f" on {result.get('device', 'cpu')}")
    table.add_row("tau", f"{_rate(result['tau'])} tokens per target verification call, bonus token included "
                         f"(at most {gamma + 1})")
    if result.get("draft_forwards_per_round") is not None:
        table.add_row("draft forwards", f"{result['draft_forwards_per_round']:.2f} per verification call")
    by_position = result.get("tau_by_position") or []
    if len(by_position) > 1:
        from treadle.speculative.decode import POSITION_BUCKET

        table.add_row("tau by position", ", ".join(
            f"{b * POSITION_BUCKET}+: {tau:.2f}" for b, tau in enumerate(by_position)) + " (generated tokens)")
    for row, line in _speed_rows(result):
        table.add_row(row, line)
    if result["lossless"] is None:
        table.add_row("lossless", f"not compared (sampled at temperature {result['temperature']}, top-p "
                                  f"{result['top_p']}: the output keeps the target's distribution, not its tokens)")
    else:
        table.add_row("lossless", "yes" if result["lossless"] else "NO: output differs from the target's greedy output")

    title = "acceptance per draft position k (n = drafts accepted in a call)"
    acceptance = Table(title=title, min_width=len(title))  # never narrower than its title: rich wraps it mid-phrase
    acceptance.add_column("k", justify="right")
    acceptance.add_column("P(n >= k | n >= k-1)", justify="right")
    acceptance.add_column("P(n >= k)", justify="right")
    for k in range(gamma):
        acceptance.add_row(str(k + 1), _rate(result["acceptance_conditional"][k]),
                           _rate(result["acceptance_unconditional"][k]))
    console = Console()
    console.print(table)
    console.print(acceptance)


def spec_eval(target: Path, draft: str, *, gamma: int | None = None, prompts: Path | None = None, num_prompts: int = 8,
              prompt_len: int = 64, max_new_tokens: int = 64, json_path: Path | None = None, threads: int = 0,
              tree: str | tuple[int, ...] | DynamicTree | None = None, temperature: float = 0.0, top_p: float = 1.0,
              seed: int = 0, device: str = "auto", dtype: str = "fp32", confidence_threshold: float = 0.0,
              confidence_rule: str = "sglang", adapter: Path | None = None, repeats: int = REPEATS) -> dict:
    """Speculative decoding of ``target`` with ``draft``: the result record (``--json`` writes it, with
    ``written_by``). The keywords are the command's flags; its defaults are theirs (a test compares them)."""
    json_path = Path(json_path) if json_path is not None else None
    branching = None if tree is None else parse_tree(tree_text(tree))
    _check_sampling(temperature, top_p, branching, gamma)
    if branching is not None:
        from treadle.speculative.tree import tree_depth

        gamma = tree_depth(branching)
    gamma = 4 if gamma is None else gamma
    _check_args(gamma, num_prompts, prompt_len, max_new_tokens, threads, json_path)
    check_dtype(dtype)
    if repeats < 1:
        raise UserError(f"--repeats {repeats}: must be >= 1 (timed passes over the prompts)")
    check_draft_spec(str(draft))
    check_draft_options(str(draft), gamma, branching, confidence_threshold, adapter)
    import torch

    from treadle.distributed import choose_device
    from treadle.models.hf import load_causal_lm
    from treadle.speculative.prompts import heldout_prompts, load_prompts_jsonl

    where = choose_device(device, key="--device")

    if threads:
        torch.set_num_threads(threads)
    target_dir = resolve_model_dir(Path(target), "--target")
    tokenizer = _load_tokenizer(target_dir)
    if prompts is not None:
        prompt_ids = load_prompts_jsonl(Path(prompts), tokenizer, prompt_len)[:num_prompts]
    else:
        prompt_ids = heldout_prompts(tokenizer, num_prompts, prompt_len)
    target_model = load_causal_lm(target_dir, "--target")
    _check_croppable(target_model, target_dir)
    drafter = load_drafter(str(draft), target_model, tokenizer)
    if adapter is not None:
        adapt_drafter(drafter, str(draft), Path(adapter))
    if confidence_threshold:  # check_draft_options refused a draft without a confidence head
        drafter.confidence_threshold, drafter.confidence_rule = confidence_threshold, confidence_rule
    models = [target_model]
    if isinstance(getattr(drafter, "model", None), torch.nn.Module):  # a draft model (it may hold the target too)
        models.append(drafter.model)
    for m in models:
        m.to(where)
    cast_weights(models, dtype)

    result = evaluate_drafter(target_model, drafter, prompt_ids, gamma, max_new_tokens, tokenizer.eos_token_id,
                              temperature=temperature, top_p=top_p, seed=seed, tree=branching, device=where,
                              repeats=repeats)
    record = {"written_by": WRITTEN_BY, **result, "target": str(target_dir), "device": str(where), "dtype": dtype}
    if adapter is not None:
        record["adapter"] = str(adapter)
    if json_path is not None:
        write_atomic(json_path, json.dumps(record, indent=2) + "\n")
    return record


def run(args: argparse.Namespace) -> int:
    """The spec-eval command: 0 when lossless (or sampled), 1 when the greedy output differs from the target's."""
    result = spec_eval(args.target, args.draft, gamma=args.gamma, prompts=args.prompts, num_prompts=args.num_prompts,
                       prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens, json_path=args.json,
                       threads=args.threads, tree=args.tree, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, device=args.device, dtype=args.dtype,
                       confidence_threshold=args.confidence_threshold, confidence_rule=args.confidence_rule,
                       adapter=args.adapter, repeats=args.repeats)
    _print_report(result, Path(result["target"]))
    for warning in (load_warning(result), _degenerate_warning(result)):
        if warning is not None:
            print(warning, file=sys.stderr)
    for m in result["mismatches"]:
        print(f"treadle: not lossless: prompt {m['prompt']} differs from the target's greedy output "
              f"at generated token {m['position']}", file=sys.stderr)
    return 1 if result["lossless"] is False else 0
