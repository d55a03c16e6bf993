import math

import pytest

from megapipe.config import TrainConfig
from megapipe.errors import CheckpointError
from megapipe.training.lr import LRSchedule


def sched(style, **kw):
    t = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style=style, **kw)
    return LRSchedule.from_train_config(t, train_iters=110)


def test_warmup_is_linear_from_zero_to_peak():
    s = sched("cosine")
    assert [s.lr_at(n) for n in (1, 5, 10)] == [0.1, 0.5, 1.0]


def test_cosine_formula():
    s = sched("cosine")
    for n in (11, 35, 60, 99, 110):
        r = (n - 10) / 100
        assert s.lr_at(n) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * r) + 1), abs=1e-15)
    assert s.lr_at(60) == pytest.approx(0.55)  # half-way: the mean of peak and floor
    assert s.lr_at(110) == pytest.approx(0.1) and s.lr_at(500) == 0.1


def test_linear_formula():
    s = sched("linear")
    assert s.lr_at(35) == pytest.approx(0.1 + 0.9 * (1 - 25 / 100))
    assert s.lr_at(110) == pytest.approx(0.1) and s.lr_at(111) == 0.1


def test_constant_after_warmup():
    s = sched("constant")
    assert s.lr_at(5) == 0.5 and s.lr_at(11) == 1.0 and s.lr_at(10_000) == 1.0


def test_wsd_holds_then_anneals_over_the_last_fraction():
    s = sched("wsd", lr_wsd_decay_fraction=0.2)  # decay_iters 110: anneal over the last 22 steps, from step 88
    assert s.wsd_decay_iters == 22
    assert s.lr_at(50) == 1.0 and s.lr_at(88) == 1.0
    assert s.lr_at(99) == pytest.approx(0.1 + 0.9 * (1 - 11 / 22))
    assert s.lr_at(110) == pytest.approx(0.1)
    cos = sched("wsd", lr_wsd_decay_fraction=0.2, lr_wsd_decay_style="cosine")
    assert cos.lr_at(99) == pytest.approx(0.55)


def test_decay_iters_override_and_no_warmup():
    t = TrainConfig(lr=2.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_iters=50, lr_decay_style="linear")
    s = LRSchedule.from_train_config(t, train_iters=100)
    assert s.lr_at(0) == 2.0 and s.lr_at(25) == pytest.approx(1.0) and s.lr_at(80) == 0.0


def test_resume_into_another_schedule_is_refused():
    s = sched("cosine")
    s.check_resumable(s.state_dict())
    with pytest.raises(CheckpointError, match="max_lr = 2.0 but this run has 1.0"):
        s.check_resumable({**s.state_dict(), "max_lr": 2.0})
