"""The draft kinds a draft run can train (``draft.kind``), by name: built, loaded, set up and exported by kind.

Generic code goes through here (or drafts/settings.py, for the config) and never imports a kind's folder.
"""

from __future__ import annotations

from treadle.drafts.dflash.kind import DFLASH
from treadle.drafts.dflash2.kind import DFLASH2
from treadle.drafts.dspark.kind import DSPARK
from treadle.drafts.dspine.kind import DSPINE
from treadle.drafts.eagle3.kind import EAGLE3
from treadle.drafts.frozen_kv.kind import FROZEN_KV
from treadle.drafts.glide.kind import GLIDE
from treadle.drafts.kind import DraftKind
from treadle.drafts.lilicorr.kind import LILICORR
from treadle.drafts.mtp.kind import MTP
from treadle.drafts.xpress.kind import XPRESS
from treadle.errors import UserError

# drafts/settings.py's order (tests/test_drafts.py)
KINDS: dict[str, DraftKind] = {k.name: k for k in (GLIDE, EAGLE3, DFLASH, MTP, FROZEN_KV, DSPARK, DFLASH2, LILICORR,
                                                   DSPINE, XPRESS)}

# The order read_draft_config asks the kinds' readers in: the first config found wins. GLIDE's is treadle's generic
# reader (glide/model.py): it takes every treadle export by the treadle_draft_kind it records, so a reader after it
# only ever sees drafts written elsewhere, and a layout reader before it must keep a recorded kind (layout_config's
# setdefault does). The layouts are told apart by their architectures / model_type today, so the order decides
# only for a config two readers would both take: a new kind's foreign layout that could pass for another kind's
# goes before that kind. The rest follow in KINDS' order (a kind with no reader is skipped).
READ_ORDER: tuple[DraftKind, ...] = (FROZEN_KV, MTP, GLIDE,
                                     *(k for k in KINDS.values() if k not in (FROZEN_KV, MTP, GLIDE)))

__all__ = ["KINDS", "build_draft", "drafter", "kind", "load_draft", "read_draft_config"]


def read_draft_config(draft_dir) -> dict | None:
    """The config.json of a draft export of any kind (with its ``treadle_draft_kind``), or None if ``draft_dir`` is
    not one."""
    for found in READ_ORDER:
        config = found.read_config(draft_dir)
        if config:
            return config
    return None


def kind(name: str) -> DraftKind:
    """The kind named ``name`` (a config's ``draft.kind``, validated when it loaded)."""
    return KINDS[name]


def build_draft(cfg, data_vocab: int, data_tokenizer_fingerprint: str | None, empty: bool = False):
    """(model, target dir, target identity) for a ``DraftConfig`` of any kind (``DraftKind.build``); with
    ``draft.features`` its target has no decoder layers (the store holds what the draft reads from them)."""
    if cfg.features is None:
        return KINDS[cfg.kind].build(cfg, data_vocab, data_tokenizer_fingerprint, empty)
    from treadle.drafts.features.run import without_decoder_layers

    built = KINDS[cfg.kind].build(cfg, data_vocab, data_tokenizer_fingerprint, empty=True)  # read after the drop
    without_decoder_layers(built[0], built[1])
    return built


def _kind_of(draft_dir, config: dict | None) -> DraftKind:
    name = config and config["treadle_draft_kind"]
    if isinstance(name, str) and name in KINDS:
        return KINDS[name]
    raise UserError(f"{draft_dir} is not a treadle draft export of a known kind (treadle_draft_kind = {name!r}); "
                    f"accepted: {', '.join(map(repr, KINDS))}")


def load_draft(draft_dir, target):
    """A treadle draft export of any kind attached to ``target``."""
    return _kind_of(draft_dir, read_draft_config(draft_dir)).load(draft_dir, target)


def drafter(draft_dir, target):
    """A treadle draft export of any kind as spec-eval's ``Drafter`` against ``target``."""
    found = _kind_of(draft_dir, read_draft_config(draft_dir))
    return found.drafter(found.load(draft_dir, target))


def speculators_table(found: DraftKind):
    """The speculators table of the kind ``found`` (drafts/speculators_format.py writes through it), refused in one
    line for a kind speculators does not load."""
    if found.speculators is None:
        accepted = [k.name for k in KINDS.values() if k.speculators is not None]
        raise UserError(f"treadle export --to speculators: draft.kind = {found.name!r} has no speculators layout "
                        f"({found.speculators_missing}); accepted: a draft of kind "
                        f"{', '.join(map(repr, accepted))} (or --to draft, its own layout)")
    return found.speculators
