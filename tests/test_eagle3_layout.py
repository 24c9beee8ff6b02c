"""The EAGLE-3 export is what the serving engines load: a contract written from the consumers' code, not treadle's.

``EngineEagle3`` below is a transcription of the EAGLE-3 draft as vLLM and SGLang run it
(vllm-project/vllm ``vllm/model_executor/models/llama_eagle3.py`` @00bd1493: ``LlamaDecoderLayer.forward`` with
``layer_idx == 0`` and ``_norm_after_residual``, ``LlamaModel.forward``, ``load_weights``, ``compute_logits``,
``combine_hidden_states``; sgl-project/sglang ``python/sglang/srt/models/llama_eagle3.py`` @d737979, the same
forward), written in plain torch. It reads only the exported directory, by the consumers' names and config
fields: the rotary is rebuilt from the draft's own config.json, the features are the target's
``output_hidden_states`` entries named by ``eagle_aux_hidden_state_layer_ids``, and draft ids become target ids
through ``d2t`` offsets. It does not import treadle's model. What it cannot prove: that upstream has not moved
since those commits.
"""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from treadle.checkpoint.export import export_draft
from treadle.config.schema import DraftConfig
from treadle.errors import UserError
from treadle.drafts.eagle3.model import Eagle3Draft, Eagle3Model, load_eagle3
from treadle.drafts.targets import target_identity

# 8 layers: the engines' default features (2, N/2, N - 3) = (2, 4, 5) are distinct; a llama3-scaled rotary with a
# non-default theta, so a draft config without the target's rope would compute other logits.
TARGET = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
              rope_theta=50000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
LAYERS = (2, 4, 5)
DRAFT_VOCAB = 96
T = 12

# ModelOpt's LLAMA_EAGLE_SINGLE_LAYER required keys, plus what SpecForge's sglang export requires.
REQUIRED = {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {
    f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {
    "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
    "norm.weight", "fc.weight", "lm_head.weight", "d2t", "t2d"}


class EngineEagle3:
    """The EAGLE-3 draft as the engines run it, from an exported directory (see the module docstring)."""

    def __init__(self, directory):
        self.config = AutoConfig.from_pretrained(directory)
        c = self.config
        # vLLM's load_weights: "midlayer." is read as "layers.0."; t2d is skipped; d2t is draft_id_to_target_id.
        self.w = {k.replace("midlayer.", "layers.0."): v.float() if v.is_floating_point() else v for k, v in
                  load_file(str(directory / "model.safetensors")).items() if "t2d" not in k}
        self.draft_id_to_target_id = self.w.pop("d2t")
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.rotary = LlamaRotaryEmbedding(config=c)

    def rms(self, x, name):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(var + self.config.rms_norm_eps))

    def rope(self, x, positions):
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def qkv(self, embeds, hidden_states, positions):
        """Layer 0's first half: input_layernorm on the embeddings, hidden_norm on the feature, concatenated (embeds
        first), then q/k/v over the 2d-wide input with RoPE. The residual is the un-normalized feature."""
        c, p = self.config, "layers.0."
        x = torch.cat([self.rms(embeds, p + "input_layernorm.weight"), self.rms(hidden_states, p + "hidden_norm.weight")], -1)
        B, L, _ = x.shape

        def heads(t, n):
            return t.view(B, L, n, self.head_dim).transpose(1, 2)

        q = heads(x @ self.w[p + "self_attn.q_proj.weight"].T, c.num_attention_heads)
        k = heads(x @ self.w[p + "self_attn.k_proj.weight"].T, c.num_key_value_heads)
        v = heads(x @ self.w[p + "self_attn.v_proj.weight"].T, c.num_key_value_heads)
        return self.rope(q, positions), self.rope(k, positions), v

    def rest(self, attn, residual):
        """o_proj, the residual, post_attention_layernorm -> MLP -> residual; (norm(x), x): LlamaModel's (hidden,
        prenorm) pair. The MLP is SiLU-gated (hidden_act)."""
        p = "layers.0."
        B, H, L, D = attn.shape
        x = residual + attn.transpose(1, 2).reshape(B, L, H * D) @ self.w[p + "self_attn.o_proj.weight"].T
        h = self.rms(x, p + "post_attention_layernorm.weight")
        gate, up = h @ self.w[p + "mlp.gate_proj.weight"].T, h @ self.w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        return self.rms(x, "norm.weight"), x

    def attend(self, q, k, v, mask):
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim ** 0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    def compute_logits(self, hidden):
        """lm_head over the draft vocabulary, scattered into the target's by arange + d2t, -inf elsewhere."""
        logits = hidden @ self.w["lm_head.weight"].T
        targets = torch.arange(self.config.draft_vocab_size) + self.draft_id_to_target_id
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., targets] = logits
        return full

    def two_steps(self, target, input_ids):
        """Target-vocabulary logits of the first two draft steps at every row t: step 0 reads the target's features
        of token t and the embedding of token t + 1 at position t; step 1 feeds step 0's pre-norm output (no fc) with
        the embedding of token t + 2 at position t + 1, and attends to step 0's keys of rows <= t and its own."""
        with torch.no_grad():
            out = target(input_ids=input_ids, output_hidden_states=True)
            ids = self.config.eagle_aux_hidden_state_layer_ids
            aux = torch.cat([out.hidden_states[i] for i in ids], dim=-1)  # ascending layer order
            embed = target.get_input_embeddings()
            B, L = input_ids.shape
            nxt = torch.cat((input_ids, input_ids[:, -1:].expand(B, 2)), dim=1)
            positions = torch.arange(L)[None]
            # Step 0: combine_hidden_states (fc) on the target's states, a causal pass over the rows.
            feature = aux @ self.w["fc.weight"].T
            q0, k0, v0 = self.qkv(embed(nxt[:, 1:L + 1]), feature, positions)
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            normed0, prenorm0 = self.rest(self.attend(q0, k0, v0, causal), feature)
            # Step 1: one query per row t; its keys are step 0's rows 0..t and its own.
            q1, k1, v1 = self.qkv(embed(nxt[:, 2:L + 2]), prenorm0, positions + 1)
            k = torch.cat((k0, k1), dim=2)
            v = torch.cat((v0, v1), dim=2)
            mask = torch.cat((causal, torch.eye(L, dtype=torch.bool)), dim=1)
            normed1, _ = self.rest(self.attend(q1, k, v, mask), prenorm0)
            return self.compute_logits(normed0), self.compute_logits(normed1)


def _sharp(draft):
    """Random weights away from 1 and from the init's scale: norm placement and attention visibly matter."""
    g = torch.Generator().manual_seed(7)
    for name, p in draft.named_parameters():
        p.data = (torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 2 else 0.5) + (0.0 if p.dim() == 2 else 1.0))


@pytest.fixture(params=[DRAFT_VOCAB, None], ids=["reduced", "full"])
def exported(tmp_path, request):
    """(Eagle3Model, target, export dir): a draft of an 8-layer llama3-rotary target, exported; its head scores
    DRAFT_VOCAB tokens (a d2t map) or the target's whole vocabulary (zero offsets, an all-true t2d)."""
    return exported_draft(tmp_path, request.param)


def exported_draft(tmp_path, vocab: int | None, to: str = "draft", ttt_steps: int | None = None):
    """``exported``'s draft, in the export ``to`` names (tests/test_speculators_format.py: "speculators")."""
    request = SimpleNamespace(param=vocab)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(LlamaConfig(**TARGET)).eval()
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    draft = Eagle3Draft(target.config, LAYERS, request.param)
    _sharp(draft)
    if request.param:
        draft.set_vocabulary(torch.randperm(TARGET["vocab_size"], generator=torch.Generator().manual_seed(3))[
            :DRAFT_VOCAB].sort().values)
    model = Eagle3Model(target, draft).eval()
    out = tmp_path / "export"
    export_draft(model, model.state_dict(), out, target_dir, target_identity(target_dir, target),
                 DraftConfig(kind="eagle3", target=str(target_dir), ttt_steps=ttt_steps), step=0, to=to)
    return model, target, out


def test_the_export_config_is_the_eagle_layout_the_engines_read(exported):
    model, target, out = exported
    c = AutoConfig.from_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    assert c.model_type == "llama" and raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c.num_hidden_layers == 1 and c.tie_word_embeddings is False
    assert c.vocab_size == TARGET["vocab_size"] and c.draft_vocab_size == model.draft_model.vocab_size
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (
        target.config.hidden_size, target.config.num_attention_heads, target.config.num_key_value_heads,
        target.config.head_dim, target.config.intermediate_size)
    assert c.max_position_embeddings == TARGET["max_position_embeddings"]
    assert c.rope_parameters == target.config.rope_parameters
    # transformers 4 readers: the same rotary as legacy keys (theta and the llama3 scaling).
    assert raw["rope_theta"] == TARGET["rope_theta"] and raw["rope_scaling"]["rope_type"] == "llama3"
    assert raw["attention_bias"] is False and raw["mlp_bias"] is False
    # vLLM reads output_hidden_states indices at the top level; SGLang / SpecForge decoder-output indices, nested.
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert raw["norm_before_residual"] is False
    assert raw["dtype"] == raw["torch_dtype"] == "float32"
    # treadle's own metadata rides along.
    assert raw["treadle_draft_kind"] == "eagle3" and raw["target"]["config_fingerprint"] and raw["training"]


def test_the_export_weights_carry_the_consumers_names_and_shapes(exported):
    model, _, out = exported
    w = load_file(out / "model.safetensors")
    assert set(w) == REQUIRED
    assert not [k for k in w if k.startswith(("model.", "draft_model.")) or "embed" in k]
    c = json.loads((out / "config.json").read_text())
    d, hd, I = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    shapes = {"fc.weight": (d, 3 * d), "midlayer.self_attn.q_proj.weight": (c["num_attention_heads"] * hd, 2 * d),
              "midlayer.self_attn.k_proj.weight": (c["num_key_value_heads"] * hd, 2 * d),
              "midlayer.self_attn.v_proj.weight": (c["num_key_value_heads"] * hd, 2 * d),
              "midlayer.self_attn.o_proj.weight": (d, c["num_attention_heads"] * hd),
              "midlayer.mlp.gate_proj.weight": (I, d), "midlayer.mlp.up_proj.weight": (I, d),
              "midlayer.mlp.down_proj.weight": (d, I), "lm_head.weight": (c["draft_vocab_size"], d),
              "d2t": (c["draft_vocab_size"],), "t2d": (c["vocab_size"],)}
    for k, shape in shapes.items():
        assert tuple(w[k].shape) == shape, k
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert int(w["t2d"].sum()) == model.draft_model.vocab_size
    if not model.draft_model.reduced:  # the identity map every engine accepts
        assert not w["d2t"].any() and w["t2d"].all()


def test_the_engines_forward_on_the_export_reproduces_treadles_draft_logits(exported):
    model, target, out = exported
    engine = EngineEagle3(out)
    ids = torch.randint(0, TARGET["vocab_size"], (2, T), generator=torch.Generator().manual_seed(5))
    ref0, ref1 = engine.two_steps(target, ids)
    with torch.no_grad():
        ours = model(ids, torch.arange(T).expand(2, T), steps=2).logits
    draft = model.draft_model
    to_target = draft.draft_to_target() if draft.reduced else torch.arange(draft.vocab_size)
    for ref, got, rows in ((ref0, ours[0], T - 1), (ref1, ours[1], T - 2)):  # rows whose next tokens are real
        assert torch.isinf(ref[..., :rows, :]).sum() == 2 * rows * (TARGET["vocab_size"] - draft.vocab_size)
        torch.testing.assert_close(ref[:, :rows, to_target], got[:, :rows], rtol=0, atol=1e-5)
        assert torch.equal(ref[:, :rows].argmax(-1), to_target[got[:, :rows].argmax(-1)])
    # The chain guesses (the drafter's proposals) are the engine's argmaxes, in target ids.
    guesses = model.chain_guesses(ids, 2)
    assert torch.equal(guesses[0][:, 1:T], ref0[:, : T - 1].argmax(-1))


def test_treadle_loads_its_export_and_a_draft_trained_elsewhere_in_the_same_layout(exported, tmp_path):
    model, target, out = exported
    ids = torch.randint(0, TARGET["vocab_size"], (1, T), generator=torch.Generator().manual_seed(6))
    positions = torch.arange(T)[None]
    with torch.no_grad():
        want = model(ids, positions, steps=2).logits
        got = load_eagle3(out, target)(ids, positions, steps=2).logits
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # As another trainer writes it: no treadle keys, vLLM's layers.0.* spelling, no t2d (the engines skip it).
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = {k: v for k, v in json.loads((out / "config.json").read_text()).items()
              if k not in ("treadle_draft_kind", "target", "target_config", "training")}
    (foreign / "config.json").write_text(json.dumps(config))
    w = load_file(out / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in w.items() if k != "t2d"},
              str(foreign / "model.safetensors"))
    with torch.no_grad():
        again = load_eagle3(foreign, target)(ids, positions, steps=2).logits
    assert all(torch.equal(a, b) for a, b in zip(want, again))
    # Only the nested (SGLang / SpecForge) ids: decoder-output indices, one less than treadle's.
    config.pop("eagle_aux_hidden_state_layer_ids")
    (foreign / "config.json").write_text(json.dumps(config))
    assert load_eagle3(foreign, target).draft_model.feature_layers == LAYERS


@pytest.mark.parametrize("change", ["rename", "drop", "extra"])
def test_a_weight_the_layout_has_no_name_for_or_lacks_fails_the_export(exported, tmp_path, change):
    model, target, _ = exported
    state = dict(model.state_dict())
    if change == "rename":
        state["draft_model.final_norm2.weight"] = state.pop("draft_model.final_norm.weight")
    elif change == "drop":
        del state["draft_model.feature_norm.weight"]
    else:
        state["draft_model.q_proj.bias"] = torch.zeros(4)
    out = tmp_path / "bad"
    with pytest.raises(UserError, match="EAGLE-3 layout"):
        export_draft(model, state, out, tmp_path / "target", {"config_fingerprint": "x"},
                     DraftConfig(kind="eagle3", target="t"))
    assert not out.exists()


def test_a_treadle_export_of_the_layout_before_this_one_is_refused_in_one_line(exported):
    """treadle's earlier EAGLE-3 exports (its own names, no architectures) are not read as something else."""
    _, target, out = exported
    (out / "config.json").write_text(json.dumps({"treadle_draft_kind": "eagle3", "feature_layers": list(LAYERS)}))
    with pytest.raises(UserError, match="treadle export"):
        load_eagle3(out, target)


def test_a_foreign_weight_name_fails_the_load(exported, tmp_path):
    """SGLang would skip it silently and serve a half-random draft; treadle refuses it."""
    _, target, out = exported
    w = load_file(out / "model.safetensors")
    w["midlayer.self_attn.q_norm.weight"] = w.pop("midlayer.hidden_norm.weight")
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="hidden_norm"):
        load_eagle3(out, target)


@pytest.mark.parametrize("family", ["gemma3_text", "glm4"])
def test_the_export_of_a_draft_for_gemma3_or_glm4_computes_the_draft_logits_in_the_engines_forward(family, tmp_path):
    """Gemma 3 keeps a rotary per layer type (full attention: theta 1e6, sliding: 1e4), GLM-4 rotates half of each
    head: the export's rotary settings are the ones the draft layer computed with (the full-attention set over the
    whole head), so the engines' Llama layer built from config.json reproduces the draft's logits (fp32)."""
    import transformers

    from tests.families import COMMON, FAMILIES

    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**COMMON, **extra, "num_hidden_layers": 4}))
    target_dir = tmp_path / "target"
    target.eval().save_pretrained(target_dir)
    draft = Eagle3Draft(target.config, (1, 2, 3))
    _sharp(draft)
    model = Eagle3Model(target, draft).eval()
    out = tmp_path / "export"
    export_draft(model, model.state_dict(), out, target_dir, target_identity(target_dir, target),
                 DraftConfig(kind="eagle3", target=str(target_dir)), step=0)
    raw = json.loads((out / "config.json").read_text())
    rope = target.config.rope_parameters
    if family == "gemma3_text":
        assert rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
        assert raw["rope_theta"] == rope["full_attention"]["rope_theta"]
    else:
        assert (rope.get("partial_rotary_factor") or target.config.partial_rotary_factor) == 0.5
        # Readers that honour a partial factor in rope_parameters (vLLM's get_rope) would rotate half of each head;
        # transformers' Llama rotary below ignores it, so the config is checked for it directly.
        assert raw["rope_theta"] == rope["rope_theta"] and raw.get("partial_rotary_factor", 1.0) == 1.0
        assert raw["rope_parameters"].get("partial_rotary_factor", 1.0) == 1.0
    engine = EngineEagle3(out)
    ids = torch.randint(0, COMMON["vocab_size"], (2, T), generator=torch.Generator().manual_seed(5))
    ref0, ref1 = engine.two_steps(target, ids)
    with torch.no_grad():
        ours = model(ids, torch.arange(T).expand(2, T), steps=2).logits
    for ref, got, rows in ((ref0, ours[0], T - 1), (ref1, ours[1], T - 2)):  # rows whose next tokens are real
        torch.testing.assert_close(ref[:, :rows], got[:, :rows], rtol=0, atol=1e-5)
