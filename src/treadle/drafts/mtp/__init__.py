"""MTP heads: the multi-token-prediction layer a DeepSeek-V3 / GLM-4-MoE (``model.layers.{N}.*``) or Qwen3-Next /
Qwen3.5 (``mtp.*``) checkpoint ships, fine-tuned as a draft."""
