"""``[lora]``: PEFT's low-rank adapters on a frozen base (models/lora.py applies them; docs/lora.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from treadle.config.section import Section


class LoraConfig(Section):
    """``[lora]``: low-rank adapters (PEFT's LoRA) trained on a frozen base model; unset rank = no adapters, the
    whole model trains (models/lora.py, docs/lora.md)."""

    rank: int | None = Field(None, ge=1, description="r, the adapters' rank (A: r x in, B: out x r); unset = no "
                             "adapters")
    alpha: float = Field(16.0, gt=0.0, description="the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input (training only)")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="module names (the last part: q_proj, down_proj ...) that get adapters; all-linear "
        "= every linear layer of the decoder layers (not the LM head)")
    modules_to_save: list[str] = Field(
        default_factory=list, description="modules trained in full beside the adapters (e.g. embed_tokens, lm_head); "
        "their copies go into the adapter export (which vLLM then refuses: serve the --merge export)")
    quantize: Literal["none", "4bit"] = Field(
        "none", description="4bit = QLoRA: the frozen base held in NF4 by bitsandbytes (installed separately), the "
        "adapters in fp32; engine local")
    base_name: str | None = Field(
        None, description="the base's name the adapter export records (adapter_config.json base_model_name_or_path, "
        "which AutoPeftModelForCausalLM loads), e.g. a hub id; unset = the base's absolute path")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("is empty; accepted: 'all-linear' or module names such as ['q_proj', 'v_proj']")
        return v
