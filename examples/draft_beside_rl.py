"""A draft kept fresh beside a policy that another loop trains (an RL trainer's update step, here a toy one).

    python examples/draft_beside_rl.py [OUT_DIR]

The loop owns the policy, its optimizer and its forward; treadle's ``DraftTrainer`` taps that forward
(``reading``), updates an EAGLE-3 draft on the same rows (``step``: no second policy forward) and publishes its
serving layout atomically into OUT_DIR/draft every few updates, where a server reloads it (vLLM's EAGLE-3 loader
reads this layout). The target's weights are never touched by the draft.
"""

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treadle import DraftTrainer


def main(out: Path, updates: int = 6, publish_every: int = 3) -> None:
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    drafter = DraftTrainer(policy, "eagle3", lr=1e-3, ttt_steps=3)
    for update in range(1, updates + 1):
        rows = torch.randint(0, 256, (4, 32))  # the rollout's sequences (a real loop: prompts + sampled responses)
        with drafter.reading():  # the policy's own training forward; the draft's reads are tapped in it
            out_ = policy(input_ids=rows, labels=rows)
        out_.loss.backward()  # stands for the RL objective
        optimizer.step()
        optimizer.zero_grad()
        figures = drafter.step(rows)  # the draft's update on the same rows
        print(f"update {update}: policy loss {out_.loss.item():.3f}, draft loss {figures['draft_loss']:.4f}, "
              f"acc_1 {figures.get('acc_1', 0.0):.3f}")
        if update % publish_every == 0:
            where = drafter.publish(out / "draft")  # atomic: a reloading server sees one whole draft
            print(f"published {where}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/draft-beside-rl"))
