"""``[draft]``: the draft model a run trains against a frozen target (its kinds' own keys, documented per kind; the
rules across keys are each kind's settings.py, called from ``Config``'s checks in config/schema.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treadle.config.section import Section
from treadle.drafts.settings import NAMES as DRAFT_KINDS


class DraftConfig(Section):
    """A draft model for speculative decoding, trained against a frozen target (``kind`` unset: an ordinary run)."""

    kind: Literal[DRAFT_KINDS] | None = Field(None, description="draft architecture; unset = train the [model] itself")
    target: str | None = Field(None, description="frozen target: a Hugging Face model directory or a treadle run "
                               "directory; 'self' = the model this run trains ([model]): the draft trains beside it, "
                               "in the same step, reading its training forward")
    joint: bool = Field(False, description="draft.target = 'self': false = the draft's loss never reaches the target "
                        "(it trains as it would alone); true = the loss, times draft.weight, flows into the target's "
                        "hidden states the draft reads")
    weight: float = Field(0.3, ge=0.0, description="draft.joint = true: the draft loss's weight in the target's loss "
                          "(DeepSeek-V3's and torchtitan's MTP scale)")
    lr: float | None = Field(None, gt=0.0, description="draft.target = 'self': the draft's own peak learning rate (its "
                             "own AdamW and schedule, the run's schedule shape); unset = optim.lr")
    loss: Literal["ce", "kl", "mix"] = Field("kl", description="ce: next data token; kl: the target's own distribution; mix: both")
    kl_weight: float = Field(0.5, ge=0.0, le=1.0, description="mix: weight of kl (ce gets 1 - kl_weight)")
    gamma: int = Field(4, ge=1, le=16, description="draft tokens per verification: the KV lag range and the acceptance chain")
    kv_lag: bool = Field(True, description="train with a lag drawn in [1, gamma] per batch (false: always lag 1)")
    window: int = Field(0, ge=0, description="draft self-attention window in tokens; 0 = full causal (layout "
                        "longspec: LongSpec's, 513 = the token and the 512 before it)")
    layout: Literal["treadle", "longspec"] = Field("treadle", description="glide: the block trained and exported; "
                                                   "treadle: with a final norm; longspec: the layer LongSpec's code "
                                                   "loads and runs (biased q/k/v, 512-token window, no final norm), "
                                                   "exported under its names")
    anchor_positions: int = Field(4, ge=1, description="positions kept as they are before the random offset starts")
    max_position_offset: int = Field(0, ge=0, description="offsets drawn in [0, this] shift later positions; 0 = off")
    eval_prompts: int = Field(8, ge=1, description="held-out prompts whose target-greedy continuations measure acceptance")
    eval_prompt_len: int = Field(32, ge=1)
    eval_new_tokens: int = Field(64, ge=2)
    feature_layers: list[int] | None = Field(None, description="eagle3: the three target hidden states fused (low, mid, "
                                             "high), strictly increasing output_hidden_states indices (i = decoder "
                                             "layer i's output, 1..N-1); unset = EAGLE-3's (2, N/2, N - 3); dflash: "
                                             "one or more such indices; unset = z-lab's, spread over 2..N-2")
    vocab_size: int | None = Field(None, ge=1, description="eagle3: the draft head's vocabulary, the most frequent "
                                   "training tokens; unset = the target's whole vocabulary")
    init: str | None = Field(None, description="eagle3: start from this EAGLE-3 draft (a directory in the EAGLE layout "
                             "vLLM and SGLang load, treadle's export or one trained elsewhere for this target, or a "
                             "treadle run directory); its feature layers and vocabulary map are the run's; glide: "
                             "from this GLIDE draft (a treadle export or run directory, a LongSpec draft directory or "
                             "its draft_model_weights.pth) of the run's layout; dflash: from this DFlash draft (z-lab's "
                             "DFlashDraftModel layout, treadle's export or one trained elsewhere for this target, or "
                             "a treadle run directory); mtp: from this MTP layer (an mtp export, stand-alone or stitched into a "
                             "target checkpoint, SGLang's NextN export, or a checkpoint that ships one); frozen_kv: from "
                             "this Gemma 4 assistant (a directory Gemma4AssistantForCausalLM loads: a frozen_kv export "
                             "or a shipped *-it-assistant, for this target's hidden size and vocabulary); unset = a new "
                             "draft (mtp: the layer the target checkpoint ships, else a new one)")
    ttt_steps: int | None = Field(None, ge=1, le=16, description="eagle3, glide, mtp, frozen_kv: training-time-test "
                                  "unroll steps (the draft fed its own outputs; mtp: the module replayed as the "
                                  "engines serve it; frozen_kv: the assistant's steps per round, the export's "
                                  "num_assistant_tokens); unset = 7 (eagle3), 1 (glide: no unroll), 3 (mtp, frozen_kv)")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="eagle3, glide, mtp, frozen_kv: weight of unroll step "
                           "k's loss is ttt_decay**k (k = 0 for the first step)")
    features: str | None = Field(None, description="train from this feature store (`treadle features CONFIG --out "
                                 "DIR` with this run's config): the target's reads come from disk and its decoder "
                                 "layers are never built; unset = the live target runs every step")
    block_size: int | None = Field(None, ge=2, le=64, description="dflash: positions of a drafted block, the anchor "
                                   "(the last accepted token) then mask tokens: block_size - 1 drafts per forward; "
                                   "unset = 16")
    num_layers: int | None = Field(None, ge=1, le=64, description="dflash: draft decoder layers; unset = 5; frozen_kv: "
                                   "a new assistant's layers (sliding ones, then one full); unset = 2")
    anchors: int | None = Field(None, ge=1, description="dflash: blocks trained per packed row, anchored at random "
                                "supervised positions (fewer where the row has fewer); unset = data.seq_len / "
                                "block_size, every position covered once on average")
    slot_gamma: float | None = Field(None, gt=0.0, description="dflash: slot k of a block (k >= 1) weighs "
                                     "exp(-(k - 1) / slot_gamma) in the loss; unset = 7 (the paper's at block 16)")
    slot_weighting: Literal["decay", "dpace"] | None = Field(None, description="dflash: decay = exp(-(k - 1) / "
                                                            "slot_gamma) per slot; dpace = D-PACE (arXiv 2605.18810): "
                                                            "slot j weighs the expected acceptance it leads to, from "
                                                            "the draft's own detached CE (draft.loss = ce only); "
                                                            "unset = decay")
    mask_token_id: int | None = Field(None, ge=0, description="dflash: the target-embedding row fed at a block's "
                                      "masked positions; unset = the first row past the data's tokenizer, else the "
                                      "last row")
    markov_rank: int | None = Field(None, ge=1, description="dspark: rank r of the Markov head's transition bias "
                                    "W2 W1[previous token] (V x r, r x V); unset = 256 (DeepSpec's)")
    # dflash2 (drafts/dflash2/settings.py: the defaults are z-lab's released DFlash2's)
    conv_group_size: int | None = Field(None, ge=1, description="dflash2: hidden channels sharing one dynamic tap "
                                        "correction of the in-block convolutions (divides the target's hidden "
                                        "size); unset = 16. lilicorr: set = its backbone convolves so (LiLiCorr + "
                                        "conv); unset = DFlash's backbone")
    selector_rank: int | None = Field(None, ge=1, description="dflash2: width of the selector's token codebooks "
                                      "(predecessor x successor); unset = 256")
    selector_top_k: int | None = Field(None, ge=1, description="dflash2: candidates per slot the selector walks "
                                       "through (the draft's top-k); unset = 16")
    selector_weight: float | None = Field(None, ge=0.0, description="dflash2: weight of the selector's cross-entropy "
                                          "over the candidates, added to each slot's loss; unset = 1")
    # lilicorr (its backbone reads the dflash keys above too)
    candidates: int | None = Field(None, ge=1, description="lilicorr: the backbone's top-k candidates per slot the "
                                   "correlator reranks (a power of two <= 16, what vLLM serves); unset = 8. dspine: "
                                   "the top-k its predecessor-conditioned walk reranks; unset = 16")
    correlator_layers: int | None = Field(None, ge=1, le=16, description="lilicorr: the correlator's attention "
                                          "layers over the candidate lattice; unset = 2")
    train_backbone: bool | None = Field(None, description="lilicorr: false = only the correlator trains, on the "
                                        "frozen DFlash backbone draft.init names; unset = true, backbone and "
                                        "correlator jointly (ModelOpt PR #2342)")

    @property
    def beside(self) -> bool:
        """A draft trained beside its target in the target's own run (``draft.target = 'self'``)."""
        return self.kind is not None and self.target == SELF

    @property
    def frozen_target(self) -> bool:
        """A draft run: the draft is the model trained, against a frozen target (``draft.target`` a directory)."""
        return self.kind is not None and self.target != SELF


SELF = "self"  # draft.target naming the run's own model
