"""The engine step's typed contracts: the scheduler's SchedulerOutput, the runner's RunnerOutput and the engine's
update_from_output, each checked on its own (tests/inference/test_engine.py checks the tokens they produce)."""

from __future__ import annotations

from megapipe.inference import SamplingParams
from megapipe.inference.runner import RunnerOutput

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_scheduler_output_of_a_mixed_prefill_decode_batch(tiny_engine_factory):
    """One decoding sequence, one whose prompt is half prefilled, one admitted now: each with exactly its tokens
    under the 16-token budget (decode first, then the running chunk, then the new one), blocks for all of them."""
    engine = tiny_engine_factory(block_size=4, max_num_batched_tokens=16, prefix_caching=False)
    engine.add_request("dec", [1, 2, 3], SamplingParams(max_tokens=8, **GREEDY))
    engine.step()  # its prompt, and its first token sampled: it decodes from now on
    engine.add_request("long", list(range(10, 40)), SamplingParams(max_tokens=8, **GREEDY))  # 30 tokens
    engine.step()  # 1 decode + 15 of the 30
    engine.add_request("new", [7, 8, 9, 10], SamplingParams(max_tokens=8, **GREEDY))
    dec, long, new = (engine.requests[r].seqs[0] for r in ("dec", "long", "new"))
    assert long.num_computed == 15
    plan = engine.scheduler.schedule()
    assert plan.decodes == [dec]
    assert plan.chunks == [(long, 15)]  # the budget is spent before the new sequence
    assert plan.new == [] and plan.preempted == [] and plan.continuing == [dec, long]
    assert plan.num_scheduled_tokens == {dec.seq_id: 1, long.seq_id: 15}
    assert plan.tables == {dec.seq_id: dec.block_ids, long.seq_id: long.block_ids}
    assert len(long.block_ids) == 30 // 4 + 1 and len(dec.block_ids) == -(-(len(dec.tokens)) // 4)
    engine.update_from_output(plan, engine.runner.execute(plan))
    plan = engine.scheduler.schedule()  # the long prompt done: the new one is admitted with the rest of the budget
    assert plan.decodes == [dec, long] and plan.chunks == [(new, 4)] and plan.new == [new]
    assert plan.num_scheduled_tokens == {dec.seq_id: 1, long.seq_id: 1, new.seq_id: 4}


def test_scheduler_output_names_the_preempted(tiny_engine_factory):
    """Two sequences decoding in a pool with no block left: the later admitted one is preempted, reported once."""
    engine = tiny_engine_factory(block_size=4, num_blocks=16, max_model_len=64, prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(rid, list(range(1, 32)), SamplingParams(max_tokens=30, **GREEDY))
    a, b = engine.requests["a"].seqs[0], engine.requests["b"].seqs[0]
    preempted = []
    while not preempted:
        plan = engine.scheduler.schedule()
        preempted = plan.preempted
        engine.update_from_output(plan, engine.runner.execute(plan))
    assert preempted == [b] and plan.decodes == [a] and b in engine.scheduler.waiting and not b.block_ids


def test_runner_output_then_update_finishes_on_a_stop_token_and_frees_blocks(tiny_engine_factory):
    """The runner samples one token per sequence at its end; update_from_output appends it, and a stop token
    finishes the sequence (finish_reason stop, stop_reason the id), frees its blocks and leaves it out of the ids."""
    engine = tiny_engine_factory(block_size=4)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, logprobs=1, **GREEDY))
    seq = engine.requests["a"].seqs[0]
    plan = engine.scheduler.schedule()
    result = engine.runner.execute(plan)
    assert list(result.sampled) == [seq.seq_id] and len(result.sampled[seq.seq_id]) == 1
    assert len(result.logprobs[seq.seq_id]) == 1 and result.num_accepted == {}
    assert seq.num_computed == 0 and len(seq.tokens) == 5  # the runner changes no sequence
    first = result.sampled[seq.seq_id][0]
    (out,) = engine.update_from_output(plan, result)
    assert seq.num_computed == 5 and seq.output_ids == [first] and not out.finished
    assert out.outputs[0].logprobs == result.logprobs[seq.seq_id]
    # the next token is the request's stop token: the runner's result, as if sampled
    seq.params.stop_token_ids = [4242]
    plan = engine.scheduler.schedule()
    assert plan.decodes == [seq] and engine.blocks.usage() > 0
    (out,) = engine.update_from_output(
        plan, RunnerOutput(sampled={seq.seq_id: [4242]}, logprobs={seq.seq_id: [(-0.5, [])]})
    )
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == 4242
    assert out.outputs[0].token_ids == [first] and out.outputs[0].logprobs == result.logprobs[seq.seq_id]
    assert seq.output_ids == [first, 4242] and seq.block_ids == [] and engine.blocks.usage() == 0
    assert "a" not in engine.requests and not engine.scheduler.running


def test_update_applies_verified_drafts_up_to_max_tokens(tiny_engine_factory):
    """Under speculative decoding a verified sequence advances by the accepted drafts and the token after them;
    a length limit reached among them finishes it there (the rest is dropped) and frees its blocks."""
    engine = tiny_engine_factory(block_size=4, speculative_tokens=3, speculative_method="ngram")
    engine.add_request("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=3, **GREEDY))
    seq = engine.requests["a"].seqs[0]
    engine.step()  # the prompt and its first token
    plan = engine.scheduler.schedule()
    assert plan.decodes == [seq] and seq.num_lookahead == 1  # max_tokens leaves room for one draft
    (out,) = engine.update_from_output(
        plan, RunnerOutput(sampled={seq.seq_id: [11, 12, 13]}, num_accepted={seq.seq_id: 2})
    )
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].token_ids[1:] == [11, 12]
    assert engine.blocks.usage() == 0


def test_engine_config_names_the_drafter_feature_it_needs():
    from megapipe.inference.engine import EngineConfig

    assert EngineConfig().drafter_feature is None
    assert EngineConfig(speculative_method="ngram").drafter_feature is None  # no drafts asked for
    assert EngineConfig(speculative_tokens=2, speculative_method="ngram").drafter_feature == "ngram_speculative"
    assert EngineConfig(speculative_tokens=2).drafter_feature == "speculative"
