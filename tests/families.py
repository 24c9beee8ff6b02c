"""Tiny random configs of every target family treadle supports (tests/test_families.py)."""

from __future__ import annotations

# Small shapes: hidden 32, 2 layers (1 dense + 1 MoE where a family mixes them), 4 heads of 8 (2 K/V heads), the test
# tokenizer's 512 tokens. Fields each family's config needs beyond those are set where its class asks for them.
COMMON = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, use_cache=False, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0, pad_token_id=None)  # the test tokenizer's ids (Phi-3, GLM-4, SmolLM3 default to 100k+)
MOE = dict(num_experts_per_tok=2)

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=8, num_experts=4, moe_intermediate_size=32, **MOE)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, **MOE)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=8, num_local_experts=4, sliding_window=16, **MOE)),
    # MLA: K and V have as many heads as Q (transformers' SDPA call fails on fewer; real configs set them equal).
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                             n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                             **MOE)),
    "olmo2": ("Olmo2Config", {}),
    # A cap of 2 (the real ones are 30) bends the small logits of a random model enough for the loss to show it.
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=16, final_logit_softcapping=2.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=16, final_logit_softcapping=2.0)),
    "phi3": ("Phi3Config", {}),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0, embedding_multiplier=12.0, residual_multiplier=0.5,
                                      attention_multiplier=0.125)),
    "glm4": ("Glm4Config", dict(head_dim=8)),
    "smollm3": ("SmolLM3Config", {}),
}


# Why GLIDE refuses a family (a phrase of its one-line refusal); the others train GLIDE drafts.
GLIDE_REFUSED = {
    "deepseek_v3": "multi-head latent attention",
    "gemma3_text": "'sliding_attention' layer",  # 4 layers: all sliding (one full layer in 6)
    "glm4": "partial_rotary_factor = 0.5",
    "smollm3": "no rotary embedding",
}


def build_family(name: str, directory, tokenizer_dir, seed: int = 0, layers: int | None = None):
    """Save a random ``name`` model at ``directory`` (Hugging Face layout) with the tokenizer of ``tokenizer_dir``;
    ``layers`` overrides the 2 decoder layers (a draft's target: EAGLE-3 reads three layers of at least 4)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls, extra = FAMILIES[name]
    config = getattr(transformers, cls)(**{**COMMON, **extra, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return config
