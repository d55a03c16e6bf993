"""Speculative decoding with DeepSeek-V4's MTP module (megapipe.inference.speculative on the compressed cache,
megapipe.inference.compressed_cache): a verification writes the last token and its drafts into the window's keys,
the entries they complete and the compressors' carry; what rejected drafts wrote lies past the sequence's length
and the carry advances over the kept tokens only. Greedy output is token-identical to decoding without drafts (and
to transformers' for an imported checkpoint), drafts are rejected after completing entries, preemption and abort
give everything back, and sampled output keeps its distribution; n-gram drafts take the same rollback."""

from __future__ import annotations

import copy

import pytest
import torch

from megapipe.checkpoint.load import load_model
from megapipe.config import ModelConfig
from megapipe.inference import EngineConfig, LLMEngine, SamplingParams
from megapipe.models import build_model
from tests.dist.parallel_cases import MODELS
from tests.helpers.hf_mtp import make_v4_mtp_dir
from tests.helpers.hf_tiny import hf_greedy
from tests.inference.test_deepseek_v4_engine import idle
from tests.inference.test_speculative import (
    MIXED,
    PROMPTS,
    V,
    assert_same_greedy,
    check_sampled_marginals,
    engine,
    periodic_model,
)

CFG = ModelConfig(**{**MODELS["dsv4_mtp"], "vocab_size": V, "max_position_embeddings": 256})
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def drafting_model():
    """Trained to continue PERIOD (the main model and its MTP module predict it), the MTP module's weights then
    perturbed: about half the first drafts are accepted, a fraction of the later ones."""
    model = periodic_model(CFG)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.mtp.parameters():
            p.add_(0.4 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny DeepseekV4ForCausalLM checkpoint with its ``mtp.0.*`` layer: (transformers' model, megapipe's)."""
    import transformers

    path, _, _ = make_v4_mtp_dir(tmp_path_factory.mktemp("deepseek_v4_mtp"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_model(path, torch.device("cpu"), torch.float32).model


def count_entry_rollbacks(e: LLMEngine, rate: int) -> list[int]:
    """Spy on ``e``'s verifications: [rejections, of which a rejected draft had completed an entry at ``rate``]."""
    counts, verify = [0, 0], e.speculator.verify

    def spy(seq, logits):
        out = verify(seq, logits)
        start, drafts = seq.num_computed, len(seq.draft.tokens)
        if len(out) <= drafts:
            counts[0] += 1
            counts[1] += (start + drafts + 1) // rate > (start + len(out)) // rate
        return out

    e.speculator.verify = spy
    return counts


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_output_is_token_identical(drafting_model, k, one_thread):
    """The mixed batch of test_speculative (penalties, min_tokens, stop ids, logprobs; k = 4 reuses the one MTP
    module): the tokens, finish reasons and logprobs of decoding without drafts; drafts were accepted and rejected,
    rejected ones after completing CSA (rate 2) and HCA (rate 4) entries; every block given back."""
    spec = engine(drafting_model, k, max_num_seqs=3)
    csa, hca = count_entry_rollbacks(spec, 2), None
    assert_same_greedy(engine(drafting_model, max_num_seqs=3), spec)
    s = spec.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert s["spec_decode_acceptance_rate_per_pos"][0] > 0.3
    assert csa[0] > 10 and csa[1] > 5, csa
    assert idle(spec)
    spec = engine(drafting_model, k, max_num_seqs=3)
    hca = count_entry_rollbacks(spec, 4)
    spec.generate(PROMPTS, MIXED)
    assert hca[1] > 0, hca


def test_ngram_drafts_keep_greedy_output(drafting_model, one_thread):
    """Prompt-lookup drafts on the same batch (its periodic outputs repeat themselves): the same rollback."""
    spec = engine(drafting_model, 3, max_num_seqs=3, speculative_method="ngram", prompt_lookup_min=1)
    assert_same_greedy(engine(drafting_model, max_num_seqs=3), spec)
    s = spec.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"] and idle(spec)


def test_drafts_are_the_mtp_module_on_the_full_sequence(drafting_model, one_thread):
    """Every first draft equals what the training path's MTP module predicts from the whole sequence: its block's
    keys in the window's pool stay exact through rejections, and the window's blocks it reads are not given back
    (sequences several windows long, a prompt in chunks, a small pool)."""
    e = engine(drafting_model, 2, max_num_batched_tokens=8, num_blocks=16, max_model_len=64)
    seen, propose = [], e.speculator.propose

    def spy(seqs, tables):
        propose(seqs, tables)
        seen.extend((list(s.tokens), list(s.draft.tokens)) for s in seqs)

    e.speculator.propose = spy
    e.generate([PROMPTS[0], PROMPTS[2], list(range(1, 16)) * 2, PROMPTS[4]], GREEDY)
    assert len(seen) > 20 and max(len(t) for t, _ in seen) > 4 * CFG.sliding_window
    with torch.no_grad():
        for tokens, draft in seen:
            _, full = drafting_model(torch.tensor([tokens]), mtp=True)
            assert draft[0] == int(full[0][0, len(tokens) - 2].argmax())


def test_imported_checkpoint_drafts_to_transformers_greedy(imported, one_thread):
    """An imported checkpoint (its random MTP layer's drafts nearly all rejected): transformers' greedy tokens, alone
    and in a continuous batch, with the MTP block's window kept behind the main layers'."""
    hf, model = imported
    prompts = [list(range(1, 30)), [5, 17, 9, 33, 2], [7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    e = LLMEngine(copy.deepcopy(model), config=EngineConfig(cpu_kernels=False, pack_weights=False, block_size=4,
                                                            speculative_tokens=3), eos_token_ids=[])
    assert e.scheduler.window == model.cfg.sliding_window + 1 and e.speculator.reach == model.cfg.sliding_window
    assert [o.outputs[0].token_ids for o in e.generate(prompts, GREEDY)] == want
    assert e.stats()["spec_decode_num_draft_tokens"] > 100 and idle(e)


def test_preemption_and_abort_free_everything(drafting_model, one_thread):
    """Too few window blocks for the batch: sequences are preempted mid-drafting and recomputed to the same tokens;
    an abort mid-drafting gives back the window's blocks, the entry blocks and the state slot."""
    want = [o.outputs[0].token_ids for o in engine(drafting_model).generate(PROMPTS, GREEDY)]
    small = engine(drafting_model, 2, num_blocks=14, max_model_len=48)
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS, GREEDY)] == want
    assert small.scheduler.num_preemptions > 0 and idle(small)
    e = engine(drafting_model, 2)
    e.add_request("a", PROMPTS[0], GREEDY)
    e.add_request("b", PROMPTS[2], GREEDY)
    for _ in range(4):
        e.step()
    assert e.stats()["spec_decode_num_draft_tokens"] > 0 and not idle(e)
    # the KV memory in use: the window's blocks and the entry blocks, by their bytes
    pools = [(e.blocks, e.pool.bytes_per_block(5, 4, 1, CFG.dim_per_head, torch.float32, True))]
    pools += [(b, e.pool.entries.bytes_per_block(r)) for r, b in e.scheduler.entry_blocks.items()]
    held = sum((b.num_blocks - b.num_free()) * size for b, size in pools)
    assert e.stats()["kv_cache_usage"] == held / sum(b.num_blocks * size for b, size in pools) > 0
    e.abort("a")
    e.abort("b")
    assert idle(e) and e.stats()["kv_cache_usage"] == 0


def test_sampled_output_has_the_target_distribution(one_thread):
    """test_speculative's frequencies of the second and third sampled tokens, on a random V4 model with MTP."""
    model = build_model(CFG, seed=0).eval()
    stats = check_sampled_marginals(model, lambda k: engine(model, k, max_num_seqs=512, max_num_batched_tokens=4096),
                                    [3, 1, 4, 1, 5], 1.5)
    assert stats["spec_decode_num_accepted_tokens"] > 0
