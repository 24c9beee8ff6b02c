"""The draft kinds' registry: one list of kinds, and nothing outside drafts/ imports a kind's folder."""

from treadle.drafts import registry, settings
from tests.test_layers import _graph


def test_the_registry_and_the_config_list_the_same_kinds():
    assert tuple(registry.KINDS) == settings.NAMES
    for name, kind in registry.KINDS.items():
        assert kind.name == name and kind.settings is settings.KINDS[name]


def test_nothing_outside_drafts_imports_a_kind():
    """Generic code reaches a kind through drafts/registry.py (or drafts/settings.py, for the config) only."""
    kinds = tuple(f"treadle.drafts.{name}" for name in settings.NAMES)
    found = sorted(f"{m} -> {t}" for m, ts in _graph().items() if not m.startswith("treadle.drafts")
                   for t in ts if t.startswith(kinds))
    assert not found


def test_each_kind_reads_its_own_layout_in_the_stated_order(tmp_path):
    """read_draft_config asks each kind's own reader (DraftKind.read_config): a draft written elsewhere in a kind's
    layout gets that kind, a treadle export keeps the kind it records, and where two readers would take a config
    the first in READ_ORDER (today's: frozen_kv, mtp, the generic reader, then KINDS' order) wins."""
    import json

    dflash_like = {"dflash_config": {"block_size": 4}}
    foreign = {"frozen_kv": {"model_type": "gemma4_assistant"},
               "mtp": {"architectures": ["DeepseekV3ForCausalLMNextN"]},
               "eagle3": {"architectures": ["LlamaForCausalLMEagle3"]},
               "glide": {"architectures": ["Qwen2GlideDecoderLayer"]},
               "dflash": {"architectures": ["DFlashDraftModel"], **dflash_like},
               "dspark": {"architectures": ["Qwen3DSparkModel"]},
               "dflash2": {"architectures": ["DFlash2DraftModel"], **dflash_like},
               "lilicorr": {"architectures": ["LiLiCorrDraftModel"], **dflash_like},
               "dspine": {"architectures": ["DSpineDraftModel"], **dflash_like},
               "xpress": {"speculators_model_type": "xpress", "speculators_config": {}},
               None: {"architectures": ["Qwen3ForCausalLM"]},  # a model, not a draft
               "treadle": {"architectures": ["DFlashDraftModel"], **dflash_like, "treadle_draft_kind": "lilicorr"},
               "first": {"architectures": ["DFlashDraftModel"], **dflash_like, "model_type": "gemma4_assistant"}}
    assert set(foreign) - {None, "treadle", "first"} == set(registry.KINDS)
    for name, config in foreign.items():
        (tmp_path / str(name)).mkdir()
        (tmp_path / str(name) / "config.json").write_text(json.dumps(config))
        read = registry.read_draft_config(tmp_path / str(name))
        expected = {None: None, "treadle": "lilicorr", "first": "frozen_kv"}.get(name, name)
        assert (read and read["treadle_draft_kind"]) == expected, name
    assert registry.read_draft_config(tmp_path / "absent") is None
    assert [k.name for k in registry.READ_ORDER] == ["frozen_kv", "mtp", "glide", "eagle3", "dflash", "dspark",
                                                     "dflash2", "lilicorr", "dspine", "xpress"]


def test_a_kind_key_is_refused_without_its_kind():
    import pytest
    from treadle.config import load_config
    from treadle.errors import UserError

    with pytest.raises(UserError, match=r"draft.init is set but draft.kind = None; accepted: draft.kind = 'dflash' or "
                                        r"'dflash2' or 'dspark' or 'dspine' or 'eagle3' or 'frozen_kv' or 'glide' "
                                        r"or 'lilicorr' or 'mtp' or 'xpress', or leave it unset"):
        load_config(None, ["--data.train=x", "--draft.init=x"])
    with pytest.raises(UserError, match=r"draft.layout = 'longspec' with draft.kind = 'eagle3'"):
        load_config(None, ["--data.train=x", "--draft.kind=eagle3", "--draft.target=t", "--draft.layout=longspec"])
    with pytest.raises(UserError, match=r"draft.block_size is set but draft.kind = 'eagle3'; accepted: draft.kind = "
                                        r"'dflash' or 'dflash2' or 'dspark' or 'dspine' or 'lilicorr' or 'xpress', "
                                        r"or leave it unset"):
        load_config(None, ["--data.train=x", "--draft.kind=eagle3", "--draft.target=t", "--draft.block_size=8"])
    with pytest.raises(UserError, match=r"draft.gamma = 8 with draft.kind = 'dflash' and a block of 8"):
        load_config(None, ["--data.train=x", "--draft.kind=dflash", "--draft.target=t", "--draft.block_size=8",
                           "--draft.gamma=8", "--draft.eval_new_tokens=16"])
    # dspark: every slot drafts (the anchor's too), so gamma may equal block_size but not exceed it
    load_config(None, ["--data.train=x", "--draft.kind=dspark", "--draft.target=t", "--draft.block_size=8",
                       "--draft.gamma=8", "--draft.eval_new_tokens=16"])
    with pytest.raises(UserError, match=r"draft.gamma = 8 with draft.kind = 'dspark' and a block of 7"):
        load_config(None, ["--data.train=x", "--draft.kind=dspark", "--draft.target=t", "--draft.gamma=8",
                           "--draft.eval_new_tokens=16"])
    with pytest.raises(UserError, match=r"draft.markov_rank is set but draft.kind = 'dflash'; accepted: "
                                        r"draft.kind = 'dspark'"):
        load_config(None, ["--data.train=x", "--draft.kind=dflash", "--draft.target=t", "--draft.markov_rank=8"])
    with pytest.raises(UserError, match=r"draft.slot_weighting is set but draft.kind = 'dspark'"):
        load_config(None, ["--data.train=x", "--draft.kind=dspark", "--draft.target=t", "--draft.slot_weighting=dpace"])
    with pytest.raises(UserError, match=r"draft.selector_top_k is set but draft.kind = 'dflash'; accepted: draft.kind "
                                        r"= 'dflash2', or leave it unset"):
        load_config(None, ["--data.train=x", "--draft.kind=dflash", "--draft.target=t", "--draft.selector_top_k=8"])
    with pytest.raises(UserError, match=r"draft.gamma = 8 with draft.kind = 'dflash2' and a block of 8"):
        load_config(None, ["--data.train=x", "--draft.kind=dflash2", "--draft.target=t", "--draft.block_size=8",
                           "--draft.gamma=8", "--draft.eval_new_tokens=16"])


def test_every_block_kind_refuses_context_parallelism_in_one_line():
    """The block kinds' anchored blocks read the whole context before each anchor: a sliced sequence is refused when
    the config loads, in one line naming the kind and what is accepted."""
    import pytest
    from treadle.config import load_config
    from treadle.errors import UserError

    for kind in ("dflash", "dflash2", "dspark", "lilicorr", "dspine", "xpress"):
        with pytest.raises(UserError, match=rf"distributed.context_parallel = 2 with draft.kind = '{kind}'.*accepted: "
                                            r"context_parallel = 1") as got:
            load_config(None, ["--data.train=x", f"--draft.kind={kind}", "--draft.target=t",
                               "--distributed.context_parallel=2"])
        assert "\n" not in str(got.value), kind
