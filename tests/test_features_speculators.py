"""Speculators' offline data (vLLM's extract_hidden_states) read as an EAGLE-3 feature store.

Each store here is written as the real tools write it (drafts/features/speculators.py's docstring): a
``datasets.Dataset.save_to_disk`` directory with prepare_data.py's columns, and per row an
``hidden_states/hs_{i}.safetensors`` with vLLM's keys, holding a tiny real target's hidden states at the layers vLLM
captures (output_hidden_states 1, 2, 3, then the last decoder layer's output before the final norm, taken by a hook).
"""

import copy
import pickle
import shutil

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers import TARGET
from treadle.drafts.targets import capture_features
from treadle.drafts.features.speculators import SpeculatorsSamples, is_speculators_dir
from treadle.drafts.ttt import scored_rows
from treadle.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = (1, 2, 3)  # the draft's feature layers; vLLM is asked for ids [1, 2, 3, 4] (4 = N, appended)
SEQ_LEN = 12
VOCAB = TARGET["vocab_size"]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4})).eval()


def conversations():
    """(input_ids, loss_mask) rows as prepare_data.py makes them: 0 on the prompt, 1 from the answer on."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for length, prompt in ((10, 4), (20, 6), (5, 2)):  # a fit, one longer than SEQ_LEN + 1, a short one
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        rows.append((ids, [0] * prompt + [1] * (length - prompt)))
    return rows


def vllm_hidden_states(target, ids: torch.Tensor) -> torch.Tensor:
    """[T, 4, d]: what vLLM stores for layer ids [1, 2, 3, N]: output_hidden_states 1..3 and decoder layer N - 1's
    output before the final norm (Hugging Face's entry N is after it)."""
    got = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: got.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        hs = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    hook.remove()
    assert not torch.allclose(got["last"], hs[-1])  # the hook's state is the pre-norm one
    return torch.stack([hs[1][0], hs[2][0], hs[3][0], got["last"][0]], dim=1)


def write_store(root, target, rows, dtype=torch.float32):
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                  "loss_mask": datasets.List(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                                     "seq_len": [len(r[0]) for r in rows]}, features=features)
    ds.set_format("torch")  # prepare_data.py saves it so
    ds.save_to_disk(str(root))
    torch.save({1: 3, 2: 5}, root / "token_freq.pt")  # beside it, as prepare_data.py leaves it: never read
    (root / "hidden_states").mkdir()
    for i, (ids, _) in enumerate(rows):
        t = torch.tensor(ids, dtype=torch.int64)
        save_file({"hidden_states": vllm_hidden_states(target, t).to(dtype).contiguous(), "token_ids": t},
                  str(root / "hidden_states" / f"hs_{i}.safetensors"))
    return root


@pytest.fixture(scope="module")
def stores(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("speculators")
    return {dtype: write_store(root / str(dtype).split(".")[1], target, conversations(), dtype)
            for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture
def store(stores, tmp_path):
    """A copy of the fp32 store a test may damage."""
    return shutil.copytree(stores[torch.float32], tmp_path / "store")


def samples(path, target, **kw):
    args = dict(seq_len=SEQ_LEN, feature_layers=LAYERS, final_norm=target.model.norm, vocab_size=VOCAB) | kw
    return SpeculatorsSamples(path, **args)


def treadles_own(target, ids):
    """What an online eagle3 run takes from the target for ``ids``: FeatureTap's features, the final hidden state."""
    with torch.no_grad(), capture_features(target, LAYERS) as tap:
        out = target.model(input_ids=ids[None], use_cache=False)
        return tap.take()[0], out.last_hidden_state[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_and_hidden_equal_treadles_own_target_pass(stores, target, dtype):
    ds = samples(stores[dtype], target)
    assert len(ds) == 3
    for i, (ids, _) in enumerate(conversations()):
        item = ds[i]
        n = min(len(ids) - 1, SEQ_LEN)
        features, hidden = treadles_own(target, torch.tensor(ids[:n]))
        got_f, got_h = item["target.features"][:n], item["target.hidden"][:n]
        assert got_f.dtype == got_h.dtype == torch.float32
        assert got_f.shape == (n, len(LAYERS) * TARGET["hidden_size"])
        if dtype == torch.float32:  # the same numbers: only kernels' summation order may differ
            torch.testing.assert_close(got_f, features, rtol=0, atol=1e-6)
            torch.testing.assert_close(got_h, hidden, rtol=0, atol=1e-6)
        else:
            # bf16 keeps 8 significant bits: the features are the tap's rounded (half an ulp: 2^-8 relative) ...
            assert ((got_f - features).abs() <= features.abs() * 2.0**-8 + 1e-6).all()
            assert not torch.equal(got_f, features)  # ... and really were rounded
            # ... and the norm of a rounded state moves each entry by about as much (its scale by less).
            assert ((got_h - hidden).abs() <= hidden.abs() * 2.0**-7 + 1e-5).all()


def test_the_final_norm_runs_in_fp32_whatever_the_targets_dtype(stores, target):
    """A target loaded in bf16 hands over a bf16 norm; the teacher's input is still that norm computed in fp32
    (a bf16 LayerNorm would not even take fp32 input)."""
    torch.manual_seed(5)
    norm = torch.nn.LayerNorm(TARGET["hidden_size"])
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    bf16 = norm.bfloat16()
    got = samples(stores[torch.float32], target, final_norm=bf16)[1]["target.hidden"]
    want = samples(stores[torch.float32], target, final_norm=copy.deepcopy(bf16).float())[1]["target.hidden"]
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert next(bf16.parameters()).dtype == torch.bfloat16  # the caller's module is left as it was


def test_labels_follow_the_loss_mask_as_speculators_trains_it(stores, target):
    """labels[t] = token t + 1 where loss_mask[t] is set; and the rows treadle's unroll then scores are the rows
    speculators' EAGLE-3 trainer scores (its shift_batch and align_for_step, restated here from their code), but
    for the conversation's last position, which has no next token."""
    ds = samples(stores[torch.float32], target)
    ids, mask = conversations()[0]
    item = ds[0]
    T = len(ids)
    want = [ids[t + 1] if mask[t] and t + 1 < T else -100 for t in range(T - 1)]
    assert item["labels"][: T - 1].tolist() == want
    assert item["input_ids"][: T - 1].tolist() == ids[:-1]
    # speculators: shifted row j holds token j + 1, feature g_j, teacher y_{j+1} and mask l_{j+1}; TTT step k pairs
    # logits row j with teacher and mask row j + k, i.e. the target's position p = j + k + 1.
    for k in range(3):
        theirs = {j for j in range(T - 1 - k) if mask[j + k + 1] and j + k + 1 < T - 1}
        rows = scored_rows(item["position_ids"][None], item["labels"][None], k)[0]
        ours = {t for t in range(T - 1) if t < rows.numel() and rows[t]}
        assert ours == theirs, k
    assert mask[T - 1] == 1  # the one row speculators scores and treadle cannot: p = T - 1


def test_short_conversations_are_padded_and_long_ones_truncated(stores, target):
    ds = samples(stores[torch.float32], target)
    L = SEQ_LEN
    ids, mask = conversations()[2]  # 5 tokens: 4 positions
    item, n = ds[2], 4
    assert item["input_ids"].tolist() == ids[:n] + [0] * (L - n)
    assert item["labels"][n:].eq(-100).all() and item["labels"][:n].tolist() == [
        ids[t + 1] if mask[t] else -100 for t in range(n)]
    assert item["position_ids"].tolist() == list(range(n)) + list(range(L - n))  # padding is its own segment
    assert item["target.features"][n:].eq(0).all() and item["target.hidden"][n:].eq(0).all()
    assert item["target.hidden"][:n].ne(0).any(dim=-1).all()
    ids, mask = conversations()[1]  # 20 tokens: cut to L + 1, L positions
    item = ds[1]
    assert item["input_ids"].tolist() == ids[:L]
    assert item["labels"].tolist() == [ids[t + 1] if mask[t] else -100 for t in range(L)]
    assert item["labels"][L - 1] == ids[L]  # the window's last label is the (L + 1)-th token
    assert item["position_ids"].tolist() == list(range(L))
    for key in ("input_ids", "labels", "position_ids"):
        assert item[key].dtype == torch.int64 and item[key].shape == (L,)
    assert ds.manifest["truncated"] == 1


def test_manifest_and_rows_without_hidden_states(store, target):
    (store / "hidden_states" / "hs_1.safetensors").unlink()  # a request that failed and was skipped
    ds = samples(store, target)
    assert len(ds) == 2
    assert ds[1]["input_ids"].tolist()[:4] == conversations()[2][0][:4]  # sample 1 is row 2
    m = ds.manifest
    assert (m["format"], m["rows"], m["rows_without_hidden_states"], m["num_samples"]) == ("speculators", 3, 1, 2)
    assert (m["hidden_size"], m["num_layers_stored"], m["dtype"], m["feature_layers"]) == (32, 4, "float32", [1, 2, 3])
    assert m["tokens"] == 10 + 5 and m["dropped"] == 0 and m["truncated"] == 0
    counts = ds.token_counts(VOCAB)  # the labels' tokens: what a reduced draft vocabulary is chosen from
    labels = torch.cat([ds[i]["labels"] for i in range(len(ds))])
    assert counts.sum() == labels.ne(-100).sum()
    assert np.array_equal(counts, np.bincount(labels[labels != -100].numpy(), minlength=VOCAB))


def test_a_conversation_without_a_label_in_the_window_is_dropped(target, tmp_path):
    rows = conversations()
    rows[1] = (rows[1][0], [0] * 15 + [1] * 5)  # the answer starts after the first SEQ_LEN + 1 tokens
    ds = samples(write_store(tmp_path / "s", target, rows), target)
    assert len(ds) == 2 and ds.manifest["dropped"] == 1


def test_is_speculators_dir(stores, tmp_path):
    store = stores[torch.float32]
    assert is_speculators_dir(store)
    assert is_speculators_dir(store / "hidden_states")  # recognised, then refused with the reason (below)
    assert not is_speculators_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "state.json").write_text("{}")  # a datasets directory without hidden states
    assert not is_speculators_dir(tmp_path)
    assert not is_speculators_dir(tmp_path / "missing")


def _rewrite(file, **change):
    from safetensors.torch import load_file

    tensors = load_file(str(file)) | change
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))


def _no_dataset(store, target):
    for p in store.iterdir():
        if p.name != "hidden_states":
            p.unlink()
    return store, {}


def _other_tokens(store, target):
    f = store / "hidden_states" / "hs_2.safetensors"
    ids = torch.tensor(conversations()[2][0])
    ids[3] = (ids[3] + 1) % VOCAB
    _rewrite(f, token_ids=ids)
    return f, {}


def _with_output_tokens(store, target):  # vLLM's include_output_tokens: the answer's tokens too
    f = store / "hidden_states" / "hs_0.safetensors"
    ids = torch.tensor(conversations()[0][0] + [7])
    _rewrite(f, token_ids=ids, hidden_states=vllm_hidden_states(target, ids))
    return f, {}


def _torn(store, target):
    f = store / "hidden_states" / "hs_1.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return f, {}


def _not_safetensors(store, target):
    f = store / "hidden_states" / "hs_0.safetensors"
    f.write_bytes(b"\x80\x04not a safetensors file")
    return f, {}


def _beyond_the_dataset(store, target):
    f = store / "hidden_states" / "hs_7.safetensors"
    shutil.copy(store / "hidden_states" / "hs_0.safetensors", f)
    return f, {}


def _fewer_layers(store, target):
    return store / "hidden_states" / "hs_0.safetensors", {"feature_layers": (1, 2)}


def _other_width(store, target):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return store / "hidden_states" / "hs_0.safetensors", {"final_norm": LlamaRMSNorm(48)}


def _smaller_vocabulary(store, target):
    top = max(max(ids) for ids, _ in conversations())
    return store, {"vocab_size": top}  # the largest id is then one past the end


@pytest.mark.parametrize("damage", [_no_dataset, _other_tokens, _with_output_tokens, _torn, _not_safetensors,
                                    _beyond_the_dataset, _fewer_layers, _other_width, _smaller_vocabulary])
def test_bad_stores_are_refused_in_one_line_naming_the_file(store, target, damage):
    named, kw = damage(store, target)
    with pytest.raises(UserError) as e:
        samples(store, target, **kw)
    msg = str(e.value)
    assert "\n" not in msg and str(named) in msg and "accepted" in msg, msg


def test_the_hidden_states_folder_itself_is_refused_with_the_reason(stores, target):
    with pytest.raises(UserError, match="give its parent"):
        samples(stores[torch.float32] / "hidden_states", target)


def test_nothing_is_unpickled(stores, target, monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("unpickled")

    for owner, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(owner, name, refuse)
    ds = samples(stores[torch.bfloat16], target)
    assert ds[0]["labels"].ne(-100).any()


def test_hidden_states_elsewhere(store, target, tmp_path):
    """speculators' --hidden-states-path: the files need not sit in the dataset's directory."""
    elsewhere = shutil.move(store / "hidden_states", tmp_path / "hs")
    with pytest.raises(UserError, match="hidden_states"):
        samples(store, target)
    ds = samples(store, target, hidden_states=elsewhere)
    assert len(ds) == 3 and ds.manifest["hidden_states"] == str(elsewhere)
