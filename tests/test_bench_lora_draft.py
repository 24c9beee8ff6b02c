"""bench/lora_draft.py (issue 42, adapters on a draft) end to end in its smallest form: a 2-step bench target, an
EAGLE-3 base draft, its rank-16 adapter and its full fine-tuning on the chat rows, each decoded on both domains.
The table must hold every row, count the adapter's parameters as its file holds them, and weigh its export as
what is on disk: the adapter directory, a fraction of a whole draft."""

import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import lora_draft  # noqa: E402


def _rows(stdout: str) -> dict[str, dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:] if not line.startswith("|---")]
    return {f"{row[0]} {row[1]}": dict(zip(header, row)) for row in cells}


@pytest.mark.usefixtures("one_thread")
def test_quick_bench_tables_base_lora_and_full_with_params_bytes_and_tau(tmp_path, capsys):
    out = tmp_path / "bench"
    assert lora_draft.main(["--quick", "--target", str(tmp_path / "target"), "--target-steps", "2",
                            "--base-steps", "2", "--adapt-steps", "2", "--prompts", "1", "--max-new-tokens", "8",
                            "--chat-rows", "16", "--out", str(out)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"eagle3 base", "eagle3 lora", "eagle3 full"}
    base, lora, full = rows["eagle3 base"], rows["eagle3 lora"], rows["eagle3 full"]

    def number(cell: str) -> int:
        return int(cell.replace(",", ""))

    # Trainable parameters: the adapter's are exactly the tensors its file holds; full fine-tuning trains the draft.
    adapter = out / "eagle3-lora" / "adapter"
    assert number(lora["trainable params"]) == sum(t.numel() for t in load_file(adapter / "adapter_model.safetensors").values())
    assert 0 < number(lora["trainable params"]) < number(full["trainable params"]) == number(base["trainable params"])
    # Bytes on disk: what each exports, the adapter directory a fraction of a whole draft.
    assert (lora["export"], full["export"]) == ("adapter/", "draft/")
    assert number(lora["bytes on disk"]) == sum(f.stat().st_size for f in adapter.iterdir())
    assert 0 < number(lora["bytes on disk"]) < number(full["bytes on disk"]) / 4
    # tau on both domains, greedy and T = 1, every decode lossless.
    for row in (base, lora, full):
        assert row["lossless"] == "True" and row["steps"] == "2"
        assert all(float(row[f"tau {c}"]) >= 1.0 for c in lora_draft.TAU_COLUMNS)
    assert [f"tau {c}" for c in lora_draft.TAU_COLUMNS] == ["tau chat greedy", "tau chat T=1", "tau code greedy",
                                                             "tau code T=1"]
