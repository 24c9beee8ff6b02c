"""The speculators format (vllm-project/speculators, vLLM's draft library): what ``treadle export --to speculators``
writes and ``draft.init`` reads, for the kinds that carry a ``speculators`` table (``DraftKind.speculators``, e.g.
drafts/eagle3/speculators.py).

Read for this: the speculators 0.9.0 wheel (PyPI, built 2026-10-15): ``speculators/config.py``
(``SpeculatorModelConfig``: ``speculators_model_type`` picks the model class, ``speculators_version``,
``speculators_config`` = algorithm, proposal methods, default proposal method, verifier) and ``speculators/model.py``
(``SpeculatorModel.from_pretrained``: config.json + model.safetensors, the verifier's embedding and head filled in
later when missing). A kind's table maps its consumer layout to this one; this module holds what every kind shares.
"""

from __future__ import annotations

from treadle.errors import UserError

VERSION = "0.9.0"  # the speculators release read; written as speculators_version


def speculators_config(algorithm: str, speculative_tokens: int, target_config, training: dict) -> dict:
    """``speculators_config``: one greedy proposal of ``speculative_tokens`` drafts; the verifier as the run named
    it (``draft.target``, a hub id or a path) with its architectures: speculators' ``from_pretrained`` loads the
    verifier's embedding from there, and vLLM serves the draft against it unless told another target."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": training.get("target"),
                         "architectures": list(target_config.architectures or [])}}


def check_names(tensors: dict, expected: set, what: str) -> None:
    """Refuse an export whose tensor names are not exactly the ones speculators' model declares (``expected``):
    from_pretrained would leave a missing one at its initial value, or drop an unknown one, without a word."""
    unknown, missing = sorted(tensors.keys() - expected), sorted(expected - tensors.keys())
    if unknown or missing:
        raise UserError(f"{what} export to speculators: the draft's weights do not match speculators' names "
                        f"(no name for {unknown}, missing {missing}); nothing was written")


def export(table, draft, weights: dict, target, torch_dtype, meta: dict) -> tuple[dict, dict]:
    """(tensors, config.json) of ``draft`` (drafting for ``target``, the model) in the speculators format, through its
    kind's ``table`` (drafts/registry.py ``speculators_table``); treadle's metadata rides along as extra keys, which
    speculators' config keeps and ignores."""
    return table.export(draft, weights, target, torch_dtype, {**draft.export_config(), **meta})


def embedding(target, dtype) -> dict:
    """The target's input embedding as ``embed_tokens.weight``: speculators' models hold it, and its
    ``from_pretrained`` leaves it uninitialized (not NaN, so not filled from the verifier) when the file lacks it."""
    return {"embed_tokens.weight": target.get_input_embeddings().weight.detach().to("cpu", dtype).contiguous()}


def is_format(config: dict) -> bool:
    """A config.json of a draft in the speculators format (any of its kinds)."""
    return isinstance(config.get("speculators_model_type"), str) and "speculators_config" in config
