"""``megapipe serve CKPT --engine vllm``: our HF export of a megapipe checkpoint served by vLLM's own server answers
the same greedy tokens as megapipe's engine. Needs a vLLM environment (bash tools/setup_vllm_cpu.sh, or
MEGAPIPE_VLLM_PYTHON); skipped with that reason otherwise. vLLM on CPU needs head_dim >= 32."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PYTHON = Path(os.environ.get("MEGAPIPE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not PYTHON.is_file(), reason=f"no vLLM environment at {PYTHON} (bash tools/setup_vllm_cpu.sh builds one, or set "
                                 f"MEGAPIPE_VLLM_PYTHON)")]


def test_vllm_serves_our_export_with_the_same_greedy_tokens(tmp_path):
    import transformers

    from megapipe.checkpoint.hf import import_hf
    from megapipe.data.tokenizer import train_tokenizer
    from megapipe.inference import LLMEngine, SamplingParams

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                   initializer_range=0.3, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    train_tokenizer(["The quick brown fox jumps over the lazy dog."] * 30, vocab_size=320, output=hf_dir)
    ckpt = tmp_path / "ckpt"
    import_hf(hf_dir, ckpt)
    prompts = [[5, 17, 9, 33, 2, 71, 8], [44, 3, 100, 101, 102, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    engine = LLMEngine.from_pretrained(ckpt, device="cpu")
    want = [o.outputs[0].token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                                     ignore_eos=True))]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MEGAPIPE_CACHE=str(tmp_path / "cache"), VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen([sys.executable, "-m", "megapipe.cli", "serve", str(ckpt), "--engine", "vllm",
                             "--vllm-python", str(PYTHON), "--port", str(port), "--dtype", "float32",
                             "--max-model-len", "256", "--served-model-name", "tiny", "--api-key", "k"],
                            env=env, start_new_session=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(2)
        assert proc.poll() is None, "vLLM's server exited"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        got = []
        for p in prompts:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            got.append([int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens])
        assert got == want
        assert list((tmp_path / "cache" / "vllm-export").glob("*/config.json"))  # the export was cached
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
