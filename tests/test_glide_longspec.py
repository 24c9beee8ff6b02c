"""Contract: a GLIDE draft of ``draft.layout = "longspec"`` exports the layer LongSpec's code loads and runs.

``LongSpecGlideLayer`` below is a transcription of sail-sg/LongSpec @15e4998 ``longspec/test/llama_glide.py``
(``GlideAttention``, ``LlamaGlideDecoderLayer``; ``qwen2_glide.py`` is the same layer under Qwen2 names), written from
that code and not from treadle's: its parameter names, its biased q/k/v, its self-attention
``flash_attn_func(..., window_size=(512, -1), causal=True)``, its cross-attention ``flash_attn_with_kvcache(q, K_Cache,
V_Cache, causal=True, cache_seqlens=llm_kv_len)`` over the target's last-layer post-RoPE cache (q only; its k/v
projections are never used), its three norms, and the generate loops' ``self.lm_head(hidden_states)``: no final norm,
neither its own nor the target's. LongSpec's classes call ``.cuda()`` in ``__init__`` and import flash_attn, so the
transcription runs here on the CPU with plain SDPA and masks that say what those kernels' arguments mean.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from treadle.checkpoint.export import export_draft
from treadle.config.schema import DraftConfig
from treadle.errors import UserError
from treadle.drafts.glide.model import GlideDraft, GlideModel
from treadle.drafts.glide.layout import load_glide
from treadle.drafts.targets import target_identity

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rope_theta=50000.0, use_cache=False)
LONG = 560  # longer than LongSpec's window (the token and 512 before it), so the window decides logits


# ----------------------------------------------------------------------------- LongSpec's layer, transcribed


class GlideAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.hidden_size = config.hidden_size
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    @staticmethod
    def _attend(q, k, v, allowed):
        """flash-attn's call on [B, T, H, D] tensors, GQA by head groups, ``allowed`` [Tq, Tk]."""
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        return out.transpose(1, 2)

    def sa_training(self, hidden_states, position_embeddings, window=512):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        # window_size=(512, -1), causal=True: query i reads keys j with i - 512 <= j <= i.
        i, j = torch.arange(q_len)[:, None], torch.arange(q_len)[None, :]
        allowed = (j <= i) & ((i - j <= window) if window is not None else True)
        return self.o_proj(self._attend(q, k, v, allowed).reshape(bsz, q_len, self.hidden_size))

    def ca_decoding(self, hidden_states, position_embeddings, k_cache, v_cache, llm_kv_len):
        """One decode step per query row: flash_attn_with_kvcache(q, K, V, causal=True, cache_seqlens=n) with one
        query reads the cache's first n entries; ``llm_kv_len[i]`` is n for row i."""
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        cos, sin = position_embeddings
        q, _ = apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)
        allowed = torch.arange(k_cache.shape[1])[None, :] < llm_kv_len[:, None]
        return self.o_proj(self._attend(q, k_cache, v_cache, allowed).reshape(bsz, q_len, self.hidden_size))


class LongSpecGlideLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GlideAttention(config)
        self.cross_attn = GlideAttention(config)
        # qwen2_glide.py: the same layer with Qwen2MLP / Qwen2RMSNorm.
        mlp, norm = (Qwen2MLP, Qwen2RMSNorm) if config.model_type == "qwen2" else (LlamaMLP, LlamaRMSNorm)
        self.mlp = mlp(config)
        self.input_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_self_attention_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_cross_attention_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, llm_kv, llm_kv_len, window=512):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn.sa_training(hidden_states, position_embeddings, window)
        residual = hidden_states
        hidden_states = self.post_self_attention_layernorm(hidden_states)
        hidden_states = residual + self.cross_attn.ca_decoding(hidden_states, position_embeddings, llm_kv[0],
                                                               llm_kv[1], llm_kv_len)
        residual = hidden_states
        hidden_states = self.post_cross_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class LlamaGlideDecoderLayer(PreTrainedModel):
    """LongSpec's class as ``from_pretrained`` sees it: a PreTrainedModel with ``config_class = LlamaConfig`` and
    the layer's modules at the top (no base-model prefix in the weights)."""

    config_class = LlamaConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        layer = LongSpecGlideLayer(config)
        for name, module in layer.named_children():
            self.add_module(name, module)
        self.post_init()

    def _init_weights(self, module):
        pass


# ----------------------------------------------------------------------------- treadle's side


def target_of(family, seed=0):
    torch.manual_seed(seed)
    config = (LlamaConfig if family == "llama" else Qwen2Config)(**SHAPE)
    return AutoModelForCausalLM.from_config(config).eval()


def trained_draft(target, layout="longspec", seed=1):
    """A draft as if trained: norms away from 1, biases away from 0 and weights larger than at initialization
    (attention far from uniform), so placement, names and masks matter."""
    torch.manual_seed(seed)
    model = GlideModel(target, GlideDraft(target.config, layout=layout)).eval()
    with torch.no_grad():
        for name, p in model.draft_model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(10)
    return model


def export(model, tmp_path, layout="longspec", dtype="fp32"):
    target_dir = tmp_path / "target"
    if not target_dir.exists():
        model.target.save_pretrained(target_dir)
    cfg = DraftConfig(kind="glide", target=str(target_dir), layout=layout)
    out = tmp_path / f"draft-{layout}-{dtype}"
    return export_draft(model, model.state_dict(), out, target_dir, target_identity(target_dir, model.target), cfg,
                        step=7, dtype=dtype)


def reference_logits(layer, target, ids, lag, window=512, final_norm=False):
    """LongSpec's draft logits at every row of ``ids`` with ``lag``: row i drafts with the target's cache holding
    tokens 0..i - lag (llm_kv_len = i - lag + 1), the draft's own K/V of tokens 0..i, RoPE at i."""
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        out = target(input_ids=ids, use_cache=True)
        cache = out.past_key_values.layers[-1]
        llm_kv = (cache.keys.transpose(1, 2), cache.values.transpose(1, 2))  # LongSpec's K_Cache: [B, T, KV, D]
        hidden = target.model.embed_tokens(ids)
        rope = target.model.rotary_emb(hidden, positions)
        hidden = layer(hidden, rope, llm_kv, (positions[0] - lag + 1).clamp(min=0), window)
        if final_norm:
            hidden = target.model.norm(hidden)
        return target.lm_head(hidden)


def treadle_logits(model, ids, lag):
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        _, kv = model.target_forward(ids, positions)
        return model.draft_logits(ids, positions, kv, lag)


# ----------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_longspec_loads_the_export_strictly_and_reproduces_the_draft_logits(family, tmp_path):
    model = trained_draft(target_of(family))
    out = export(model, tmp_path)

    config = AutoConfig.from_pretrained(out)
    assert config.model_type == family and config.num_hidden_layers == 1
    assert config.architectures == [{"llama": "LlamaGlideDecoderLayer", "qwen2": "Qwen2GlideDecoderLayer"}[family]]
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_theta"] == 50000.0 and raw["torch_dtype"] == "float32"  # what transformers 4.46 reads
    assert raw["treadle_draft_kind"] == "glide" and raw["layout"] == "longspec" and raw["training"]["step"] == 7

    layer = LongSpecGlideLayer(config)
    st = load_file(out / "model.safetensors")
    pth = torch.load(out / "draft_model_weights.pth", weights_only=True)
    assert st.keys() == pth.keys() and all(torch.equal(st[k], pth[k]) for k in st)
    layer.load_state_dict(st, strict=True)  # every parameter present, nothing left over
    layer.load_state_dict(pth, strict=True)  # LongSpec's trainer: model.draft_model.load_state_dict(torch.load(...))
    assert not layer.cross_attn.k_proj.weight.any()  # the unused cross k/v are written, as zeros
    if family == "llama":  # from_pretrained finds every weight: nothing missing, unexpected or reshaped
        _, info = LlamaGlideDecoderLayer.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    ids = torch.randint(0, SHAPE["vocab_size"], (2, LONG))
    for lag in (1, 3):
        want = treadle_logits(model, ids, lag)
        got = reference_logits(layer, model.target, ids, lag)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # Broken variants are caught: the target's final norm applied, or the window off.
        assert (reference_logits(layer, model.target, ids, lag, final_norm=True) - want).abs().max() > 1e-2
        assert (reference_logits(layer, model.target, ids, lag, window=None) - want).abs().max() > 1e-3

    # treadle loads its export back (spec-eval --draft, draft.init): the directory, or the .pth alone.
    for source in (out, out / "draft_model_weights.pth"):
        torch.testing.assert_close(treadle_logits(load_glide(source, model.target), ids[:, :40], 2),
                                   treadle_logits(model, ids[:, :40], 2), rtol=0, atol=0)


def test_a_draft_trained_with_longspec_loads_without_treadles_keys(tmp_path):
    model = trained_draft(target_of("llama"))
    out = export(model, tmp_path)
    config = json.loads((out / "config.json").read_text())
    for key in ("treadle_draft_kind", "layout", "window", "shape", "target", "target_config", "training"):
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").unlink()  # LongSpec's trainer writes only the .pth
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 24))
    torch.testing.assert_close(treadle_logits(load_glide(out, model.target), ids, 1), treadle_logits(model, ids, 1),
                               rtol=0, atol=0)
    other = target_of("llama", seed=3)
    other.config.intermediate_size = 48
    with pytest.raises(UserError, match="intermediate_size = 64 does not fit"):
        load_glide(out, other)


def test_the_treadle_layout_is_not_longspecs(tmp_path):
    """The default layout's files do not load into LongSpec's layer: its docs must not call them LongSpec's."""
    model = trained_draft(target_of("llama"), layout="treadle")
    out = export(model, tmp_path, layout="treadle")
    layer = LongSpecGlideLayer(AutoConfig.from_pretrained(tmp_path / "target"))
    with pytest.raises(RuntimeError, match="Missing key"):
        layer.load_state_dict(torch.load(out / "draft_model_weights.pth", weights_only=True), strict=True)


def test_a_name_mismatch_fails_at_export_and_writes_nothing(tmp_path):
    model = trained_draft(target_of("llama"))
    model.draft_model.register_buffer("final_norm_scale", torch.ones(1))  # a tensor LongSpec has no name for
    with pytest.raises(UserError, match="no name for \\['final_norm_scale'\\]"):
        export(model, tmp_path)
    assert not (tmp_path / "draft-longspec-fp32").exists()


def test_bf16_export_is_loaded_back(tmp_path):
    model = trained_draft(target_of("qwen2"))
    out = export(model, tmp_path, dtype="bf16")
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    load_glide(out, model.target)


def test_what_longspec_cannot_run_is_refused_in_one_line():
    from transformers import Qwen3Config

    from treadle.config import load_config

    torch.manual_seed(0)
    with pytest.raises(UserError, match="LongSpec has GLIDE layers for 'llama', 'qwen2' targets only"):
        GlideDraft(Qwen3Config(**SHAPE), layout="longspec")
    with pytest.raises(UserError, match="head_dim = hidden_size / heads"):
        GlideDraft(LlamaConfig(**{**SHAPE, "head_dim": 16}), layout="longspec")
    assert GlideDraft(LlamaConfig(**SHAPE), layout="longspec").window == 513
    base = ["--draft.target=x", "--data.train=builtin"]
    for args, message in ((["--draft.kind=eagle3", "--draft.layout=longspec"], "draft.kind = 'eagle3'"),
                          (["--draft.kind=glide", "--draft.layout=longspec", "--draft.window=512"], "513"),
                          (["--draft.layout=longspec", "--draft.target=x"], "accepted: draft.kind = 'glide'")):
        with pytest.raises(UserError, match=message):
            load_config(None, [*base, *args])


def test_a_longspec_layout_run_exports_loads_evaluates_and_restarts(shards, target_dir, tmp_path, capsys):
    """End to end: a run of layout longspec writes LongSpec's directory in draft/; spec-eval measures it losslessly;
    draft.init starts a run from it (the run, or LongSpec's .pth alone); a layout other than the init's is one line."""
    from tests.helpers import SPEC_EVAL, draft_args
    from treadle.cli import main
    from treadle.config import load_config
    from treadle.train.run import build_trainer

    run = tmp_path / "run"
    assert main(draft_args(shards, target_dir, run, "--train.max_steps=2", "--draft.layout=longspec")) == 0
    layer = LongSpecGlideLayer(AutoConfig.from_pretrained(run / "draft"))
    layer.load_state_dict(torch.load(run / "draft" / "draft_model_weights.pth", weights_only=True), strict=True)
    out = tmp_path / "spec.json"
    assert main([*SPEC_EVAL, "--target", str(target_dir), "--draft", str(run), "--num-prompts", "2",
                 "--prompt-len", "8", "--max-new-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["lossless"] is True and got["drafter"] == "glide"

    want = load_file(run / "draft" / "model.safetensors")
    for init in (run, run / "draft" / "draft_model_weights.pth"):
        trainer = build_trainer(load_config(None, draft_args(shards, target_dir, tmp_path / "b", "--train.max_steps=2",
                                                             "--draft.layout=longspec", f"--draft.init={init}")[1:]))
        draft = trainer.engine.module.draft_model
        assert draft.layout == "longspec" and draft.final_norm is None and draft.window == 513
        assert torch.equal(draft.state_dict()["cross_q_proj.bias"], want["cross_attn.q_proj.bias"])
        trainer.metrics.close()
    capsys.readouterr()
    assert main(draft_args(shards, target_dir, tmp_path / "c", "--train.max_steps=2", f"--draft.init={run}")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "draft.layout = 'longspec'" in err, err
