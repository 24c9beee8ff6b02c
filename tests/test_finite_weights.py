"""Weights holding NaN or inf are refused where a run loads them, naming the file and the tensor (issue 39, item 7).

Before, a checkpoint written from an uninitialised module loaded without a word: eval_loss=nan at step 0, then the
NaN guard's "the run is diverging: try a lower optim.lr". Each load path is poisoned here with one NaN and one inf in
one tensor of a real safetensors file: ``model.path`` (and a draft run's target) loaded whole, built empty and filled
by parts (FSDP2) or module by module (ZeRO-3); ``draft.init`` of every kind exported in a safetensors layout; a
target's shipped MTP layer is in tests/test_mtp.py, the CLI's one line in tests/test_bad_inputs.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from treadle.errors import UserError
from treadle.models.finite import FiniteCheck, check_tensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def poison(file, name: str | None = None) -> str:
    """One NaN and one inf written into tensor ``name`` (default: the first floating one) of a safetensors file."""
    tensors = load_file(str(file))
    name = name or next(k for k, t in sorted(tensors.items()) if t.is_floating_point() and t.numel() > 1)
    t = tensors[name].clone()
    t.view(-1)[0], t.view(-1)[-1] = float("nan"), float("inf")
    tensors[name] = t
    save_file(tensors, str(file), metadata={"format": "pt"})
    return name


BAD = "holds 1 NaN and 1 inf of"


@pytest.fixture
def bad_target(target_dir, tmp_path):
    """The draft runs' target with a NaN and an inf in one decoder weight."""
    d = tmp_path / "bad-target"
    shutil.copytree(target_dir, d)
    poison(d / "model.safetensors", "model.layers.1.mlp.down_proj.weight")
    return d


def test_model_path_with_nan_is_refused_loaded_whole_by_parts_or_by_module(bad_target):
    from treadle.models.hf import load_causal_lm
    from treadle.models.sharded_load import empty_causal_lm, materialize, materialize_by_module

    want = f"model.path {bad_target / 'model.safetensors'}: tensor model.layers.1.mlp.down_proj.weight {BAD} 2048 values"
    with pytest.raises(UserError, match=want) as whole:
        load_causal_lm(bad_target, "model.path")
    assert "the checkpoint itself is broken" in str(whole.value) and "\n" not in str(whole.value)
    model, why = empty_causal_lm(bad_target, "model.path")  # FSDP2's way: built on meta, filled after sharding
    assert why is None
    with pytest.raises(UserError, match=want):
        materialize(model, torch.device("cpu"))
    model, _ = empty_causal_lm(bad_target, "model.path")  # ZeRO-3's: a module at a time, partitioned as it goes
    partitioned = []
    with pytest.raises(UserError, match=want):
        materialize_by_module(model, torch.device("cpu"), partitioned.append)
    assert "model.layers.1.mlp" not in {n for n, m in model.named_modules() if m in partitioned}  # refused before


def test_a_draft_target_with_nan_is_refused(bad_target):
    """A frozen target is what a draft starts from (it shares its embedding and head, and feeds its features)."""
    from treadle.config import load_config
    from treadle.drafts.registry import build_draft

    cfg = load_config(None, ["--draft.kind=eagle3", f"--draft.target={bad_target}"])
    with pytest.raises(UserError, match=f"draft.target {bad_target / 'model.safetensors'}: tensor "
                                        f"model.layers.1.mlp.down_proj.weight {BAD}"):
        build_draft(cfg.draft, 512, None)


@pytest.mark.parametrize("kind", ["glide", "eagle3", "dflash", "dspark", "lilicorr", "xpress"])
def test_a_draft_init_with_nan_is_refused_and_so_is_its_export_at_spec_eval(kind, target_dir, eagle3_target_dir,
                                                                             tmp_path):
    from treadle.checkpoint.export import export_draft
    from treadle.config import load_config
    from treadle.drafts.registry import build_draft, load_draft

    target = eagle3_target_dir if kind == "eagle3" else target_dir
    cfg = load_config(None, [f"--draft.kind={kind}", f"--draft.target={target}"])
    model, tdir, ident = build_draft(cfg.draft, 512, None)
    out = export_draft(model, model.state_dict(), tmp_path / "draft", tdir, ident, cfg)
    name = poison(out / "model.safetensors")
    init = load_config(None, [f"--draft.kind={kind}", f"--draft.target={target}", f"--draft.init={out}"])
    with pytest.raises(UserError, match=f"draft.init {out / 'model.safetensors'}: tensor {name} {BAD}"):
        build_draft(init.draft, 512, None)
    with pytest.raises(UserError, match=f"draft {out / 'model.safetensors'}: tensor {name} {BAD}"):
        load_draft(out, model.target)


def test_the_check_syncs_once_and_names_the_first_bad_tensor_in_reading_order():
    """Flags (0-dim, on the tensors' device) wait for ``verify``; integer tensors are not looked at; a finite tensor
    whose sum overflows (fp16) is not refused; a tensor longer than a chunk is looked at in parts."""
    from treadle.models import finite

    check = FiniteCheck("draft.init")
    big = torch.zeros(finite.CHUNK + 5)
    big[-1] = float("-inf")  # in the second chunk
    check.add(torch.ones(3), "a", "f1")
    check.add(torch.arange(4), "ids", "f1")
    check.add(torch.full((4,), 60000.0, dtype=torch.float16), "overflows", "f1")  # its fp16 sum is inf
    check.add(big, "big", "f2")
    check.add(torch.tensor([float("nan")]), "c", "f3")
    assert len(check._flags) == 4 and all(f.dim() == 0 and f.dtype == torch.bool for f in check._flags)
    with pytest.raises(UserError, match=rf"^draft.init f2: tensor big holds 1 inf of {finite.CHUNK + 5} values"):
        check.verify()
    check.add(torch.full((4,), 60000.0, dtype=torch.float16), "overflows", "f1")
    check.verify()  # finite: nothing to refuse
    assert check_tensors({"x": torch.ones(2, dtype=torch.bfloat16)}, "f") is not None
