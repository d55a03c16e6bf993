"""Inference fixtures: tiny random Hugging Face model directories (tests/helpers/hf_tiny.py) and engines over them."""

from __future__ import annotations

import pytest

from tests.helpers.hf_tiny import make_hf_dir


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("hf_llama"), "llama")


@pytest.fixture(params=[None, False], ids=["cpu_kernels", "torch_path"])
def cpu_kernels(request):
    """EngineConfig.cpu_kernels for parity tests: megapipe's C++ kernels where they build, and the torch path."""
    return request.param


@pytest.fixture(scope="session")
def tiny_engine_factory(hf_llama):
    """engine(**config) over the tiny Llama, fp32 on CPU."""
    from megapipe.inference import LLMEngine

    def make(**config):
        return LLMEngine.from_pretrained(hf_llama[0], device="cpu", **config)

    return make


@pytest.fixture(scope="module")
def live(hf_llama):
    """A live server (tests/inference/test_server.py's LiveServer) over the tiny Llama, one per test module."""
    from tests.inference.test_server import LiveServer

    server = LiveServer(hf_llama[0])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hermes_live(hf_llama):
    """A live server over the tiny Llama with --tool-call-parser hermes."""
    from tests.inference.test_server import LiveServer

    server = LiveServer(hf_llama[0], server_config={"tool_call_parser": "hermes"})
    yield server
    server.stop()
