"""The DSpark stages a DeepSeek-V4 / V4.1 checkpoint ships (drafts/dspark/stages.py finds them), as a draft treadle
fine-tunes in place: the stage forward as tokenspeed serves it, built from transformers 5.24's own DeepSeek-V4
modules, and the names that go back into the checkpoint.

The consumer (lightseekorg/tokenspeed ``python/tokenspeed/runtime/models/deepseek_v4_dspark.py``,
``deepseek_v4_dspark_ops/{attention,heads}.py``, ``models/deepseek_v4.py`` and ``layers/deepseek_v4_mhc.py``
@f4d8ec6e) computes, for the block anchored at the bonus token (position a):

    features    per context token t < a: the outputs of target decoder layers ``dspark_target_layer_ids`` (0-based;
                treadle's ``feature_layers`` are those + 1), each averaged over its ``hc_mult`` mHC streams,
                concatenated
    main_x      main_norm(main_proj(features))                          stage 0's, read by every stage
    x           embed([bonus, noise, ..., noise]) copied to ``hc_mult`` streams, slot k at position a + k
    per stage   one DeepSeek-V4 decoder layer (mHC around attention and MoE, as the target's own layers) whose
                attention is MQA with K = V: queries from the block, keys/values kv_norm(wkv(.)) of the block rows
                and of main_x at the last ``dspark_window_size`` (default 128) context positions, plain interleaved
                RoPE (``rope_theta``) on the last ``qk_rope_head_dim`` channels, the per-head sink in the softmax
                denominator, the block bidirectional, the output's RoPE undone, then the grouped wo_a / wo_b
    out         norm(hc_head(x)) of the last stage; logits_k = head(out_k) + markov_w2 markov_w1[x_{k-1}], slot k
                guessing token a + k + 1 (x_{-1} = the bonus); confidence_k = proj([out_k ; markov_w1[x_{k-1}]])

transformers' ``DeepseekV4DecoderLayer`` computes the same layer (its mHC equals tokenspeed's Triton mHC kernels, its
router sqrt-softplus top-k with the correction bias, its SwiGLU clamps, its grouped output projection and sink
softmax the consumer's); only the attention's key source differs (the captured context rather than the layer's own
earlier rows), so ``StageAttention`` keeps transformers' projections and softmax and feeds them those keys.

Not matched (docs/drafts.md): tokenspeed quantizes activations to FP8 before wq_a / wq_b / wkv / wo_b (UE8M0 block
scales) and the non-RoPE key channels in 64-value groups; treadle trains the unquantized (bf16 / fp32) math.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from treadle.drafts.dspark import stages as found_stages
from treadle.drafts.dflash.model import block_rule
from treadle.drafts.dspark.model import DSparkDraft, DSparkModel
from treadle.errors import UserError

WINDOW = 128  # tokenspeed's DEFAULT_DSPARK_WINDOW_SIZE, when the config has no dspark_window_size

# transformers' module names (one stage's block) -> the checkpoint's (transformers' conversion_mapping.py for
# deepseek_v4 read backwards: what ``save_pretrained`` writes and what the stages carry).
BLOCK_NAMES = {
    "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight", "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight", "self_attn.sinks": "attn.attn_sink",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
FROZEN = ("ffn.gate.bias",)  # buffers (the router's correction bias): never trained, never written back
FIRST_NAMES = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight"}
LAST_NAMES = {"norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
              "hc_head.hc_scale": "hc_head_scale"}


def stage_config(target_config, experts: int):
    """One decoder layer of the target's config: sliding attention (no compressor: the stage's keys are the
    captured context), a routed MoE (a stage is no hash-routed layer: its index is past the target's), the stage
    expert count (V4.1's ``dspark_n_routed_experts``)."""
    c = copy.deepcopy(target_config)
    c.num_hidden_layers, c.layer_types, c.mlp_layer_types = 1, ["sliding_attention"], ["moe"]
    c.n_routed_experts = experts
    c._attn_implementation, c._experts_implementation = "eager", "eager"
    return c


class StageRotary(nn.Module):
    """Plain RoPE phases as tokenspeed's ``precompute_dspark_freqs_cis`` makes them (``rope_theta``, one per channel
    pair of the last ``qk_rope_head_dim``), as (cos, sin) in transformers' V4 convention (half-size, interleaved)."""

    def __init__(self, config):
        super().__init__()
        rd = config.qk_rope_head_dim
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd),
                             persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].double() * self.inv_freq.double()
        return freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)


class StageAttention(hf.DeepseekV4Attention):
    """transformers' V4 attention (its projections, norms, sink softmax, output RoPE undo and grouped projection)
    reading the captured context's keys before the block's own."""

    def keys(self, h: torch.Tensor, rope) -> torch.Tensor:
        """Rotated K = V [B, 1, T, head_dim] of ``h`` (main_x for the context, the normed block rows)."""
        cos, sin = rope
        kv = self.kv_norm(self.kv_proj(h)).view(*h.shape[:2], 1, self.head_dim).transpose(1, 2)
        return hf.apply_rotary_pos_emb(kv, cos, sin)

    def forward(self, hidden_states, context_kv=None, rope=None, mask=None, **_):
        cos, sin = rope
        B, Q = hidden_states.shape[:2]
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(hidden_states))).view(B, Q, -1, self.head_dim).transpose(1, 2)
        q = hf.apply_rotary_pos_emb(self.q_b_norm(q), cos, sin)
        kv = torch.cat((context_kv.to(q.dtype), self.keys(hidden_states, rope)), 2)
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
        out, _ = hf.eager_attention_forward(self, q, kv, kv, additive, scaling=self.scaling)
        out = hf.apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)  # [B, Q, H, D]
        return self.o_b_proj(self.o_a_proj(out.reshape(B, Q, self.config.o_groups, -1)).flatten(2)), None


class StageBlock(hf.DeepseekV4DecoderLayer):
    """transformers' V4 decoder layer (mHC, norms, MoE, its forward) with ``StageAttention``."""

    def __init__(self, config):
        super().__init__(config, 0)
        self.self_attn = StageAttention(config, 0)


class Stage(nn.Module):
    def __init__(self, config, first: bool, last: bool, features: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.block = StageBlock(config)
        if first:
            self.main_proj = nn.Linear(features * d, d, bias=False)
            self.main_norm = hf.DeepseekV4RMSNorm(d, eps=eps)
        if last:
            self.norm = hf.DeepseekV4RMSNorm(d, eps=eps)
            self.hc_head = hf.DeepseekV4HyperHead(config)


class DSparkStages(nn.Module):
    """The stages as one draft with ``DSparkDraft``'s interface (``fuse``, ``context_kv``, ``forward``, the Markov
    and confidence heads), so ``DSparkModel``'s objective and evaluation run it unchanged."""

    kind = "dspark"
    checkpoint_kwargs = None

    def __init__(self, target_config, found: found_stages.Stages):
        super().__init__()
        c = target_config
        self.found = found
        self.feature_layers = tuple(i + 1 for i in c.dspark_target_layer_ids)
        self.block_size = int(c.dspark_block_size)
        self.mask_token_id = int(c.dspark_noise_token_id)
        self.markov_rank = int(c.dspark_markov_rank)
        self.window = int(getattr(c, "dspark_window_size", None) or WINDOW)
        self.target_vocab_size = c.vocab_size
        self.hc_mult = c.hc_mult
        experts = getattr(c, "dspark_n_routed_experts", None) or c.n_routed_experts
        self.config = config = stage_config(c, experts)
        n = found.count
        self.stages = nn.ModuleList(Stage(config, s == 0, s == n - 1, len(self.feature_layers)) for s in range(n))
        V, r, d = c.vocab_size, self.markov_rank, c.hidden_size
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)
        self.confidence = nn.Linear(d + r, 1, bias=False)

    markov_bias = DSparkDraft.markov_bias
    confidence_logit = DSparkDraft.confidence_logit

    @property
    def num_layers(self) -> int:
        return len(self.stages)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        first = self.stages[0]
        return first.main_norm(first.main_proj(features.to(first.main_proj.weight.dtype)))

    def context_kv(self, context: torch.Tensor, rope) -> list[tuple]:
        """Per stage, the context's (K, V): one tensor twice (K = V), in DFlash's pairs so its drafter caches them."""
        return [(kv, kv) for kv in (stage.block.self_attn.keys(context, rope) for stage in self.stages)]

    def forward(self, embeds: torch.Tensor, rope, context_kv: list, mask) -> torch.Tensor:
        """The block rows' final hidden states [B, Q, d] (after hc_head and the last stage's norm). ``mask``: a
        ``masks.Rule`` or a bool [B, 1, Q, keys] (True: may read)."""
        mask = mask.dense() if hasattr(mask, "dense") else mask
        x = embeds.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()
        for stage, kv in zip(self.stages, context_kv):
            x = stage.block(x, context_kv=kv[0], rope=rope, mask=mask)
        last = self.stages[-1]
        return last.norm(last.hc_head(x))

    def export_config(self) -> dict:
        return {"treadle_draft_kind": self.kind, "treadle_dspark_stages": self.found.count}

    # ------------------------------------------------------------------ the checkpoint's names

    def names(self) -> dict[str, str]:
        """Every tensor of the module except the experts -> its full checkpoint name."""
        n, (w1, w2) = self.found.count, self.found.markov
        out = {}
        for s in range(n):
            table = {**{"block." + k: v for k, v in BLOCK_NAMES.items()}, **(FIRST_NAMES if s == 0 else {}),
                     **(LAST_NAMES if s == n - 1 else {})}
            out.update({f"stages.{s}.{k}": f"mtp.{s}.{v}" for k, v in table.items()})
        last = f"mtp.{n - 1}."
        out.update({"markov_w1.weight": last + w1, "markov_w2.weight": last + w2,
                    "confidence.weight": last + "confidence_head.proj.weight"})
        return out

    def prefix_of(self, s: int) -> str:
        """The full name prefix of stage ``s`` as the checkpoint spells it (``mtp.`` or ``model.mtp.``)."""
        name = next(k for k, (stage, _) in self.found.names.items() if stage == s)
        return name[: name.index(f"mtp.{s}.")]

    def to_checkpoint(self, weights: dict) -> dict:
        """The checkpoint's tensors (full names, each in the dtype the checkpoint stores) from the module's state dict
        ``weights``: experts split back into ``ffn.experts.{e}.w{1,2,3}``."""
        table, out = self.names(), {}
        for k, v in weights.items():
            if ".mlp.experts." in k:
                s = int(k.split(".")[1])
                base = f"mtp.{s}.ffn.experts."
                if k.endswith("gate_up_proj"):
                    gate, up = v.chunk(2, dim=1)
                    for e in range(v.shape[0]):
                        out[f"{base}{e}.w1.weight"], out[f"{base}{e}.w3.weight"] = gate[e], up[e]
                else:
                    out.update({f"{base}{e}.w2.weight": v[e] for e in range(v.shape[0])})
            else:
                out[table[k]] = v
        full = {}
        for name, v in out.items():
            s, suffix = int(name.split(".")[1]), name.split(".", 2)[2]
            stored = self.found.tensors[s][suffix]
            full[self.prefix_of(s) + name] = v.detach().to("cpu", TORCH_DTYPES[stored.dtype]).contiguous()
        return full

    def from_checkpoint(self, tensors: dict) -> dict:
        """The module's state dict from the stages' tensors (suffix per stage: ``{s: {suffix: tensor}}``)."""
        table = {v: k for k, v in self.names().items()}
        mine = self.state_dict()
        out = {}
        for s, stage in tensors.items():
            for suffix, t in stage.items():
                key = table.get(f"mtp.{s}.{suffix}")
                if key is not None:
                    out[key] = t
            for e_key, names in ((f"stages.{s}.block.mlp.experts.gate_up_proj", ("w1", "w3")),
                                 (f"stages.{s}.block.mlp.experts.down_proj", ("w2",))):
                E = mine[e_key].shape[0]
                parts = [torch.stack([stage[f"ffn.experts.{e}.{w}.weight"] for e in range(E)]) for w in names]
                out[e_key] = torch.cat(parts, dim=1)
        return {k: v.to(mine[k].dtype) for k, v in out.items()}


TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def read_stages(directory, found: found_stages.Stages) -> dict:
    """{stage: {suffix: tensor}} of ``directory``'s stages; a quantized one (FP8 / FP4) refused in one line."""
    from safetensors import safe_open

    quantized = sorted(f"mtp.{s}.{suffix}" for s, stage in enumerate(found.tensors) for suffix, t in stage.items()
                       if t.dtype in found_stages.QUANTIZED or suffix.endswith(".scale"))
    if quantized:
        raise UserError(f"draft.target {directory} stores its DSpark stages quantized ({quantized[0]} ...); treadle "
                        "fine-tunes float stages only (it does not re-quantize); accepted: stages stored in BF16 / F32")
    by_file: dict = {}
    for name, (s, suffix) in found.names.items():
        by_file.setdefault(found.tensors[s][suffix].file, []).append((name, s, suffix))
    out: dict = {s: {} for s in range(found.count)}
    for f, entries in by_file.items():
        with safe_open(str(directory / f), framework="pt") as h:
            for name, s, suffix in entries:
                out[s][suffix] = h.get_tensor(name)
    return out


def load_stages(directory, target_config, found: found_stages.Stages) -> DSparkStages:
    """The stages ``directory`` ships as a ``DSparkStages``, every tensor of the module from the checkpoint."""
    from pathlib import Path

    draft = DSparkStages(target_config, found)
    state = draft.from_checkpoint(read_stages(Path(directory), found))
    mine = draft.state_dict()
    wrong = [k for k in mine if k not in state or state[k].shape != mine[k].shape]
    if wrong:
        raise UserError(f"{directory}: DSpark stage tensor for {wrong[0]} is missing or "
                        f"{tuple(state[wrong[0]].shape) if wrong[0] in state else '-'}, the stage needs "
                        f"{tuple(mine[wrong[0]].shape)}; accepted: stages of this config")
    draft.load_state_dict(state)
    return draft


class StagesModel(DSparkModel):
    """A dspark run on the stages its target ships: DSpark's objective and evaluation over ``DSparkStages``, the
    target's features averaged over its mHC streams, the context seen through the stages' window."""

    def __init__(self, target, draft: DSparkStages):
        super().__init__(target, draft)
        self.rotary = StageRotary(target.config)

    def _target_forward(self, input_ids, position_ids, hidden: bool = False, reads: dict | None = None):
        out, features = super()._target_forward(input_ids, position_ids, hidden, reads)
        # A V4 layer's output is [B, T, hc_mult, d]; tokenspeed captures its mean over the streams.
        return out, (features.mean(-2) if features.dim() == 4 else features)

    def _block_rule(self, doc, anchors):
        return block_rule(doc, anchors, self.draft_model.block_size, self.flex_masks, self.draft_model.window)


def check_run_keys(cfg, draft: DSparkStages, where) -> None:
    """A run's [draft] keys must not contradict the stages (their config decides them)."""
    for key, have in (("feature_layers", list(draft.feature_layers)), ("num_layers", draft.num_layers),
                      ("block_size", draft.block_size), ("mask_token_id", draft.mask_token_id),
                      ("markov_rank", draft.markov_rank)):
        want = getattr(cfg, key, None)
        if want is not None and (list(want) if key == "feature_layers" else want) != have:
            raise UserError(f"draft.{key} = {want} but the DSpark stages of {where} have {have}; accepted: "
                            f"draft.{key} unset (the stages' own) or equal to it")


def refuse_unbuilt(cfg) -> None:
    """What a run on shipped stages does not do yet, refused in one line before it trains: one process only (a
    DeepSeek-V4 stage's hyper-connection streams and experts are not sharded or replicated by treadle's engines, and
    no multi-process run of them has been checked), and the live target only (a feature store does not hold the
    stages' stream-averaged reads)."""
    import os

    d = cfg.distributed
    spread = [f"distributed.engine = {d.engine!r}"] if d.engine not in ("auto", "local") else []
    spread += [f"distributed.{k} = {getattr(d, k)}" for k in ("tensor_parallel", "context_parallel",
                                                              "pipeline_parallel") if getattr(d, k) > 1]
    if os.environ.get("WORLD_SIZE", "1") != "1":
        spread.append(f"WORLD_SIZE = {os.environ['WORLD_SIZE']}")
    if spread:
        raise UserError(f"a dspark run on the DSpark stages a target ships runs in one process: {spread[0]} is not "
                        "built for them; accepted: distributed.engine = 'local' (or 'auto') in one process")
    if cfg.draft.features:
        raise UserError("draft.features with the DSpark stages a target ships: a store does not hold the stages' "
                        "stream-averaged reads; accepted: the live target (draft.features unset)")
