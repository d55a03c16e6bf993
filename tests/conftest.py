"""Fixtures shared across the test suite (keep this small)."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def shakespeare_excerpt() -> Path:
    """189 real documents: Shakespeare paragraphs (some with æ, &c.) and a few non-Latin ones, as JSONL."""
    return FIXTURES / "shakespeare_excerpt.jsonl"


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, shakespeare_excerpt) -> Path:
    """A byte-level BPE (512 ids, <|endoftext|>=0, <|pad|>=1) trained on the excerpt: a Hugging Face directory."""
    from megapipe.data.readers import iter_texts
    from megapipe.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(iter_texts([shakespeare_excerpt], "text"), 512, out)
    return out


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and a second one only waits on a busy machine (tests share 2 cores)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def pretrain_data(tmp_path_factory, tiny_tokenizer_dir, shakespeare_excerpt):
    """(data prefix, tokenizer dir): the excerpt tokenized with the tiny tokenizer (~18k tokens)."""
    from megapipe.data.preprocess import preprocess
    from megapipe.data.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("pretrain_data")
    stats = preprocess([str(shakespeare_excerpt)], out / "shakespeare", load_tokenizer(tiny_tokenizer_dir),
                       append_eod=True)
    return stats.outputs["text"], tiny_tokenizer_dir


@pytest.fixture(scope="session")
def megatron_indexed():
    """megatron-core's own ``megatron.core.datasets.indexed_dataset`` module. Loaded from its real file but, when
    that works, without running ``megatron/core/__init__.py``, which imports Megatron's whole model stack (~10 s on
    2 cores); otherwise imported the plain way."""
    import importlib
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("megatron")
    if spec is None:
        pytest.skip("megatron-core is not installed")
    name = "megatron.core.datasets.indexed_dataset"
    if "megatron.core" in sys.modules:
        return importlib.import_module(name)

    def forget_megatron():  # a later plain `import megatron.core` gets the real package
        for key in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[key]

    root = Path(spec.submodule_search_locations[0])
    for package, path in (("megatron", root), ("megatron.core", root / "core")):
        stub = types.ModuleType(package)
        stub.__path__ = [str(path)]
        sys.modules[package] = stub
    try:
        importlib.import_module("megatron.core.parallel_state")  # first, as the package does: utils imports it
        return importlib.import_module(name)
    except ImportError:
        forget_megatron()
        return importlib.import_module(name)
    finally:
        forget_megatron()
