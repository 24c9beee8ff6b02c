"""The draft kinds a draft run can train (``draft.kind``), built and loaded by kind."""

from __future__ import annotations

from treadle.errors import UserError


def build_draft(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(model, target dir, target identity) for a ``DraftConfig`` of any kind (``build_glide``, ``build_eagle3``)."""
    if cfg.kind == "eagle3":
        from treadle.drafts.eagle3.model import build_eagle3

        return build_eagle3(cfg, data_vocab, data_tokenizer_fingerprint, empty)
    from treadle.drafts.glide.layout import build_glide
    from treadle.drafts.targets import refuse_for

    refuse_for("glide", cfg.target, "draft.target")  # from its config, before a weight is read
    built = build_glide(cfg, data_vocab, data_tokenizer_fingerprint, empty)
    refuse_for("glide", cfg.target, "draft.target", built[0].target)  # and what its modules show
    return built


def load_draft(draft_dir, target):
    """A treadle draft export of any kind attached to ``target``."""
    from treadle.drafts.glide.model import read_draft_config

    config = read_draft_config(draft_dir)
    kind = config and config["treadle_draft_kind"]
    if kind == "glide":
        from treadle.drafts.glide.layout import load_glide

        return load_glide(draft_dir, target)
    if kind == "eagle3":
        from treadle.drafts.eagle3.model import load_eagle3

        return load_eagle3(draft_dir, target)
    raise UserError(f"{draft_dir} is not a treadle draft export of a known kind (treadle_draft_kind = {kind!r}); "
                    "accepted: 'glide', 'eagle3'")
