"""`posttrain rl --reward-model RM_CKPT[=WEIGHT]`: the reward model scores each completion in this process, next to
the rule rewards; the reward logged is its score of the rollout (recomputed here from the completions a recording
reward function saw), and a checkpoint that is not a reward model is refused in one sentence."""

from __future__ import annotations

import json
import sys

import pytest

from megapipe.cli import main
from tests.helpers.rl import TINY, records

RECORDER = '''
import json, os

def record(prompts, completions, **fields):
    with open(os.environ["RL_RECORD"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions}) + "\\n")
    return [0.0] * len(completions)
'''


@pytest.fixture
def reward_model(tmp_path_factory, tiny_tokenizer_dir):
    """A random reward model (model.num_labels = 1) with the tiny tokenizer, as posttrain rm leaves one."""
    from megapipe.checkpoint import write_checkpoint
    from megapipe.config import ModelConfig, to_dict
    from megapipe.models import build_model

    cfg = ModelConfig(**TINY, num_labels=1)
    path = tmp_path_factory.mktemp("rm") / "rm"
    write_checkpoint(path, build_model(cfg, seed=5), manifest={
        "stage": "rm", "model": to_dict(cfg), "reward_model": {"pad_id": 0, "chat_template": "none"}},
        tokenizer=tiny_tokenizer_dir)
    return path


def rl_args(base, run, *extra) -> list[str]:
    return ["posttrain", "rl", "--load", str(base), "--save", str(run), "--task", "arithmetic",
            "--prompts-per-step", "2", "--group-size", "2", "--max-completion-tokens", "6", "--max-prompt-tokens",
            "48", "--micro-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1",
            "--precision", "fp32", "--quiet", *extra]


def test_the_reward_logged_is_the_reward_models_score(rl_base, reward_model, tmp_path, monkeypatch):
    from megapipe.posttrain.reward_model import RewardModel

    (tmp_path / "recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("recorder", None)
    monkeypatch.setenv("RL_RECORD", str(tmp_path / "seen.jsonl"))
    run = tmp_path / "run"
    assert main(rl_args(rl_base, run, "--reward", "recorder:record=0", "--reward-model", f"{reward_model}=0.5")) == 0
    recs = [r for r in records(run) if r["kind"] == "train"]
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(recs) == len(seen) == 2
    rm = RewardModel.load(reward_model)
    for rec, batch in zip(recs, seen, strict=True):
        scores = rm.score(batch["prompts"], batch["completions"])
        assert rec["reward/reward_model"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)
        assert rec["reward"] == pytest.approx(0.5 * rec["reward/reward_model"], abs=1e-6)
    manifest = json.loads((run / "step_00000002" / "megapipe.json").read_text())
    assert manifest["rl"]["rewards"] == ["recorder:record", "reward_model"]


def test_a_checkpoint_that_is_not_a_reward_model_is_refused(rl_base, tmp_path, capsys):
    assert main(rl_args(rl_base, tmp_path / "run", "--reward-model", f"{rl_base}=2")) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "is not a reward model (model.num_labels = None)" in err and not (tmp_path / "run").exists()
