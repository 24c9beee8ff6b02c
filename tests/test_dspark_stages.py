"""DSpark stages a checkpoint ships (drafts/dspark/stages.py): found and checked as their consumers load them, and
stitched back into a copy of the checkpoint with every other tensor's bytes and the config untouched.

Fixtures: tiny random checkpoints saved by transformers' own classes (DeepseekV4Config, MistralLarge4Config), the
stage tensors then added to the saved safetensors the way the released checkpoints carry them (DeepSeek-V4-Flash-0731:
``mtp.{s}.*`` in a shard of the sharded checkpoint, the ``dspark_*`` keys in config.json; Mistral Large 4:
``mtp_dspark.*``), which transformers' loaders drop (asserted)."""

import json

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


def test_a_dspark_run_on_a_target_with_stages_is_refused(v4):
    """Not a new draft trained beside the stages the target ships: one line saying what is missing."""
    from treadle.drafts.dspark.model import build_dspark

    class Cfg:
        target, init = str(v4), None

    with pytest.raises(UserError, match=r"ships 2 DSpark stages .* does not implement yet"):
        build_dspark(Cfg, V, None)
