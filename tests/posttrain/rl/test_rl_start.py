"""The checkpoint an RL run started from is recorded under the one key of every post-training stage
(``posttrain_start``, megapipe.posttrain.start). A run whose checkpoints recorded it the earlier way (``rl.start``)
is still checked against --load, resumes from the same start, and its new checkpoints carry the one key only."""

from __future__ import annotations

import json

import pytest

from megapipe.errors import ConfigError
from tests.helpers.rl import make_config, train


def _as_written_before(ckpt) -> None:
    """Rewrite ``ckpt``'s manifest the way RL checkpoints recorded their start before the one key."""
    path = ckpt / "megapipe.json"
    m = json.loads(path.read_text())
    m["rl"]["start"] = m.pop("posttrain_start")
    path.write_text(json.dumps(m, indent=2))


def test_a_run_that_recorded_its_start_under_rl_start_resumes_under_the_one_key(rl_base, tmp_path):
    from megapipe.checkpoint import write_checkpoint
    from megapipe.models import build_model

    run = tmp_path / "run"
    summary, trainer = train(make_config(rl_base, run, **{"train.train_iters": 2, "train.exit_interval": 1}))
    assert summary["stopped_by"] == "--exit-interval 1"
    _as_written_before(run / "step_00000001")

    other = write_checkpoint(tmp_path / "other", build_model(trainer.cfg.model, seed=1), manifest={
        "stage": "pretrain", "model": trainer.cfg.model})
    with pytest.raises(ConfigError, match=f"holds a run started from {rl_base.absolute()}, not from {other.absolute()}"):
        make_config(other, run)

    cfg = make_config(rl_base, run, **{"train.train_iters": 2})
    assert cfg.checkpoint.load == str(run) and not cfg.checkpoint.finetune
    summary, _ = train(cfg)
    assert summary["steps"] == 2
    m = json.loads((run / "step_00000002" / "megapipe.json").read_text())
    assert m["posttrain_start"] == str(rl_base.absolute()) and "start" not in m["rl"]
    assert m["parent"] == str(run / "step_00000001")
