"""The draft kinds a draft run can train (``draft.kind``), by name: built, loaded, set up and exported by kind.

Generic code goes through here (or drafts/settings.py, for the config) and never imports a kind's folder.
"""

from __future__ import annotations

from treadle.drafts.dflash.kind import DFLASH
from treadle.drafts.dspark.kind import DSPARK
from treadle.drafts.dspark.layout import read_config as read_dspark_config
from treadle.drafts.dflash2.kind import DFLASH2
from treadle.drafts.dflash2.layout import read_config as read_dflash2_config
from treadle.drafts.eagle3.kind import EAGLE3
from treadle.drafts.frozen_kv.kind import FROZEN_KV
from treadle.drafts.frozen_kv.layout import read_config as read_frozen_kv_config
from treadle.drafts.glide.kind import GLIDE
from treadle.drafts.mtp.kind import MTP
from treadle.drafts.mtp.layout import read_config as read_mtp_config
from treadle.drafts.dflash.layout import read_config as read_dflash_config
from treadle.drafts.glide.model import read_draft_config as read_treadle_config
from treadle.drafts.kind import DraftKind
from treadle.drafts.lilicorr.kind import LILICORR
from treadle.drafts.lilicorr.layout import read_config as read_lilicorr_config
from treadle.errors import UserError

# drafts/settings.py's order (tests/test_drafts.py)
KINDS: dict[str, DraftKind] = {k.name: k for k in (GLIDE, EAGLE3, DFLASH, MTP, FROZEN_KV, DSPARK, DFLASH2, LILICORR)}

__all__ = ["KINDS", "build_draft", "drafter", "kind", "load_draft", "read_draft_config"]


def read_draft_config(draft_dir) -> dict | None:
    """The config.json of a draft export of any kind (with its ``treadle_draft_kind``), or None if ``draft_dir`` is
    not one."""
    return (read_frozen_kv_config(draft_dir) or read_mtp_config(draft_dir) or read_treadle_config(draft_dir)
            or read_dflash_config(draft_dir) or read_dspark_config(draft_dir)
            or read_dflash2_config(draft_dir) or read_lilicorr_config(draft_dir))


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
