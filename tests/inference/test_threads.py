"""The thread governor (megapipe/inference/threads.py): one thread while the process gets too small a share of its
threads' time, all of them tried again after a hold that doubles while the contention lasts; the caller's thread
count restored after every step; the engine's steps governed (or not, by EngineConfig), with the same tokens."""

from __future__ import annotations

import pytest
import torch

from megapipe.errors import ConfigError
from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.engine import EngineConfig
from megapipe.inference.threads import ThreadGovernor


def seconds(governor: ThreadGovernor, wall: float, share: float, threads: int = 2, step: float = 0.25) -> None:
    """``wall`` seconds of steps on ``threads`` threads (one thread while the governor says so) that got ``share``
    of their threads' time (steps of a quarter second: sums exact in binary)."""
    for _ in range(round(wall / step)):
        n = governor.threads(threads)
        governor.observe(step, step * share * n, n)


def test_contention_drops_to_one_thread_and_the_hold_doubles_while_it_lasts():
    g = ThreadGovernor(window_s=1.0, threshold=0.75, hold_s=5.0, max_hold_s=20.0)
    seconds(g, 3.0, 0.95)
    assert g.threads(2) == 2  # alone: spinning threads are busy threads
    seconds(g, 0.5, 0.5)
    assert g.threads(2) == 2  # not a whole window yet
    seconds(g, 0.5, 0.5)
    assert (g.threads(2), g.hold) == (1, 5.0)
    seconds(g, 4.75, 1.0)
    assert g.threads(2) == 1
    seconds(g, 0.25, 1.0)
    assert g.threads(2) == 2  # held 5 s: all threads tried again
    for hold in (10.0, 20.0, 20.0):  # still contended: each hold twice the last, at most max_hold_s
        seconds(g, 1.0, 0.5)
        assert (g.threads(2), g.hold) == (1, hold)
        seconds(g, hold, 1.0)
        assert g.threads(2) == 2
    seconds(g, 1.0, 0.9)  # the other process is gone
    assert (g.threads(2), g.hold) == (2, 5.0)
    seconds(g, 1.0, 0.5)
    assert (g.threads(2), g.hold) == (1, 5.0)  # a new contention starts from the first hold


def test_one_configured_thread_is_never_governed():
    g = ThreadGovernor()
    seconds(g, 5.0, 0.2, threads=1)
    assert g.threads(1) == 1 and not g.single


def test_a_step_runs_on_the_governed_count_and_restores_the_callers():
    g = ThreadGovernor()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g.single = True
        with g.step():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        g.single = False
        with g.step():
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), g.step():
            raise RuntimeError("a step that fails")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_engine_steps_are_governed_with_the_same_tokens(hf_llama):
    from megapipe.checkpoint.load import load_model

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 9, 33, 2], [44, 3, 120, 7]]
    outs = {}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for single in (False, True):
            loaded = load_model(hf_llama[0], torch.device("cpu"), torch.float32)
            engine = LLMEngine(loaded.model, None, EngineConfig(block_size=4, num_blocks=64), eos_token_ids=[0])
            engine.governor.single = single
            seen, execute = set(), engine.runner.execute

            def counted(plan, execute=execute, seen=seen):
                seen.add(torch.get_num_threads())
                return execute(plan)

            engine.runner.execute = counted
            outs[single] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
            assert seen == {1 if single else 2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert outs[True] == outs[False]
    loaded = load_model(hf_llama[0], torch.device("cpu"), torch.float32)
    assert LLMEngine(loaded.model, None, EngineConfig(thread_governor=False), eos_token_ids=[0]).governor is None
    with pytest.raises(ConfigError, match="EngineConfig.thread_governor = 'yes' must be True or False"):
        EngineConfig(thread_governor="yes").check()
