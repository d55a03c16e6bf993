import pytest
import torch

from megapipe.training.precision import DynamicLossScaler


def params_with_grads(*grads):
    ps = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        ps.append(p)
    return ps


def test_unscale_divides_gradients_and_reports_no_overflow():
    s = DynamicLossScaler(initial_scale=8.0)
    ps = params_with_grads(torch.tensor([8.0, 16.0]), torch.tensor([[4.0]]))
    assert s.unscale_(ps) is False
    assert ps[0].grad.tolist() == [1.0, 2.0] and ps[1].grad.item() == 0.5


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_overflow_halves_the_scale_down_to_the_minimum(bad):
    s = DynamicLossScaler(initial_scale=4.0, min_scale=1.0, growth_interval=3)
    for expected in (2.0, 1.0, 1.0):
        found = s.unscale_(params_with_grads(torch.tensor([1.0, bad])))
        assert found is True
        s.update(found)
        assert s.scale == expected


def test_scale_doubles_after_a_window_of_clean_steps_and_overflow_resets_the_count():
    s = DynamicLossScaler(initial_scale=4.0, growth_interval=3)
    for _ in range(2):
        s.update(False)
    s.update(True)  # overflow: halve, restart the window
    assert s.scale == 2.0 and s.clean_steps == 0
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0 and s.clean_steps == 0


def test_state_dict_round_trip():
    s = DynamicLossScaler(initial_scale=2.0**16, growth_interval=10)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.clean_steps) == (2.0**15, 1)


def test_scaled_fp16_backward_recovers_from_overflow():
    """A real fp16 autocast backward with a too-large scale overflows, is skipped, and succeeds once halved."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    s = DynamicLossScaler(initial_scale=2.0**24, growth_interval=1000)
    history = []
    for _ in range(20):
        lin.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lin(x).float().pow(2).sum() * 100
        s.scale_loss(loss).backward()
        found = s.unscale_(list(lin.parameters()))
        s.update(found)
        history.append(found)
        if not found:
            break
    assert history[0] is True and history[-1] is False
    assert s.scale < 2.0**24
    ref = torch.nn.Linear(16, 16)
    ref.load_state_dict(lin.state_dict())
    (ref(x).pow(2).sum() * 100).backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=2e-2, atol=1e-1)
