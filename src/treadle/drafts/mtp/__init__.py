"""MTP heads: the multi-token-prediction layer a DeepSeek-V3 / GLM-4-MoE checkpoint ships, fine-tuned as a draft."""
