"""MTP heads on a Qwen3-Next target (``mtp.*`` layout): the exported names against the documented set, a checkpoint
that ships ``mtp.*`` written here without treadle's layout code, and a treadle run end to end.

transformers has no MTP class for Qwen3-Next (``Qwen3NextConfig`` has no ``num_mtp_layers``; its model drops
``mtp.*`` on load), so the consumer contract is written from vLLM's ``qwen3_next_mtp.py`` (vllm-project/vllm
``vllm/model_executor/models/qwen3_next_mtp.py`` @055e47c) and speculators' ``src/speculators/convert/mtp/converter.py``:
``expected_mtp`` below is that layout for a config, by hand, and ``write_shipped`` stitches tensors under those names with safetensors and json only.

Targets: ``HYBRID`` has a Gated-DeltaNet layer (transformers' torch fallback on CPU), ``FULL`` none. The run test
trains and exports on both but decodes with spec-eval on ``FULL`` only: spec-eval's decode loop crops the target's
cache after each verification and a linear-attention layer's recurrent state cannot be cropped (a limit of the decode
loop, not of the MTP kind: the MTP block itself is full attention either way)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.helpers import SPEC_EVAL, draft_args, records, save_target
from treadle.cli import main
from treadle.drafts.mtp.model import MtpModel, build_mtp, draft_from_dir, load_mtp
from treadle.errors import UserError

QN = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
          shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
          linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, use_cache=False)
HYBRID = ["linear_attention", "full_attention"]
FULL = ["full_attention", "full_attention"]
RUN = ("--draft.kind=mtp", "--draft.ttt_steps=2", "--draft.gamma=2", "--draft.loss=mix", "--optim.lr=1e-2",
       "--train.micro_batch_size=2", "--train.eval_at_start=false", "--train.eval_batches=1")


def qwen3_next(layer_types, seed=0):
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3NextConfig(**QN, layer_types=layer_types)).eval()


def expected_mtp(c=QN) -> dict:
    """name -> shape of the ``mtp.*`` tensors a Qwen3-Next checkpoint with this config holds (the documented layout:
    fc over [embedding; hidden], the two pre-fc norms, a full-attention decoder layer flat under ``mtp.layers.0``
    with gated attention (q_proj holds query and gate), q/k norms, the MoE stored per expert plus the shared expert
    and both gates, then ``mtp.norm``; no embedding or head, the target's are shared)."""
    d, hd, E, I, S = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"], \
        c["shared_expert_intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    L = "mtp.layers.0."
    names = {"mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,),
             "mtp.pre_fc_norm_hidden.weight": (d,), "mtp.norm.weight": (d,),
             L + "input_layernorm.weight": (d,), L + "post_attention_layernorm.weight": (d,),
             L + "self_attn.q_proj.weight": (2 * q, d), L + "self_attn.k_proj.weight": (kv, d),
             L + "self_attn.v_proj.weight": (kv, d), L + "self_attn.o_proj.weight": (d, q),
             L + "self_attn.q_norm.weight": (hd,), L + "self_attn.k_norm.weight": (hd,),
             L + "mlp.gate.weight": (E, d), L + "mlp.shared_expert_gate.weight": (1, d),
             L + "mlp.shared_expert.gate_proj.weight": (S, d), L + "mlp.shared_expert.up_proj.weight": (S, d),
             L + "mlp.shared_expert.down_proj.weight": (d, S)}
    for e in range(E):
        names |= {f"{L}mlp.experts.{e}.gate_proj.weight": (I, d), f"{L}mlp.experts.{e}.up_proj.weight": (I, d),
                  f"{L}mlp.experts.{e}.down_proj.weight": (d, I)}
    return names


def tensors_of(model_dir) -> dict:
    index = model_dir / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    out = {}
    for f in files:
        with safe_open(str(model_dir / f), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


def write_shipped(target_dir, out, mtp: dict) -> None:
    """A Qwen3-Next checkpoint that ships ``mtp`` (documented names), written with safetensors and json only."""
    shutil.copytree(target_dir, out)
    save_file(mtp, str(out / "model-00002-of-00002.safetensors"))
    (out / "model.safetensors").rename(out / "model-00001-of-00002.safetensors")
    with safe_open(str(out / "model-00001-of-00002.safetensors"), framework="pt") as h:
        weight_map = dict.fromkeys(h.keys(), "model-00001-of-00002.safetensors")
    weight_map |= dict.fromkeys(mtp, "model-00002-of-00002.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


def rms(x, w, eps):  # Qwen3-Next's RMSNorm: zero-centred weight, (1 + w)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def test_a_shipped_mtp_layer_is_read_and_computed_as_documented(shards, tmp_path):
    """A hybrid (Gated-DeltaNet + full attention) target whose checkpoint ships ``mtp.*``: transformers drops the
    keys, treadle reads them, and the module computes ``lm_head(norm(block(fc(cat[norm_e(emb), norm_h(h)]))))``
    with each documented tensor where the layout says (a swapped norm or concat order changes the logits)."""
    from transformers import AutoModelForCausalLM

    target_dir = save_target(qwen3_next(HYBRID), shards, tmp_path / "target")
    g = torch.Generator().manual_seed(3)
    shipped = {k: torch.randn(s, generator=g) * (0.3 if len(s) > 1 else 0.1) for k, s in expected_mtp().items()}
    write_shipped(target_dir, tmp_path / "shipped", shipped)
    assert not [k for k in AutoModelForCausalLM.from_pretrained(tmp_path / "shipped").state_dict() if "mtp" in k]

    class Cfg:
        target, init = str(tmp_path / "shipped"), None

    model, _, _ = build_mtp(Cfg, 512, None)
    model.eval()
    draft, target, eps = model.draft_model, model.target, QN.get("rms_norm_eps", 1e-6)
    assert isinstance(draft.mtp_block.self_attn, torch.nn.Module) and not hasattr(draft.mtp_block, "linear_attn")
    # The module's step 1 against the documented math, row by row (no position-0 zeroing for Qwen3-Next).
    text = torch.randint(0, 512, (1, 12), generator=g)
    pos = torch.arange(12)[None]
    with torch.no_grad():
        out = model(text, pos, steps=1)
        h = target.model(input_ids=text, use_cache=False).last_hidden_state
        emb = target.get_input_embeddings()(torch.cat((text[:, 1:], text[:, -1:]), dim=1))
        x = torch.cat((rms(emb, shipped["mtp.pre_fc_norm_embedding.weight"], eps),
                       rms(h, shipped["mtp.pre_fc_norm_hidden.weight"], eps)), dim=-1) @ shipped["mtp.fc.weight"].T
        mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
        x = draft.mtp_block(x, attention_mask=mask, position_embeddings=model.rotary(x, pos), position_ids=pos)
        want = target.lm_head(rms(x, shipped["mtp.norm.weight"], eps))
    # the block's own weights came from the shipped names (experts fused from per-expert tensors)
    block = draft.mtp_block.state_dict()
    for e in range(QN["num_experts"]):
        L = f"mtp.layers.0.mlp.experts.{e}."
        assert torch.equal(block["mlp.experts.gate_up_proj"][e],
                           torch.cat((shipped[L + "gate_proj.weight"], shipped[L + "up_proj.weight"])))
        assert torch.equal(block["mlp.experts.down_proj"][e], shipped[L + "down_proj.weight"])
    for k in ("self_attn.q_proj.weight", "mlp.shared_expert_gate.weight", "input_layernorm.weight"):
        assert torch.equal(block[k], shipped["mtp.layers.0." + k])
    torch.testing.assert_close(out.logits[0][:, :-1], want[:, :-1], rtol=1e-4, atol=1e-4)
    # Trap 4 on the reading side: a layer nested as mtp.model.layers.0.* is refused in one line, not half loaded.
    nested = {k.replace("mtp.layers.", "mtp.model.layers."): v for k, v in shipped.items()}
    write_shipped(target_dir, tmp_path / "nested", nested)
    with pytest.raises(UserError, match=r"unknown \['model\.layers\.0\."):
        draft_from_dir(tmp_path / "nested", target, "draft.init")


@pytest.mark.parametrize("layer_types", [FULL, HYBRID], ids=["full", "hybrid"])
def test_qwen3_next_run_exports_the_documented_layout_and_decodes_losslessly(shards, tmp_path, layer_types):
    target_dir = save_target(qwen3_next(layer_types), shards, tmp_path / "target")
    a = tmp_path / "a"
    assert main(draft_args(shards, target_dir, a, "--train.max_steps=3", *RUN)) == 0
    for key in ("acc_1", "acc_2", "eal", "draft_ce", "eval_loss"):
        assert records(a, key), key

    want = expected_mtp()
    # Stand-alone: the mtp.* tensors alone, beside the target's config.
    alone = tensors_of(a / "draft")
    assert {k: tuple(v.shape) for k, v in alone.items()} == want
    config = json.loads((a / "draft" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["num_nextn_predict_layers"] == 1
    # Stitched: every mtp.* key and shape exactly the documented set, the target's tensors byte-identical, flat.
    stitched = a / "draft" / "stitched"
    theirs, ours = tensors_of(target_dir), tensors_of(stitched)
    mtp = {k: tuple(v.shape) for k, v in ours.items() if k.startswith("mtp.")}
    assert mtp == want and not [k for k in ours if k.startswith("mtp.model.") or ".mtp." in k]
    assert ours.keys() - mtp.keys() == theirs.keys()
    # cross-check of the hand-written set: the block is stored as the target stores its own full-attention layer
    layer = {"mtp.layers.0." + k[len("model.layers.1."):]: tuple(t.shape) for k, t in theirs.items()
             if k.startswith("model.layers.1.")}
    assert layer == {k: s for k, s in want.items() if k.startswith("mtp.layers.0.")}
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and ours[k].shape == t.shape
        assert ours[k].contiguous().view(torch.uint8).equal(t.contiguous().view(torch.uint8)), k
    assert all(torch.equal(ours[k], alone[k]) for k in want)
    assert json.loads((stitched / "config.json").read_text())["num_nextn_predict_layers"] == 1

    # draft.init from either export restores the trained module exactly (the stand-alone one is the run's weights).
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    trained = load_mtp(a / "draft", target).draft_model.state_dict()
    for init in (a / "draft", stitched):
        got = draft_from_dir(init, target, "draft.init").state_dict()
        assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in trained)
    assert isinstance(load_mtp(stitched, target), MtpModel)

    # spec-eval with the export: greedy output equals the target's (lossless by construction of the decode loop).
    # A hybrid target is refused in one line: the loop cannot crop a Gated-DeltaNet layer's state (module docstring).
    out = tmp_path / "spec.json"
    code = main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(a / "draft"), "--num-prompts", "2",
                 "--gamma", "2", "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)])
    if layer_types == HYBRID:
        assert code == 2 and not out.exists()
        return
    assert code == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "mtp" and 1.0 <= got["tau"] <= 3.0


def test_qwen3_5_text_targets_take_the_same_layout_with_their_count_key():
    """Qwen3.5 text models (dense here) use the Qwen layout under ``mtp_num_hidden_layers``: a dense checkpoint's
    15 ``mtp.*`` keys (the research note's count for Qwen3.5-4B), and a target storing two modules is refused."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from treadle.drafts.mtp import layout
    from treadle.drafts.mtp.model import MtpDraft, mtp_config

    dense = {k: v for k, v in QN.items() if "expert" not in k}
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**dense, mtp_num_hidden_layers=1)).eval()
    draft = MtpDraft(target)
    names = {"mtp." + k for k in layout.to_checkpoint(draft.state_dict(), draft.family)}
    want = {k for k in expected_mtp() if "expert" not in k and ".mlp.gate." not in k} | {
        f"mtp.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert names == want and len(names) == 15
    assert layout.count_keys(target.config.to_dict()) == {"mtp_num_hidden_layers": 1}
    target.config.mtp_num_hidden_layers = 2
    with pytest.raises(UserError, match="mtp_num_hidden_layers = 1"):
        mtp_config(target, "draft.target x")
