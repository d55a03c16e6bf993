"""`megapipe posttrain dpo`: each preference loss against its formula written out here (values and gradients), ln 2
at the first step, a packed pair row equal to two rows, data errors with file:line, a CLI run with its checkpoint and
metrics, exact resume, and TRL parity where TRL is installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megapipe.cli import main
from megapipe.errors import MegapipeError
from megapipe.posttrain.dpo_losses import PreferenceSpec, preference_loss

PAIRS = [("What is 2 plus 2?", "ANSWER: 4", "four, I think"),
         ("Capital of France?", "ANSWER: Paris", "it is probably Lyon"),
         ("Spell cat backwards.", "ANSWER: tac", "cat"),
         ("Opposite of hot?", "ANSWER: cold", "warm maybe"),
         ("What is 3 plus 5?", "ANSWER: 8", "seven"),
         ("Colour of the sky?", "ANSWER: blue", "green"),
         ("How many legs has a dog?", "ANSWER: 4", "three legs"),
         ("Add 1 and 1.", "ANSWER: 2", "eleven")]


def write_pairs(path: Path, shape: str = "conversation") -> Path:
    with path.open("w") as f:
        for p, c, r in PAIRS * 2:
            if shape == "text":
                rec = {"prompt": p + "\n", "chosen": c, "rejected": r}
            elif shape == "prompt":
                rec = {"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
                       "rejected": [{"role": "assistant", "content": r}]}
            else:
                user = {"role": "user", "content": p}
                rec = {"chosen": [user, {"role": "assistant", "content": c}],
                       "rejected": [user, {"role": "assistant", "content": r}]}
            f.write(json.dumps(rec) + "\n")
    return path


# ----------------------------------------------------------------------------------------------- formulas


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def written_out(t, b, e, g, pc, pr, nc, nr, rc, rr):
    z = (pc - pr) - (rc - rr)
    if t == "sigmoid":
        return -(1 - e) * _logsig(b * z) - e * _logsig(-b * z)
    if t == "robust":
        return (-(1 - e) * _logsig(b * z) + e * _logsig(-b * z)) / (1 - 2 * e)
    if t == "hinge":
        return max(0.0, 1 - b * z)
    if t == "ipo":
        return ((pc / nc - pr / nr) - (rc / nc - rr / nr) - 1 / (2 * b)) ** 2
    ac, ar = pc / nc, pr / nr
    if t == "simpo":
        u = b * (ac - ar) - g
        return -(1 - e) * _logsig(u) - e * _logsig(-u)
    odds = (ac - ar) - (math.log(1 - math.exp(ac)) - math.log(1 - math.exp(ar)))
    return -ac - b * _logsig(odds)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo", "simpo", "orpo"])
@pytest.mark.parametrize("rpo", [None, 0.5])
def test_each_loss_equals_its_formula_values_and_gradients(loss_type, rpo):
    spec = PreferenceSpec(loss_type, beta=0.3, label_smoothing=0.1 if loss_type != "hinge" else 0.0,
                          simpo_gamma=0.4, rpo_alpha=rpo)
    pc = torch.tensor([-5.0, -9.0, -2.5], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-6.0, -4.0, -7.5], dtype=torch.float64, requires_grad=True)
    nc, nr = torch.tensor([4, 6, 3]), torch.tensor([5, 2, 7])
    rc, rr = torch.tensor([-5.5, -8.0, -3.0], dtype=torch.float64), torch.tensor([-5.0, -4.5, -6.0], dtype=torch.float64)
    loss, _, _ = preference_loss(spec, pc, pr, nc, nr, rc, rr)
    loss.sum().backward()
    h = 1e-6
    for i in range(3):
        args = [float(x[i].detach()) for x in (pc, pr, nc, nr, rc, rr)]

        def f(a):
            v = written_out(loss_type, 0.3, spec.label_smoothing, 0.4, *a)
            return v + (rpo or 0.0) * (-a[0] / a[2])

        assert loss[i].item() == pytest.approx(f(args), rel=1e-12, abs=1e-12)
        for k, grad in ((0, pc.grad), (1, pr.grad)):
            up, down = list(args), list(args)
            up[k] += h
            down[k] -= h
            assert grad[i].item() == pytest.approx((f(up) - f(down)) / (2 * h), rel=1e-6, abs=1e-8), (loss_type, i, k)


# ----------------------------------------------------------------------------------------------- data


def _encoder(tokenizer):
    from megapipe.data.sft import ChatEncoder

    return ChatEncoder(tokenizer, "chatml")


@pytest.mark.parametrize("shape", ["conversation", "prompt", "text"])
def test_pairs_share_their_prompt_and_train_on_answers(chat_tokenizer, tmp_path, shape):
    from megapipe.data.preference import prepare_preference_index

    enc = _encoder(chat_tokenizer)
    index = prepare_preference_index([str(write_pairs(tmp_path / "p.jsonl", shape))], enc, cache_dir=str(tmp_path))
    assert index.num_pairs == 2 * len(PAIRS)
    prompt, chosen = index.tokens[0], index.tokens[1]
    text = enc.hf.decode(np.r_[prompt, chosen])
    assert PAIRS[0][0] in enc.hf.decode(prompt) and PAIRS[0][1] not in enc.hf.decode(prompt)
    assert PAIRS[0][1] in text
    assert index.mask[1].any() and not index.mask[0].any()
    again = prepare_preference_index([str(tmp_path / "p.jsonl")], enc, cache_dir=str(tmp_path))
    assert again.cache_hit


@pytest.mark.parametrize("record, message", [
    ({"prompt": "x", "chosen": "y"}, "has no 'rejected'"),
    ({"prompt": "x", "chosen": "y", "rejected": ["z"]}, "both be strings or both lists"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}, "share no first turn"),
    ({"prompt": "x", "chosen": "", "rejected": "z"}, "'chosen' is empty"),
])
def test_a_malformed_pair_stops_with_file_line_or_is_skipped(chat_tokenizer, tmp_path, record, message):
    from megapipe.data.preference import prepare_preference_index

    data = write_pairs(tmp_path / "p.jsonl", "text")
    lines = data.read_text().splitlines()
    lines.insert(2, json.dumps(record))
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(MegapipeError, match=rf"p.jsonl:3: .*{message}.*--skip-bad-records"):
        prepare_preference_index([str(data)], _encoder(chat_tokenizer), cache_dir=str(tmp_path))
    index = prepare_preference_index([str(data)], _encoder(chat_tokenizer), skip_bad=True, cache_dir=str(tmp_path))
    assert index.meta["bad_records"] == 1 and index.num_pairs == 2 * len(PAIRS)


def test_packed_pair_row_equals_two_rows(chat_tokenizer, tmp_path):
    """The prompt once with both answers continuing it (prefix_ids) gives each answer token the log-prob it has in
    its own row (fp32)."""
    from megapipe.config import ModelConfig
    from megapipe.data.preference import build_preference_datasets, prepare_preference_index
    from megapipe.models import build_model
    from megapipe.parallel.step import model_output
    from megapipe.training.recipes.dpo import pair_sums
    from tests.posttrain.conftest import SMALL

    index = prepare_preference_index([str(write_pairs(tmp_path / "p.jsonl"))], _encoder(chat_tokenizer),
                                     cache_dir=str(tmp_path))
    model = build_model(ModelConfig(**SMALL), seed=1)
    sums = []
    for packed in (True, False):
        ds = build_preference_datasets(index, "100,0,0", 96, {"train": 4}, 0, packed, "truncate", 1)["train"]
        rows = [ds.pair(r) for r in range(4)]
        mb = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}
        mb = {k: v.flatten(0, 1) if v.dim() == 3 else v for k, v in mb.items()}
        with torch.no_grad():
            logits = model_output(model, mb).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, mb["labels"][..., None])[..., 0]
        mask = mb["loss_mask"].bool()
        sums.append(pair_sums(logp[mask], mb))
    (a, na), (b, nb) = sums
    assert torch.equal(na, nb)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- the command


def dpo_args(base, data, run, *extra) -> list[str]:
    return ["posttrain", "dpo", "--load", str(base), "--data", str(data), "--chat-template", "chatml",
            "--seq-length", "96", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "75,25,0",
            "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "1", "--log-interval", "1", "--save", str(run),
            "--quiet", *extra]


def records(run: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_cli_trains_logs_and_starts_at_ln2(base_ckpt, chat_tokenizer, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl")
    run = tmp_path / "run"
    assert main(dpo_args(base_ckpt, data, run, "--train-iters", "4", "--beta", "0.5")) == 0
    rec = records(run)
    assert [r["step"] for r in rec] == [1, 2, 3, 4]
    assert rec[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rec[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "logps/chosen", "logps/rejected",
                "lengths/chosen", "lengths/rejected"):
        assert key in rec[-1]
    assert rec[-1]["loss"] < rec[0]["loss"]
    assert rec[0]["lengths/chosen"] > 0
    from megapipe.checkpoint import read_manifest

    manifest = read_manifest(run / "step_00000004")
    assert manifest["stage"] == "dpo" and manifest["dpo"]["loss_type"] == "sigmoid"
    assert manifest["dpo"]["pair_layout"] == "packed"


@pytest.mark.parametrize("extra", [["--precompute-ref-logprobs"], ["--lora-rank", "4"]])
def test_reference_precomputed_or_adapters_off_gives_the_same_first_step(base_ckpt, tmp_path, extra):
    data = write_pairs(tmp_path / "pairs.jsonl")
    assert main(dpo_args(base_ckpt, data, tmp_path / "a", "--train-iters", "2", *extra)) == 0
    rec = records(tmp_path / "a")
    assert rec[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rec[-1]["loss"] < rec[0]["loss"]


def test_reference_free_losses_train(base_ckpt, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl")
    for loss in ("simpo", "orpo"):
        assert main(dpo_args(base_ckpt, data, tmp_path / loss, "--train-iters", "2", "--loss-type", loss)) == 0
        rec = records(tmp_path / loss)
        assert all(math.isfinite(r["loss"]) for r in rec)


def test_resume_is_exact(base_ckpt, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl")
    assert main(dpo_args(base_ckpt, data, tmp_path / "full", "--train-iters", "4")) == 0
    assert main(dpo_args(base_ckpt, data, tmp_path / "cut", "--train-iters", "4", "--exit-interval", "2")) == 0
    assert main(dpo_args(base_ckpt, data, tmp_path / "cut", "--train-iters", "4")) == 0
    full, cut = records(tmp_path / "full"), records(tmp_path / "cut")
    assert [r["loss"] for r in cut] == [r["loss"] for r in full]


def test_flags_refused_with_their_names(base_ckpt, tmp_path, capsys):
    data = write_pairs(tmp_path / "pairs.jsonl")
    for flag, message in ((["--packing"], "--packing is an SFT flag"),
                          (["--beta", "-1"], "dpo.beta (--beta) = -1.0 must be > 0")):
        assert main(dpo_args(base_ckpt, data, tmp_path / "r", "--train-iters", "1", *flag)) != 0
        assert message in capsys.readouterr().err


def trl_python():
    """A Python that can import trl: this one, else $MEGAPIPE_TRL_PYTHON / /work/.venv-trl (TRL is a bench extra,
    never in megapipe's environment); None when there is none."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("trl") is not None:
        return sys.executable
    python = os.environ.get("MEGAPIPE_TRL_PYTHON", "/work/.venv-trl/bin/python")
    return python if Path(python).is_file() else None


def test_trl_parity(tmp_path):
    """TRL's DPOTrainer and `posttrain dpo` on the same tiny model, pairs, batch, optimiser and settings
    (tools/bench_dpo.py's workers): the same sigmoid loss at each of three steps (ln 2, then after one and two
    AdamW updates) and the same summed log-probs of each side."""
    import argparse
    import subprocess
    import sys

    from tools import bench_dpo
    from tools.bench_steps import ROOT, run_worker

    python = trl_python()
    if python is None:
        pytest.skip("trl is not installed (a bench extra: /work/.venv-trl or $MEGAPIPE_TRL_PYTHON): the formula "
                    "tests above cover each loss")
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_random_hf.py"), "--arch", "llama", "--output",
                    str(model), "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                    "--vocab", "512", "--dtype", "float32"], check=True, cwd=ROOT, capture_output=True)
    pairs = bench_dpo.make_pairs(tmp_path / "pairs.jsonl", 4, 6, 6)
    opts = dict(model=str(model), work=str(tmp_path), pairs=str(pairs), batch=4, seq_length=256, steps=2, warmup=1,
                threads=1, lr=1e-2)
    ours = bench_dpo.megapipe_worker(argparse.Namespace(**opts))
    trl = run_worker(bench_dpo.__file__, [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()], "trl",
                     python=python)
    assert trl is not None, "the TRL worker failed (its stderr is above)"
    assert ours["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert ours["losses"] == pytest.approx(trl["losses"], abs=1e-5)
    assert np.asarray(ours["logps"]) == pytest.approx(np.asarray(trl["logps"]), abs=1e-3)
