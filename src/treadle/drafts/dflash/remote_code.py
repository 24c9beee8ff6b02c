"""A DFlash block draft for Hugging Face transformers, loaded as remote code.

treadle writes this file as ``dflash.py`` beside every DFlash export, where the export's ``config.json`` points
(``"auto_map": {"AutoModel": "dflash.DFlashDraftModel"}``), so the directory opens the way z-lab's published
drafts do (github.com/z-lab/dflash, README "Transformers"):

    draft = AutoModel.from_pretrained(draft_dir, trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = draft.spec_generate(target=target, input_ids=prompt_ids, max_new_tokens=64,
                              stop_token_ids=[tokenizer.eos_token_id], temperature=0.0)

The class name, its config keys (a Qwen3 config with ``dflash_config``, ``block_size``, ``num_target_layers``),
its weight names and ``forward``'s keywords are those of z-lab's ``DFlashDraftModel`` (``dflash/model.py``);
the code is treadle's. It needs torch and transformers only: treadle itself need not be installed.

The draft (what treadle trains, src/treadle/drafts/dflash/model.py):

    c = hidden_norm(fc([h_l1 ; ... ; h_ln]))     the target's chosen layers' states, fused once per context token
    x = embed([anchor, MASK, ..., MASK])          a block of ``block_size`` rows in the target's own embedding
    per layer: queries from the block; keys and values from [c ; block] through the layer's own projections;
               attention bidirectional inside the block; pre-norm, per-head q/k norm, SwiGLU MLP, residuals
    logits = target.lm_head(norm(x))              ``forward`` returns norm(x); the target's head is applied outside

``target_layer_ids`` in ``dflash_config`` are z-lab's ids: decoder layer ``i``'s output is Hugging Face's
``output_hidden_states[i + 1]``.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3PreTrainedModel, Qwen3RotaryEmbedding


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's picks when a config names none: one id per draft layer spread evenly over 1..N-3 (N // 2 for one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [int(round(1 + i * step)) for i in range(num_draft_layers)]


def cache_keyword(model: nn.Module) -> str:
    """The name a model's forward takes its KV cache by: ``cache`` from transformers 5.24 (``past_key_values``, its
    older name, is deprecated there), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def keep_first(cache, length: int) -> None:
    """Cut ``cache`` back to its first ``length`` positions. By a negative count: transformers 5 refuses the
    positive "final length" that 4.x's ``crop`` also took."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm, computed in at least fp32: a float64 model stays float64 (transformers' own norm computes in
    fp32 whatever the input, so a float64 copy could not be compared exactly with the draft treadle trained)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (Llama, Qwen); ``cos``/``sin`` [B, T, D] for x [B, H, T, D]."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the fused context followed by the block."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], -1, self.head_dim)  # [B, T, H, D]: the per-head norms act on D

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None):
        B, Q, _ = hidden_states.shape
        cos, sin = position_embeddings  # for the context rows, then the block's
        q = _rotate(self.q_norm(self._heads(self.q_proj(hidden_states))).transpose(1, 2), cos[:, -Q:], sin[:, -Q:])
        rows = torch.cat((target_hidden, hidden_states), dim=1)
        k = _rotate(self.k_norm(self._heads(self.k_proj(rows))).transpose(1, 2), cos, sin)
        v = self._heads(self.v_proj(rows)).transpose(1, 2)
        if past_key_values is not None:  # earlier context rows first; the caller crops the block's rows off after
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)  # additive
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None):
        x = hidden_states
        x = x + self.self_attn(self.input_layernorm(x), target_hidden, position_embeddings, attention_mask,
                               past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        self.target_layer_ids = list(dflash.get("target_layer_ids") or default_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers))
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", None) or 16))
        self.mask_token_id = dflash.get("mask_token_id", getattr(config, "mask_token_id", None))
        d = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_init()

    def context_features(self, hidden_states) -> torch.Tensor:
        """The ``target_hidden`` that ``forward`` takes, from a target's ``output_hidden_states`` tuple."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """The block's final hidden states [B, Q, d] (the target's ``lm_head`` turns them into logits).

        ``noise_embedding``: the target's embedding of ``[anchor, MASK, ...]`` [B, Q, d]; ``target_hidden``: the
        concatenated target states of the C context tokens not yet in ``past_key_values`` [B, C, n * d];
        ``position_ids``: [B, C + Q], those context tokens' positions then the block's; ``attention_mask``: None
        (every row reads every cached and new key, as at decode time) or [B, 1, Q, keys], bool (True: may read) or
        additive. With a cache the caller cuts the block's Q rows off again after the call (``keep_first``)."""
        context = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, context, position_embeddings, attention_mask, past_key_values)
        return self.norm(x)

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0) -> torch.LongTensor:
        """Speculative decoding of one prompt [1, T]: the prompt and what ``target`` generates, [1, T + n].

        Each round the draft proposes a block's ``block_size - 1`` tokens in one forward; the target verifies them
        in one forward, the longest prefix equal to its own picks is kept, and its pick after that prefix is the
        next anchor. Greedy (``temperature`` 0) the output is the target's own greedy output; sampled, every token
        is the target's own sample, so its distribution is the target's."""
        from transformers import DynamicCache

        self.eval()
        bs, prompt_len = self.block_size, input_ids.shape[1]
        device = input_ids.device

        def pick(logits):
            if temperature < 1e-5:
                return logits.argmax(-1)
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])

        target_cache, draft_cache = DynamicCache(), DynamicCache()
        cache = cache_keyword(target)
        out = target(input_ids=input_ids, **{cache: target_cache}, use_cache=True, output_hidden_states=True)
        tokens = input_ids[0].tolist() + [int(pick(out.logits[:, -1])[0])]
        features = self.context_features(out.hidden_states)  # of tokens not yet in the draft's cache
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        stops = set(stop_token_ids or ())
        while len(tokens) - prompt_len < max_new_tokens and not stops & set(tokens[prompt_len:]):
            start = len(tokens) - 1  # the anchor: the target's last pick, not yet processed by it
            block = torch.full((1, bs), self.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = tokens[-1]
            cached = draft_cache.get_seq_length()
            hidden = self(position_ids=torch.arange(cached, start + bs, device=device)[None],
                          noise_embedding=embed(block), target_hidden=features, past_key_values=draft_cache,
                          use_cache=True)
            keep_first(draft_cache, start)  # keep the context's keys and values, drop the block's
            block[0, 1:] = pick(head(hidden[:, 1:]))[0]
            out = target(input_ids=block, position_ids=torch.arange(start, start + bs, device=device)[None],
                         **{cache: target_cache}, use_cache=True, output_hidden_states=True)
            picks = pick(out.logits)[0].tolist()
            accepted = 0
            while accepted < bs - 1 and int(block[0, accepted + 1]) == picks[accepted]:
                accepted += 1
            tokens += block[0, 1: accepted + 1].tolist() + [picks[accepted]]
            keep_first(target_cache, start + accepted + 1)
            features = self.context_features(out.hidden_states)[:, : accepted + 1]
        new = tokens[prompt_len: prompt_len + max_new_tokens]
        for i, t in enumerate(new):
            if t in stops:
                new = new[: i + 1]
                break
        return torch.tensor([tokens[:prompt_len] + new], dtype=torch.long, device=device)
