"""lm-eval's own Hugging Face model (``hf``, HFLM) and megapipe's engine-backed wrapper give the same scores on the
same weights: every log-likelihood, acc / acc_norm, the rolling perplexities and the generated text."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

TASKS = ["megapipe_mc", "megapipe_gen", "megapipe_text"]
WINDOW = 256 - 2  # megapipe's default lm-eval window on tests/eval's Llama (its 256 positions - 2)


def evaluate(lm, tasks, limit, num_fewshot=None) -> dict:
    import lm_eval

    from megapipe.eval.tasks import quiet_lm_eval, select_tasks

    selection = select_tasks(tasks)
    with quiet_lm_eval():
        return lm_eval.simple_evaluate(model=lm, tasks=selection.lm_eval, task_manager=selection.manager, limit=limit,
                                       num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=True)


def hf_lm(path, max_length=WINDOW):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(path), dtype="float32", device="cpu", batch_size=1, max_length=max_length)


def megapipe_lm(path, **kwargs):
    from megapipe.eval.lm import MegapipeLM

    return MegapipeLM(pretrained=str(path), dtype="float32", device="cpu", **kwargs)


def assert_same_scores(ours: dict, theirs: dict, rel: float) -> dict:
    """Every metric and every per-document response of ``ours`` against ``theirs``; returns the largest gaps."""
    gaps = {"loglikelihood": 0.0, "relative": 0.0, "metric": 0.0}
    assert ours["results"].keys() == theirs["results"].keys()
    for task, metrics in theirs["results"].items():
        for key, value in metrics.items():
            if not isinstance(value, float):
                continue
            mine = ours["results"][task][key]
            if key.startswith(("acc", "exact_match")):
                assert mine == value, (task, key, mine, value)  # counts of equal decisions
            else:
                assert mine == pytest.approx(value, rel=rel), (task, key, mine, value)
                gaps["metric"] = max(gaps["metric"], abs(mine - value) / abs(value))
        a, b = ours["samples"][task], theirs["samples"][task]
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b]
        for sa, sb in zip(a, b, strict=True):
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                ra, rb = ra[0], rb[0]
                if isinstance(rb, str):
                    assert ra == rb, (task, sa["doc_id"], ra, rb)
                    continue
                lla, llb = (ra[0], rb[0]) if isinstance(rb, (list, tuple)) else (ra, rb)
                assert lla == pytest.approx(llb, rel=rel, abs=1e-4), (task, sa["doc_id"], lla, llb)
                gaps["loglikelihood"] = max(gaps["loglikelihood"], abs(lla - llb))
                gaps["relative"] = max(gaps["relative"], abs(lla - llb) / max(abs(llb), 1e-30))
                if isinstance(rb, (list, tuple)):
                    assert ra[1] == rb[1], (task, sa["doc_id"], "is_greedy")
    return gaps


def test_parity_with_lm_eval_hf_backend(tiny_llama, one_thread):
    hf_dir, ckpt = tiny_llama
    assert json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"] - 2 == WINDOW
    limit = 12
    ours = evaluate(megapipe_lm(ckpt, batch_size=8), TASKS, limit)
    theirs = evaluate(hf_lm(hf_dir), TASKS, limit)
    gaps = assert_same_scores(ours, theirs, rel=1e-5)
    print(f"\nparity (fp32, random Llama): largest log-likelihood gap {gaps['loglikelihood']:.2e} nats "
          f"({gaps['relative']:.1e} relative), "
          f"largest relative metric gap {gaps['metric']:.2e}")
    # the rolling task really spans several windows per document, so the window logic is what is compared
    doc = ours["samples"]["megapipe_text"][0]["doc"]["text"]
    assert len(megapipe_lm(ckpt).tok_encode(doc)) > 2 * WINDOW


def test_parity_with_few_shot_and_a_short_window(tiny_llama, one_thread):
    """Few-shot contexts longer than the window: both truncate from the left the same way."""
    hf_dir, ckpt = tiny_llama
    ours = evaluate(megapipe_lm(ckpt, max_length=96), ["megapipe_mc", "megapipe_text"], 6, num_fewshot=3)
    theirs = evaluate(hf_lm(hf_dir, max_length=96), ["megapipe_mc", "megapipe_text"], 6, num_fewshot=3)
    assert_same_scores(ours, theirs, rel=1e-5)


SMOLLM2 = Path(os.environ.get("MEGAPIPE_SMOLLM2_DIR", Path.home() / ".cache/megapipe/smollm2")).expanduser()


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(),
                    reason=f"SmolLM2 is not prepared at {SMOLLM2} (make test runs tools/prepare_smollm2.py)")
def test_parity_on_smollm2():
    """The real model, straight from its HF directory: same acc / acc_norm and log-likelihoods as HFLM."""
    window = 510  # short texts: the window only bounds the few-shot context here
    # 4 documents (16 scored sequences): the slowest eval test, kept small for the 2-core CI
    ours = evaluate(megapipe_lm(SMOLLM2, max_length=window, max_model_len=window + 2), ["megapipe_mc"], 4)
    theirs = evaluate(hf_lm(SMOLLM2, max_length=window), ["megapipe_mc"], 4)
    gaps = assert_same_scores(ours, theirs, rel=1e-4)
    print(f"\nparity (fp32, SmolLM2-135M, megapipe_mc x4): acc {ours['results']['megapipe_mc']['acc,none']:.4f}, "
          f"largest log-likelihood gap {gaps['loglikelihood']:.2e} nats")
    assert math.isfinite(gaps["loglikelihood"])


def test_parity_with_a_tokenizer_that_adds_bos(tiny_llama, tmp_path, one_thread):
    """A Llama-style tokenizer whose template puts BOS before every text (HF's encode adds it): megapipe adds it the
    same way, so contexts, continuations and rolling windows hold the same ids."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from megapipe.checkpoint.hf import import_hf

    hf_dir = tmp_path / "hf_bos"
    shutil.copytree(tiny_llama[0], hf_dir)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                            special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(hf_dir / "tokenizer.json"))
    import_hf(hf_dir, tmp_path / "ckpt")
    ours_lm = megapipe_lm(tmp_path / "ckpt")
    assert ours_lm.add_bos_token and ours_lm.tok_encode("Hello")[0] == 0
    ours = evaluate(ours_lm, ["megapipe_mc", "megapipe_text"], 6)
    theirs = evaluate(hf_lm(hf_dir), ["megapipe_mc", "megapipe_text"], 6)
    assert_same_scores(ours, theirs, rel=1e-5)
    without = evaluate(megapipe_lm(tmp_path / "ckpt", add_bos_token="false"), ["megapipe_text"], 6)
    assert without["results"]["megapipe_text"]["word_perplexity,none"] != pytest.approx(
        theirs["results"]["megapipe_text"]["word_perplexity,none"], rel=1e-3)  # the BOS really changes the scores


def test_is_greedy_marks_exactly_the_argmax_continuations(tiny_llama, one_thread):
    """Continuations built from transformers' own argmax (so some are greedy and some are not, at their first, a
    middle or their last token): megapipe's is_greedy and log-likelihoods are transformers' on each."""
    import torch
    import transformers

    hf_dir, ckpt = tiny_llama
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    def runner_up(ids: list[int]) -> int:
        return int(logprobs(ids)[-1].topk(2).indices[1])

    def greedy_from(ids: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(int(logprobs(ids + out)[-1].argmax()))
        return out

    context = [5, 77, 300, 12, 41, 9]
    greedy = greedy_from(context, 4)
    first_off = [runner_up(context)]
    first_off += greedy_from(context + first_off, 3)
    middle_off = greedy[:2] + [runner_up(context + greedy[:2])]
    middle_off += greedy_from(context + middle_off, 1)
    requests = [(context, greedy), (context, greedy[:1]), (context, greedy[:3] + [runner_up(context + greedy[:3])]),
                (context, first_off), (context, middle_off), (context[:2], greedy_from(context[:2], 2))]

    ours = megapipe_lm(ckpt)._loglikelihood_tokens([(None, c, x) for c, x in requests])
    want = []
    for c, x in requests:
        lp = logprobs(c + x)[len(c) - 1:-1]
        picked = lp.gather(1, torch.tensor(x)[:, None])[:, 0]
        want.append((float(picked.sum()), bool((lp.argmax(-1) == torch.tensor(x)).all())))
    assert [g for _, g in want] == [True, True, False, False, False, True]  # the cases are what they claim to be
    assert [g for _, g in ours] == [g for _, g in want]
    assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in want], rel=1e-5, abs=1e-5)
