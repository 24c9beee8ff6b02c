"""DSpark stages a checkpoint ships (drafts/dspark/stages.py): found and checked as their consumers load them, and
stitched back into a copy of the checkpoint with every other tensor's bytes and the config untouched.

Fixtures: tiny random checkpoints saved by transformers' own classes (DeepseekV4Config, MistralLarge4Config), the
stage tensors then added to the saved safetensors the way the released checkpoints carry them (DeepSeek-V4-Flash-0731:
``mtp.{s}.*`` in a shard of the sharded checkpoint, the ``dspark_*`` keys in config.json; Mistral Large 4:
``mtp_dspark.*``), which transformers' loaders drop (asserted)."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from treadle.drafts.dspark import stages
from treadle.errors import UserError
from treadle.models.checkpoint_files import INDEX, safetensors_files

D, V, RANK, HC, EXPERTS, STAGES = 64, 512, 16, 2, 4, 2
TAPS = [0, 1]
V4 = dict(vocab_size=V, hidden_size=D, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
          head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=EXPERTS, n_shared_experts=1,
          hc_mult=HC, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=16,
          max_position_embeddings=512, layer_types=["sliding_attention"] * 2, mlp_layer_types=["hash_moe", "moe"])
DSPARK_KEYS = dict(dspark_block_size=4, dspark_target_layer_ids=TAPS, dspark_noise_token_id=V - 1,
                   dspark_markov_rank=RANK, dspark_num_stages=STAGES)


def tensors_of(model_dir):
    out = {}
    for f, names in safetensors_files(model_dir).items():
        with safe_open(str(model_dir / f), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in names})
    return out


def stage_tensors(layer: dict, markov: tuple, seed: int) -> dict:
    """``STAGES`` stages: each a copy of a saved target decoder layer (the checkpoint's own names, the kv norm under
    the name the DSpark loaders read), perturbed; stage 0's fusion, the last stage's head and Markov / confidence
    heads (shapes from drafts/dspark/stages.py's consumers)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in range(STAGES):
        for k, t in layer.items():
            k = k.replace("attn.norm.weight", "attn.kv_norm.weight")
            out[f"mtp.{s}.{k}"] = t + 0.01 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
    last = f"mtp.{STAGES - 1}."
    out.update({"mtp.0.main_proj.weight": torch.randn(D, len(TAPS) * D, generator=g),
                "mtp.0.main_norm.weight": torch.ones(D), last + "norm.weight": torch.ones(D),
                last + "hc_head_fn": torch.randn(HC, HC * D, generator=g), last + "hc_head_base": torch.zeros(HC),
                last + "hc_head_scale": torch.ones(1), last + markov[0]: torch.randn(V, RANK, generator=g),
                last + markov[1]: torch.randn(V, RANK, generator=g),
                last + "confidence_head.proj.weight": torch.randn(1, D + RANK, generator=g)})
    return out


def v4_with_stages(path, markov=stages.MARKOV[0], quantized=False):
    """A tiny DeepSeek-V4 checkpoint, sharded, its DSpark stages in a shard of their own (as the released 0731
    checkpoint keeps them in its last shard). ``quantized``: stage 0's shared-expert w1 stored FP8 with its scale."""
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(DeepseekV4Config(**V4)).save_pretrained(path, max_shard_size="60KB")
    saved = tensors_of(path)
    layer = {k[len("model.layers.1."):]: t for k, t in saved.items() if k.startswith("model.layers.1.")}
    extra = stage_tensors(layer, markov, seed=1)
    if quantized:
        w = "mtp.0.ffn.shared_experts.w1.weight"
        extra[w] = extra[w].to(torch.float8_e4m3fn)
        extra["mtp.0.ffn.shared_experts.w1.scale"] = torch.ones(1, 1)
    save_file(extra, str(path / "model-dspark.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / INDEX).read_text())
    index["weight_map"].update(dict.fromkeys(extra, "model-dspark.safetensors"))
    (path / INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **DSPARK_KEYS}, indent=2))
    return path


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return v4_with_stages(tmp_path_factory.mktemp("v4") / "target")


def test_the_stages_transformers_drops_are_found_and_checked(v4):
    from transformers import AutoModelForCausalLM

    assert len(safetensors_files(v4)) > 2  # sharded: the stages' shard and the target's
    loaded = AutoModelForCausalLM.from_pretrained(v4).state_dict()
    assert loaded and not [k for k in loaded if "mtp" in k]  # the premise: transformers drops them on load
    found = stages.find(v4)
    assert found.count == STAGES and found.markov == stages.MARKOV[0]
    assert found.tensors[1]["confidence_head.proj.weight"].shape == (1, D + RANK)
    assert "main_proj.weight" in found.tensors[0] and "main_proj.weight" not in found.tensors[1]
    assert found.names["mtp.1.ffn.experts.3.w2.weight"] == (1, "ffn.experts.3.w2.weight")


@pytest.mark.parametrize("markov", stages.MARKOV, ids=["v4", "v4.1"])
def test_stitch_replaces_the_trained_tensors_and_keeps_every_other_byte(tmp_path, markov):
    target = v4_with_stages(tmp_path / "target", markov)
    last = f"mtp.{STAGES - 1}."
    theirs = tensors_of(target)
    trained = {n: theirs[n] + 0.5 for n in (last + markov[0], last + markov[1], last + "confidence_head.proj.weight",
                                           "mtp.0.main_proj.weight", "mtp.1.attn.wq_b.weight")}
    out = tmp_path / "stitched"
    stages.stitch(target, out, trained)
    ours = tensors_of(out)
    assert ours.keys() == theirs.keys()
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and ours[k].shape == t.shape, k
        want = trained.get(k, t)
        assert ours[k].contiguous().view(torch.uint8).equal(want.contiguous().view(torch.uint8)), k
    for name in ("config.json", INDEX):  # the config unchanged (and the index: every tensor where it was)
        assert (out / name).read_bytes() == (target / name).read_bytes(), name
    for f in safetensors_files(target):  # shards without a trained tensor are the same files
        if f != "model-dspark.safetensors":
            assert (out / f).read_bytes() == (target / f).read_bytes(), f
    with safe_open(str(out / "model-dspark.safetensors"), framework="pt") as h:
        assert h.metadata() == {"format": "pt"}
    assert stages.find(out).count == STAGES  # what the consumers load, still


def test_stages_their_consumers_would_not_load_are_refused(tmp_path, v4):
    from safetensors.torch import load_file

    shard = "model-dspark.safetensors"

    def variant(name, edit):
        d = tmp_path / name
        d.mkdir()
        for p in v4.iterdir():
            (d / p.name).write_bytes(p.read_bytes())
        tensors = load_file(str(v4 / shard))
        edit(tensors)
        save_file(tensors, str(d / shard), metadata={"format": "pt"})
        index = json.loads((d / INDEX).read_text())
        index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != shard or k in tensors}
        index["weight_map"].update(dict.fromkeys(tensors, shard))
        (d / INDEX).write_text(json.dumps(index))
        return d

    last = f"mtp.{STAGES - 1}."
    cases = [("no-confidence", lambda t: t.pop(last + "confidence_head.proj.weight"),
              r"stage mtp.1 lacks \['confidence_head.proj.weight'\]"),
             ("no-expert", lambda t: t.pop("mtp.0.ffn.experts.2.w3.weight"), r"mtp.0 lacks \['ffn.experts.2.w3"),
             ("main-proj", lambda t: t.update({"mtp.0.main_proj.weight": torch.zeros(D, D)}),
              r"mtp.0.main_proj.weight is \(64, 64\), .* makes it \(64, 128\)"),
             ("gap", lambda t: t.update({k.replace("mtp.1.", "mtp.2."): t.pop(k) for k in list(t) if "mtp.1." in k}),
              r"stages mtp.\{s\}.\* are \[0, 2\]")]
    for name, edit, message in cases:
        with pytest.raises(UserError, match=message):
            stages.find(variant(name, edit))
    # The config must carry the keys the engines read.
    bare = variant("no-keys", lambda t: None)
    config = json.loads((bare / "config.json").read_text())
    del config["dspark_markov_rank"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"lacks \['dspark_markov_rank'\]"):
        stages.find(bare)


def test_stitch_refuses_before_writing(tmp_path, v4):
    q = v4_with_stages(tmp_path / "q", quantized=True)
    theirs = tensors_of(q)
    out = tmp_path / "out"
    for trained, message in (({"mtp.0.ffn.shared_experts.w1.weight": torch.zeros(32, D)}, "stored quantized"),
                             ({"model.norm.weight": theirs["model.norm.weight"]}, "not a DSpark stage tensor"),
                             ({"mtp.0.main_norm.weight": torch.ones(D, dtype=torch.float64)}, "would become"),
                             ({"mtp.0.main_norm.weight": torch.ones(D + 1)}, "would become")):
        with pytest.raises(UserError, match=message):
            stages.stitch(q, out, trained)
        assert not out.exists()
    # An FP8 weight without its scale is not what the loaders take.
    assert "scale" in "".join(stages.find(q).tensors[0])


def test_mistral_large4_stages_are_refused_in_one_line(tmp_path):
    """No public loader reads ``mtp_dspark.*`` (drafts/dspark/stages.py says what was searched): refused, not
    guessed at; transformers drops the tensors on load."""
    import transformers

    if not hasattr(transformers, "MistralLarge4Config"):  # the fixture is built by transformers' own class
        pytest.skip(f"transformers {transformers.__version__} has no Mistral Large 4 (mistral_large4)")
    from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration

    text = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1,
                kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, head_dim=16, index_topk=4,
                index_head_dim=8, index_n_heads=2, max_position_embeddings=128)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  image_size=32, patch_size=16)
    path = tmp_path / "ml4"
    torch.manual_seed(0)
    MistralLarge4ForConditionalGeneration(MistralLarge4Config(text_config=text, vision_config=vision)).save_pretrained(
        path)
    tensors = tensors_of(path)
    tensors["mtp_dspark.0.main_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    loaded = MistralLarge4ForConditionalGeneration.from_pretrained(path).state_dict()
    assert not [k for k in loaded if "mtp" in k]
    with pytest.raises(UserError, match=r"^draft.target .* ships mtp_dspark.\* tensors .*no public loader"):
        stages.find(path)


# ----------------------------------------------------------------------------- fine-tuning the stages in place
#
# The reference below is written from the consumer's own code (lightseekorg/tokenspeed @f4d8ec6e:
# runtime/models/deepseek_v4_dspark.py ``forward_backbone`` / ``_forward_stage``, deepseek_v4_dspark_ops/attention.py
# ``dspark_attention_forward_batched`` with its FP8 emulation left out, deepseek_v4_dspark_ops/heads.py, the mHC
# Triton kernels in runtime/layers/deepseek_v4_mhc.py, ``hc_head`` / ``deepseek_v4_select_experts`` in
# runtime/models/deepseek_v4.py), reading the stage tensors by their checkpoint names: plain float64 torch, no
# transformers module.


def _rms(x, w, eps=1e-6):
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


def _rope(x, pos, rd, theta, inverse=False):
    """Adjacent-pair complex RoPE on the last ``rd`` channels (``precompute_dspark_freqs_cis``)."""
    freqs = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    phase = torch.polar(torch.ones(len(pos), rd // 2, dtype=torch.float64), torch.outer(pos.double(), freqs))
    phase = phase.conj() if inverse else phase
    shape = (len(pos),) + (1,) * (x.dim() - 2) + (rd // 2,)
    rot = torch.view_as_real(torch.view_as_complex(x[..., -rd:].unflatten(-1, (-1, 2)).contiguous())
                             * phase.view(shape)).flatten(-2)
    return torch.cat((x[..., :-rd], rot), -1)


def _mhc_pre(res, fn, scale, base, hc, iters, eps=1e-6, hc_eps=1e-6):
    """The mHC kernels' pre / post / comb and the collapsed layer input, per token: res [Q, hc, d]."""
    flat = res.flatten(1)
    mix = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc).softmax(-1) + hc_eps  # [in, out]
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return (pre[..., None] * res).sum(1), post, comb


def _mhc_post(h, res, post, comb):
    return post[..., None] * h[:, None] + torch.einsum("qio,qid->qod", comb, res)


def _ffn(x, w, c):
    def swiglu(x, w1, w3, w2):
        lim = c["swiglu_limit"]
        return (torch.nn.functional.silu((x @ w1.T).clamp(max=lim)) * (x @ w3.T).clamp(-lim, lim)) @ w2.T

    scores = torch.sqrt(torch.nn.functional.softplus(x @ w["ffn.gate.weight"].T))
    ids = torch.topk(scores + w["ffn.gate.bias"], c["num_experts_per_tok"], -1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
    out = swiglu(x, *(w[f"ffn.shared_experts.w{i}.weight"] for i in (1, 3, 2)))
    for q in range(x.shape[0]):
        for e, g in zip(ids[q].tolist(), weights[q]):
            out[q] += g * swiglu(x[q], *(w[f"ffn.experts.{e}.w{i}.weight"] for i in (1, 3, 2)))
    return out


def _attention(x, main_x, ctx_pos, blk_pos, w, c):
    H, hd, rd, g = c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"], c["o_groups"]
    theta = c["rope_theta"]
    q = (_rms(x @ w["attn.wq_a.weight"].T, w["attn.q_norm.weight"]) @ w["attn.wq_b.weight"].T).unflatten(-1, (H, hd))
    q = _rope(_rms(q, None), blk_pos, rd, theta)
    kv = torch.cat([_rope(_rms(h @ w["attn.wkv.weight"].T, w["attn.kv_norm.weight"]), p, rd, theta)
                    for h, p in ((main_x, ctx_pos), (x, blk_pos))])
    scores = torch.einsum("qhd,kd->qhk", q, kv) * hd ** -0.5
    m = scores.amax(-1, keepdim=True)
    p = (scores - m).exp()
    out = torch.einsum("qhk,kd->qhd", p, kv) / (p.sum(-1) + (w["attn.attn_sink"][None] - m[..., 0]).exp())[..., None]
    out = _rope(out, blk_pos, rd, theta, inverse=True).reshape(len(blk_pos), g, -1)
    out = torch.einsum("qgd,grd->qgr", out, w["attn.wo_a.weight"].view(g, c["o_lora_rank"], -1)).flatten(1)
    return out @ w["attn.wo_b.weight"].T


def reference_block(ckpt, c, features, ids, anchor, window):
    """The last stage's normed output [block, d] of the block anchored at index ``anchor`` (positions = indices)."""
    S, hc, bs = c["dspark_num_stages"], c["hc_mult"], c["dspark_block_size"]
    st = [{k[len(f"mtp.{s}."):]: v for k, v in ckpt.items() if k.startswith(f"mtp.{s}.")} for s in range(S)]
    ctx_pos = torch.arange(max(0, anchor - window), anchor)
    blk_pos = torch.arange(anchor, anchor + bs)
    main_x = _rms(features[ctx_pos] @ st[0]["main_proj.weight"].T, st[0]["main_norm.weight"])
    tokens = torch.full((bs,), c["dspark_noise_token_id"])
    tokens[0] = ids[anchor]
    res = ckpt["model.embed_tokens.weight"][tokens][:, None].repeat(1, hc, 1)
    for w in st:
        x, post, comb = _mhc_pre(res, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], hc,
                                 c["hc_sinkhorn_iters"])
        res = _mhc_post(_attention(_rms(x, w["attn_norm.weight"]), main_x, ctx_pos, blk_pos, w, c), res, post, comb)
        x, post, comb = _mhc_pre(res, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"], hc, c["hc_sinkhorn_iters"])
        res = _mhc_post(_ffn(_rms(x, w["ffn_norm.weight"]), w, c), res, post, comb)
    last = st[-1]
    flat = res.flatten(1)  # tokenspeed's hc_head
    mix = (flat @ last["hc_head_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mix * last["hc_head_scale"] + last["hc_head_base"]) + 1e-6
    return _rms((pre[..., None] * res).sum(1), last["norm.weight"])


@pytest.mark.parametrize("markov", stages.MARKOV, ids=["v4", "v4.1"])
def test_the_stage_forward_is_the_consumers_in_float64(tmp_path, markov):
    """The training forward of several anchored blocks (a window shorter than the context, so it matters) equals
    the consumer's stage math per block, and the slot logits / confidence read the checkpoint's Markov and
    confidence tensors. fp32 bounds: transformers' V4 modules (mHC, RoPE, norms) compute in fp32 whatever the
    input dtype."""
    from transformers import AutoModelForCausalLM

    from treadle.drafts.dspark import v4

    path = v4_with_stages(tmp_path / "t", markov)
    ckpt = {k: v.double() for k, v in tensors_of(path).items()}
    c = json.loads((path / "config.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").double()
    draft = v4.load_stages(path, target.config, stages.find(path)).double()
    draft.window = 3
    model = v4.StagesModel(target, draft).double()
    T, g = 12, torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, T), generator=g)
    features = torch.randn(1, T, len(TAPS) * D, generator=g, dtype=torch.float64)
    anchors = torch.tensor([[1, 5, 8]])
    positions = torch.arange(T)[None]
    with torch.no_grad():
        got = model._blocks(ids, positions, features, anchors, torch.ones_like(ids))
        prev = torch.randint(0, V, got.shape[:-1], generator=g)
        logits = model.slot_logits(got, draft.markov_w1(prev))
        conf = draft.confidence_logit(got, draft.markov_w1(prev))
    last = f"mtp.{STAGES - 1}."
    for j, a in enumerate(anchors[0].tolist()):
        want = reference_block(ckpt, c, features[0], ids[0], a, window=3)
        torch.testing.assert_close(got[0, j], want, rtol=1e-5, atol=1e-5)
        e = ckpt[last + markov[0]][prev[0, j]]
        torch.testing.assert_close(logits[0, j], want @ ckpt["head.weight"].T + e @ ckpt[last + markov[1]].T,
                                   rtol=1e-5, atol=1e-5)
        proj = ckpt[last + "confidence_head.proj.weight"]
        torch.testing.assert_close(conf[0, j], (torch.cat((want, e), -1) @ proj.T)[:, 0], rtol=1e-5, atol=1e-5)
    # What the run feeds it: each tapped layer's output averaged over its mHC streams (tokenspeed's capture).
    taps = []
    hooks = [target.model.layers[i].register_forward_hook(lambda m, i, o: taps.append(o.mean(-2))) for i in TAPS]
    with torch.no_grad():
        _, fed = model._target_forward(ids, positions, hidden=True)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(fed, torch.cat(taps, -1), rtol=0, atol=0)


@pytest.fixture(scope="module")
def v4_target(shards, tmp_path_factory):
    """The DeepSeek-V4.1 fixture with the shards' tokenizer: a target a run trains against."""
    from transformers import AutoTokenizer

    path = v4_with_stages(tmp_path_factory.mktemp("v41") / "target", stages.MARKOV[1])
    AutoTokenizer.from_pretrained(shards / "tok").save_pretrained(path)
    return path


def test_a_dspark_run_fine_tunes_the_stages_and_stitches_them_back(shards, v4_target, tmp_path, capsys):
    """``draft.kind = "dspark"`` on a target that ships stages trains them (the loss falls), exports them under the
    checkpoint's names and stitches them into a copy of the target (every tensor not trained byte for byte), and
    spec-eval decodes the stitched checkpoint losslessly."""
    from tests.helpers import SPEC_EVAL, draft_args, records
    from treadle.cli import main

    run, resumed = tmp_path / "run", tmp_path / "resumed"
    argv = ("--draft.kind=dspark", "--train.max_steps=8", "--draft.anchors=4", "--optim.lr=1e-2", "--draft.gamma=3",
            "--draft.loss=kl", "--checkpoint.every=4")
    assert main(draft_args(shards, v4_target, run, *argv)) == 0
    loss = records(run)
    assert min(loss[7], loss[8]) < loss[1]
    # Resume from step 4 elsewhere: steps 5-8 bit for bit.
    assert main(draft_args(shards, v4_target, resumed, *argv,
                           f"--checkpoint.resume={run / 'checkpoints' / 'step_4'}")) == 0
    assert sorted(records(resumed)) == [5, 6, 7, 8] and all(records(resumed)[k] == loss[k] for k in (5, 6, 7, 8))
    # What a stages run does not do yet: one line each, nothing trained (an engine of several processes is refused
    # before one is started: checked on the config, as torchrun would hand it over).
    capsys.readouterr()
    assert main(draft_args(shards, v4_target, tmp_path / "refused", *argv, f"--draft.features={tmp_path}",
                           "--draft.max_position_offset=0")) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]  # the target's load note aside
    assert len(errors) == 1 and "draft.features with the DSpark stages" in errors[0], errors
    from treadle.config import load_config
    from treadle.drafts.dspark.v4 import refuse_unbuilt

    for extra, want in (("--distributed.engine=fsdp2", "distributed.engine = 'fsdp2' is not built for them"),
                        ("--distributed.tensor_parallel=2", "distributed.tensor_parallel = 2 is not built")):
        with pytest.raises(UserError, match=re.escape(want)):
            refuse_unbuilt(load_config(None, draft_args(shards, v4_target, run, *argv, extra)[1:]))
    exported = tensors_of(run / "draft")
    theirs, ours = tensors_of(v4_target), tensors_of(run / "draft" / "stitched")
    assert ours.keys() == theirs.keys() and exported.keys() == {k for k in theirs if k.startswith("mtp.")}
    trained = {k for k in exported if not k.endswith("ffn.gate.bias")}
    changed = set()
    for k, t in theirs.items():
        same = ours[k].dtype == t.dtype and ours[k].view(torch.uint8).equal(t.contiguous().view(torch.uint8))
        if k in trained:
            assert torch.equal(ours[k], exported[k]), k  # the trained value, where it was
            changed |= set() if same else {k}
        else:
            assert same, k  # not trained: the target's bytes
    assert {"mtp.0.main_proj.weight", "mtp.1.markov_head.embed.weight", "mtp.1.confidence_head.proj.weight",
            "mtp.0.attn.wq_b.weight", "mtp.1.hc_ffn_fn"} <= changed
    for name in ("config.json", INDEX):
        assert (run / "draft" / "stitched" / name).read_bytes() == (v4_target / name).read_bytes()
    out = tmp_path / "spec.json"
    capsys.readouterr()
    assert main([*SPEC_EVAL, "--target", str(v4_target), "--draft", str(run / "draft" / "stitched"), "--num-prompts",
                 "2", "--gamma", "3", "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "dspark-stages"


def test_runs_on_stages_refuse_quantized_stages_and_contradicting_keys(tmp_path, v4):
    """FP8 / FP4 stage tensors: refused (treadle does not re-quantize); a [draft] key the stages decide must match."""
    from treadle.drafts.dspark.build import build_dspark

    class Cfg:
        target, init, block_size, feature_layers, num_layers, mask_token_id, markov_rank = (None,) * 7

    q = Cfg()
    q.target = str(v4_with_stages(tmp_path / "q", quantized=True))
    with pytest.raises(UserError, match=r"stores its DSpark stages quantized \(mtp.0.ffn.shared_experts.w1"):
        build_dspark(q, V, None)
    wrong = Cfg()
    wrong.target, wrong.block_size = str(v4), 7
    with pytest.raises(UserError, match=r"draft.block_size = 7 but the DSpark stages of draft.target .* have 4"):
        build_dspark(wrong, V, None)
