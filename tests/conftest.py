"""Shared fixtures: a small real tokenizer and real shards, and the argv of a small run."""

import pytest
import torch

from treadle import corpus
from treadle.data.prepare import prepare


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on 2 shared cores a second thread only waits (3x slower).
    A module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """A 512-token BPE and train/val shards made from a few stdlib files."""
    root = tmp_path_factory.mktemp("data")
    files = [p for _, p in corpus.corpus_files()[:40]]
    tok = corpus.train_tokenizer(files[:20], root / "tok", vocab_size=512)
    prepare([str(p) for p in files[:36]], root / "train", tok, workers=1)
    prepare([str(p) for p in files[36:]], root / "val", tok, workers=1)
    return root


@pytest.fixture(scope="session")
def target_dir(shards, tmp_path_factory):
    """A small random Llama (TARGET) saved as a Hugging Face directory with the shards' tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers import TARGET, save_target

    torch.manual_seed(0)
    return save_target(AutoModelForCausalLM.from_config(LlamaConfig(**TARGET)), shards,
                       tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def eagle3_target_dir(shards, tmp_path_factory):
    """TARGET with 4 decoder layers: the shallowest target with three distinct features an engine can serve
    (output_hidden_states 1, 2, 3)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers import TARGET, save_target

    torch.manual_seed(0)
    return save_target(AutoModelForCausalLM.from_config(LlamaConfig(**{**TARGET, "num_hidden_layers": 4})), shards,
                       tmp_path_factory.mktemp("eagle3-target"))
