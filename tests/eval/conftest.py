"""A small random Llama as a Hugging Face directory (with the suite's tiny tokenizer) and the same model imported as a
megapipe checkpoint (`megapipe import hf`): lm-eval's HF backend reads the first, megapipe's wrapper the second."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

MAX_POSITIONS = 256


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_tokenizer_dir) -> tuple[Path, Path]:
    """(HF dir, megapipe checkpoint) of one random fp32 Llama: 512 ids, 2 layers, 256 positions."""
    import transformers

    from megapipe.checkpoint.hf import import_hf

    root = tmp_path_factory.mktemp("eval_llama")
    hf_dir, ckpt = root / "hf", root / "ckpt"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(hf_dir)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, hf_dir / f.name)
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        body = json.loads(gen.read_text())
        body.update(bos_token_id=0, eos_token_id=0, pad_token_id=1)
        gen.write_text(json.dumps(body))
    import_hf(hf_dir, ckpt)
    return hf_dir, ckpt


@pytest.fixture(autouse=True)
def no_env_report(monkeypatch):
    """lm-eval ends every simple_evaluate with torch's collect_env report (pip and other subprocesses: ~6 s on the
    2 shared cores); it is not under test here, so the results keep only what the rest of add_env_info records."""
    import lm_eval.evaluator

    real = lm_eval.evaluator.add_env_info

    def versions_only(storage):
        import torch.utils.collect_env as collect_env

        with monkeypatch.context() as m:
            m.setattr(collect_env, "get_pretty_env_info", lambda: "skipped in megapipe's tests")
            real(storage)

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", versions_only)
