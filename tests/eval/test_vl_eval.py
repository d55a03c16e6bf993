"""`megapipe eval --tasks megapipe_shapes` (the shipped image task: rendered shapes and colours as PNG data: URLs,
lm-eval's doc_to_image) on a tiny random Qwen2.5-VL: every answer is transformers' greedy answer on the same image
prompt, the score is the same on a second run; a text-only model is refused with a sentence (test_eval.py's BAD)."""

from __future__ import annotations

import json

import pytest
import torch

from megapipe.cli import main
from tests.helpers.hf_vl import CHAT_IDS, make_vl_dir

transformers = pytest.importorskip("transformers")
LIMIT = 6


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    work = tmp_path_factory.mktemp("vl_eval")
    hf_dir, hf_model = make_vl_dir(work / "hf", chat=True)
    assert main(["import", "hf", str(hf_dir), str(work / "ckpt"), "--quiet"]) == 0
    return work, hf_dir, hf_model


def hf_answer(hf_dir, hf_model, doc: dict) -> str:
    """transformers' greedy answer to the task's prompt of ``doc`` (its image processor, the image's placeholder
    repeated for its patches), cut at the task's stop strings."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megapipe.data.images import open_image

    tok = AutoTokenizer.from_pretrained(hf_dir)
    pixels = Qwen2VLImageProcessorPil.from_pretrained(hf_dir)([open_image(doc["image"])], return_tensors="pt")
    pads = "<|image_pad|>" * (int(pixels["image_grid_thw"][0].prod()) // 4)
    text = f"<|vision_start|>{pads}<|vision_end|>{doc['question']}\nAnswer:"
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(
        ids == CHAT_IDS[0]).int(), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=1, **pixels)
    answer = tok.decode(out[0, ids.shape[1]:])
    for stop in ("\n", "."):
        answer = answer.split(stop)[0]
    return answer


def test_shapes_task_answers_as_transformers_and_scores_the_same_twice(vl_ckpt, one_thread):
    from megapipe.eval.run import run_eval
    from megapipe.eval.tasks import SHIPPED_DIR

    work, hf_dir, hf_model = vl_ckpt
    first, out = run_eval(work / "ckpt", "megapipe_shapes", limit=LIMIT, output=work / "a", log_samples=True,
                          bootstrap_iters=0)
    again, _ = run_eval(work / "ckpt", "megapipe_shapes", limit=LIMIT, output=work / "b", bootstrap_iters=0)
    score = first["results"]["megapipe_shapes"]["exact_match,none"]
    assert score == again["results"]["megapipe_shapes"]["exact_match,none"] and 0 <= score <= 1
    assert first["n-samples"]["megapipe_shapes"]["effective"] == LIMIT
    docs = [json.loads(line) for line in (SHIPPED_DIR / "megapipe_shapes.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples_megapipe_shapes.jsonl").read_text().splitlines()]
    assert len(docs) == 48 and len(samples) == LIMIT
    answers = {s["doc_id"]: s["resps"][0][0] for s in samples}
    assert [answers[i] for i in range(LIMIT)] == [hf_answer(hf_dir, hf_model, d) for d in docs[:LIMIT]]
    assert len(set(answers.values())) > 1  # the image changes the answer
