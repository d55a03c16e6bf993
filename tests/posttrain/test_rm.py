"""`megapipe posttrain rm`: the Bradley-Terry loss against its formula (values and gradients), a packed pair row
equal to two rows, the margin field, a CLI run (rewards and preference accuracy logged, on the validation split
too; the manifest records a reward model) and the export to transformers' ...ForSequenceClassification (same
scores at 1e-5)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megapipe.cli import main
from megapipe.models.objective import ModelOutput
from tests.posttrain.test_dpo import _encoder, records, write_pairs


def rm_args(base, data, run, *extra) -> list[str]:
    return ["posttrain", "rm", "--load", str(base), "--data", str(data), "--chat-template", "chatml",
            "--seq-length", "96", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "75,25,0",
            "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "1", "--log-interval", "1",
            "--eval-interval", "4", "--save", str(run), "--quiet", *extra]


@pytest.mark.parametrize("center", [None, 0.01])
def test_loss_equals_its_formula_values_and_gradients(center):
    from megapipe.training.recipes.rm import RewardLoss

    scores = torch.tensor([[0.3], [-1.2], [0.5], [2.0]], dtype=torch.float64)
    margins = [0.0, 1.5]
    # two packed rows of 4 positions: the chosen's reward read at position 1, the rejected's at 3
    side = torch.tensor([[0, 1, 0, 2], [0, 1, 0, 2]])
    batch = {"side": side, "loss_mask": side > 0, "document_ids": torch.zeros(2, 4, dtype=torch.long),
             "margin": torch.tensor([[0, margins[0], 0, 0], [0, margins[1], 0, 0]], dtype=torch.float32)}
    hidden = torch.zeros(2, 4, 1, dtype=torch.float64)
    hidden[:, 1, 0], hidden[:, 3, 0] = scores[[0, 2], 0], scores[[1, 3], 0]
    hidden.requires_grad_(True)
    weight = torch.ones(1, 1, dtype=torch.float64)
    result = RewardLoss(center)(ModelOutput(hidden=hidden, output_weight=lambda: weight), batch)
    result.total.backward()
    c, r = scores[[0, 2], 0].tolist(), scores[[1, 3], 0].tolist()
    want, grads = 0.0, []
    for ci, ri, m in zip(c, r, margins, strict=True):
        x = ci - ri - m
        want += math.log1p(math.exp(-x)) + (center or 0.0) * (ci + ri) ** 2
        s = 1 / (1 + math.exp(x))  # d/dx -log sigmoid(x) = -(1 - sigmoid(x))
        extra = 2 * (center or 0.0) * (ci + ri)
        grads.append((-s + extra, s + extra))
    assert result.total.item() == pytest.approx(want, rel=1e-6)
    assert result.metrics["rewards/accuracy"].item() == 1.0  # 0.3 > -1.2; 0.5 < 2.0
    for row, (gc, gr) in enumerate(grads):
        assert hidden.grad[row, 1, 0].item() == pytest.approx(gc, rel=1e-6)
        assert hidden.grad[row, 3, 0].item() == pytest.approx(gr, rel=1e-6)


def test_packed_pair_row_equals_two_rows_and_reads_the_last_non_pad_token(chat_tokenizer, tmp_path):
    from megapipe.config import ModelConfig
    from megapipe.data.preference import RewardSamples, build_preference_datasets, prepare_preference_index
    from megapipe.models import build_model
    from megapipe.parallel.step import model_output
    from megapipe.training.recipes.rm import pair_rewards
    from tests.posttrain.conftest import SMALL

    data = write_pairs(tmp_path / "p.jsonl", "text")
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    lines[1]["margin"] = 2.5
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    index = prepare_preference_index([str(data)], _encoder(chat_tokenizer), cache_dir=str(tmp_path))
    assert index.margins[:3].tolist() == [0.0, 2.5, 0.0]
    model = build_model(ModelConfig(**SMALL, num_labels=1), seed=1)
    got = []
    for packed in (True, False):
        ds = build_preference_datasets(index, "100,0,0", 96, {"train": 4}, 0, packed, "truncate", 1,
                                       RewardSamples)["train"]
        rows = [ds.pair(r) for r in range(4)]
        mb = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}
        mb = {k: v.flatten(0, 1) if v.dim() == 3 else v for k, v in mb.items()}
        with torch.no_grad():
            got.append(pair_rewards(model_output(model, mb), mb))
        if not packed:  # each row alone, scored where transformers reads it: the last token that is not pad
            seq = index.tokens[0].tolist() + index.tokens[1].tolist()
            with torch.no_grad():
                alone = model(torch.tensor([seq]))[0, -1, 0]
            assert got[-1][0][0, 0].item() == pytest.approx(alone.item(), abs=1e-5)
    (a, ma), (b, mb_) = got
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ma.tolist() == mb_.tolist() == [0.0, 2.5, 0.0, 0.0]


def test_cli_trains_logs_accuracy_and_records_a_reward_model(base_ckpt, tmp_path):
    from megapipe.checkpoint import read_manifest

    run = tmp_path / "run"
    assert main(rm_args(base_ckpt, write_pairs(tmp_path / "pairs.jsonl"), run, "--train-iters", "8",
                        "--center-rewards-coefficient", "0.01")) == 0
    rec = records(run)
    assert [r["step"] for r in rec] == list(range(1, 9))
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
        assert key in rec[0]
    assert rec[-1]["loss"] < rec[0]["loss"]
    valid = records(run, "valid")
    assert valid and 0.0 <= valid[-1]["rewards/accuracy"] <= 1.0
    assert "ppl" not in valid[-1]  # exp of a preference loss is no perplexity
    manifest = read_manifest(run / "step_00000008")
    assert manifest["stage"] == "rm" and manifest["model"]["num_labels"] == 1
    assert manifest["reward_model"]["score"] == "last non-pad token"
    assert manifest["reward_model"]["center_rewards_coefficient"] == 0.01


def test_flags_refused_with_their_names(base_ckpt, tmp_path, capsys):
    data = write_pairs(tmp_path / "pairs.jsonl")
    for flag, message in ((["--center-rewards-coefficient", "-1"], "rm.center_rewards_coefficient"),
                          (["--set", "model.num_labels=3"], "model.num_labels = 3 must be 1"),
                          (["--tp", "2"], "parallel.tp")):
        assert main(rm_args(base_ckpt, data, tmp_path / "r", "--train-iters", "1", *flag)) != 0
        assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_rm(base_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    run = tmp / "run"
    assert main(rm_args(base_ckpt, write_pairs(tmp / "pairs.jsonl"), run, "--train-iters", "2")) == 0
    return run / "step_00000002"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_export_hf_sequence_classifier_gives_the_same_scores(arch, base_ckpt, chat_tokenizer, trained_rm,
                                                             tmp_path):
    """transformers' LlamaForSequenceClassification / Qwen2ForSequenceClassification load the export and score a
    right-padded batch as RewardModel does (1e-5)."""
    from transformers import AutoModelForSequenceClassification

    from megapipe.posttrain.reward_model import RewardModel
    from tests.posttrain.conftest import write_model

    ckpt = trained_rm
    if arch != "llama":
        base = write_model(tmp_path / "base", chat_tokenizer, seed=3, arch=arch, qkv_bias=True)
        run = tmp_path / "run"
        assert main(rm_args(base, write_pairs(tmp_path / "pairs.jsonl"), run, "--train-iters", "2")) == 0
        ckpt = run / "step_00000002"
    out = tmp_path / "hf"
    assert main(["export", "hf", str(ckpt), str(out), "--dtype", "fp32", "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [f"{'Llama' if arch == 'llama' else 'Qwen2'}ForSequenceClassification"]
    rm = RewardModel.load(ckpt)
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == rm.pad_id
    seqs = [rm.encode("What is 2 plus 2?\n", "ANSWER: 4"), rm.encode([{"role": "user", "content": "Hi"}], "Hello"),
            [5, 17, 9]]
    ids = torch.full((len(seqs), max(map(len, seqs))), rm.pad_id)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.as_tensor(s)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=(ids != rm.pad_id).long()).logits[:, 0]
    got = torch.tensor(rm.score_ids(seqs))
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_serve_answers_pooling_with_the_reward_models_scores(trained_rm):
    """`megapipe serve RM`: vLLM's /pooling shape, one reward per input (text, token ids, a conversation), equal to
    RewardModel's; the generation routes are not there; mistakes are 4xx in OpenAI's error shape."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    from megapipe.posttrain.reward_model import RewardModel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "megapipe.cli", "serve", str(trained_rm), "--port", str(port),
                             "--served-model-name", "rm"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line, deadline = "", time.time() + 300
        while "ready on" not in line and time.time() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        assert "POST /pooling" in line
        url = f"http://127.0.0.1:{port}"
        client = httpx.Client(timeout=300)  # a loaded machine can be slow
        rm = RewardModel.load(trained_rm)
        chat = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "ANSWER: 4"}]
        r = client.post(url + "/pooling", json={"model": "rm", "input": ["Hello there", "Hi"]}).json()
        assert r.get("object") == "list" and [d["object"] for d in r["data"]] == ["pooling", "pooling"], r
        texts = [rm.tokenizer.encode("Hello there"), rm.tokenizer.encode("Hi")]
        assert [d["data"][0] for d in r["data"]] == pytest.approx(rm.score_ids(texts), abs=1e-5)
        assert r["usage"]["prompt_tokens"] == sum(map(len, texts))
        r = client.post(url + "/pooling", json={"input": [[5, 17, 9], [4]]}).json()
        assert [d["data"][0] for d in r["data"]] == pytest.approx(rm.score_ids([[5, 17, 9], [4]]), abs=1e-5)
        r = client.post(url + "/pooling", json={"messages": chat}).json()
        assert r["data"][0]["data"][0] == pytest.approx(rm.score([chat[:1]], ["ANSWER: 4"])[0], abs=1e-5)
        for body, status, message in (({"model": "other", "input": "x"}, 404, "does not exist"),
                                      ({"input": []}, 400, "input is empty"),
                                      ({"input": [10 ** 6]}, 400, "outside the vocabulary"),
                                      ({"messages": chat[:1]}, 400, "end with the assistant's answer")):
            bad = client.post(url + "/pooling", json=body)
            assert bad.status_code == status and message in bad.json()["error"]["message"]
        assert client.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 404
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_reward_model_does_not_generate_or_train_as_a_language_model(trained_rm, tmp_path, capsys):
    assert main(["generate", str(trained_rm), "--prompt", "Hi", "--max-new-tokens", "2"]) != 0
    assert "generate does not take reward models (model.num_labels = 1)" in capsys.readouterr().err
    args = ["posttrain", "dpo", "--load", str(trained_rm), "--data", str(write_pairs(tmp_path / "p.jsonl")),
            "--chat-template", "chatml", "--train-iters", "1", "--save", str(tmp_path / "dpo"), "--quiet"]
    assert main(args) != 0
    assert "dpo does not take reward models" in capsys.readouterr().err


def test_the_engine_refuses_a_reward_model(trained_rm):
    from megapipe.checkpoint.load import load_model
    from megapipe.errors import MegapipeError
    from megapipe.inference import LLMEngine

    loaded = load_model(str(trained_rm))
    with pytest.raises(MegapipeError, match="is a reward model"):
        LLMEngine(loaded.model, loaded.tokenizer)
