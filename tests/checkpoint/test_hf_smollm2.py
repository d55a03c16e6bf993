"""A real model through the bridge: SmolLM2-135M-Instruct imported, its greedy generations equal to transformers'
token for token, and exported back (sharded) to the same tensors.

Needs the model prepared once (no hub access at test time):
    .venv/bin/python tools/prepare_smollm2.py --output ~/.cache/megapipe/smollm2
or MEGAPIPE_SMOLLM2_DIR pointing at such a directory; skipped otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megapipe.checkpoint.hf import export_hf, import_hf  # noqa: E402
from megapipe.checkpoint.load import load_model  # noqa: E402
from megapipe.data.tokenizer import load_tokenizer  # noqa: E402
from megapipe.inference import generate_ids  # noqa: E402

MODEL_DIR = Path(os.environ.get("MEGAPIPE_SMOLLM2_DIR", Path.home() / ".cache" / "megapipe" / "smollm2")).expanduser()
UNAVAILABLE = MODEL_DIR.with_name(MODEL_DIR.name + ".unavailable")  # written by prepare_smollm2.py --if-available
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (MODEL_DIR / "config.json").is_file(),
        reason=(f"SmolLM2 cannot be had here: {UNAVAILABLE.read_text().strip()}" if UNAVAILABLE.is_file() else
                f"SmolLM2 not prepared at {MODEL_DIR} (`make test` prepares it; or run tools/prepare_smollm2.py)"),
    ),
]

CHATS = ["What is the capital of France?", "Write a haiku about the sea."]
TEXTS = ["def fibonacci(n):"]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("smollm2") / "ckpt"
    import_hf(MODEL_DIR, ckpt)
    loaded = load_model(ckpt)
    model, tok_dir = loaded.model, loaded.tokenizer_dir
    return ckpt, model, tok_dir


@pytest.fixture(scope="module")
def reference():
    return (transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(MODEL_DIR))


def prompts(hf_tok) -> list[list[int]]:
    chats = [hf_tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"] for c in CHATS]
    return chats + [hf_tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def test_greedy_generation_matches_transformers(imported, reference):
    _, model, tok_dir = imported
    hf_model, hf_tok = reference
    ids = prompts(hf_tok)
    tok = load_tokenizer(tok_dir)
    assert [tok.encode(t) for t in TEXTS] == ids[len(CHATS):]  # the checkpoint's tokenizer is the model's
    eos = hf_model.generation_config.eos_token_id
    got = generate_ids(model, ids, NEW_TOKENS, eos_ids=[eos])
    for prompt, new in zip(ids, got, strict=True):
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        want = out.tolist()
        want = want[: want.index(eos)] if eos in want else want
        assert new == want, (hf_tok.decode(new), hf_tok.decode(want))
    answer = hf_tok.decode(got[0])
    assert "Paris" in answer


def test_logits_match_transformers(imported, reference):
    _, model, _ = imported
    hf_model, hf_tok = reference
    ids = torch.tensor([prompts(hf_tok)[0]])
    with torch.no_grad():
        ours, want = model(ids), hf_model(ids).logits
    diff, scale = (ours - want).abs().max().item(), want.abs().max().item()
    print(f"max |diff| {diff:.3g} at max |logit| {scale:.3g}")
    # fp32 through 30 layers: the two reduce in different orders (thread count, kernels), so bound the error
    # relative to the logits' size (about 30 ulps of fp32 at their magnitude), not in absolute terms
    assert diff <= 4e-6 * scale


def test_export_reloads_identically(imported, reference, tmp_path):
    ckpt, _, _ = imported
    hf_model, _ = reference
    summary = export_hf(ckpt, tmp_path / "hf", max_shard_size="200MB")
    assert summary["shards"] == 3 and summary["dtype"] == "float32"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    source = hf_model.state_dict()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, source[name]), name
