"""Sampling against its definitions: drawn frequencies equal softmax(logits / T) at T = 0.5 and 2, top-k / top-p /
min-p keep exactly the sets their definitions name, penalties follow their formulas; end to end through the engine
(the first sampled token's frequencies against a full forward)."""

from __future__ import annotations

import math

import pytest
import torch

from megapipe.errors import MegapipeError
from megapipe.inference import SamplingParams
from megapipe.inference.sampling import (
    ParamError,
    SampleRow,
    apply_penalties,
    filter_logits,
    greedy_ids,
    penalised,
    sample,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
DRAWS = 40_000


def frequencies(params: SamplingParams, logits=LOGITS, draws=DRAWS, seed=0) -> torch.Tensor:
    """Empirical distribution of ``draws`` samples (rows of one batch, each its own seeded generator)."""
    rows = []
    for i in range(draws // 1000):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        rows.extend(SampleRow(params, g, [], []) for _ in range(1000))
    out = torch.cat([sample(logits.expand(1000, -1).clone(), rows[k:k + 1000]) for k in range(0, draws, 1000)])
    return torch.bincount(out, minlength=logits.shape[-1]).double() / draws


def assert_matches(freq: torch.Tensor, probs: torch.Tensor, draws=DRAWS) -> None:
    """Every frequency within 5 binomial standard deviations (+ a hair) of its probability."""
    probs = probs.double()
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), (freq.tolist(), probs.tolist())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_follow_softmax_of_logits_over_t(temperature):
    freq = frequencies(SamplingParams(temperature=temperature))
    assert_matches(freq, (LOGITS / temperature).softmax(-1))
    wrong = (LOGITS * temperature).softmax(-1)  # the classic bug: multiplying by T
    if temperature != 1.0:
        assert (freq - wrong.double()).abs().max() > 0.05


def test_top_k_keeps_the_k_most_likely_renormalised():
    freq = frequencies(SamplingParams(temperature=1.0, top_k=3))
    want = torch.zeros(6)
    want[:3] = LOGITS[:3].softmax(-1)
    assert_matches(freq, want)
    assert (freq[3:] == 0).all()


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)  # [0.49, 0.18, 0.11, 0.07, 0.04, 0.02] (cumulative 0.49, 0.67, 0.78, ...)
    cum = probs.cumsum(-1)
    for top_p in (0.3, 0.6, 0.75, 0.9):
        keep = int((cum < top_p).sum()) + 1  # the smallest prefix whose mass reaches top_p
        freq = frequencies(SamplingParams(temperature=1.0, top_p=top_p), draws=10_000, seed=int(top_p * 10))
        want = torch.zeros(6)
        want[:keep] = probs[:keep] / probs[:keep].sum()
        assert_matches(freq, want, 10_000)


def test_top_p_applies_to_the_tempered_distribution():
    tempered = (LOGITS / 2.0).softmax(-1)
    keep = int((tempered.cumsum(-1) < 0.6).sum()) + 1
    freq = frequencies(SamplingParams(temperature=2.0, top_p=0.6), draws=10_000)
    want = torch.zeros(6)
    want[:keep] = tempered[:keep] / tempered[:keep].sum()
    assert_matches(freq, want, 10_000)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    probs = LOGITS.softmax(-1)
    keep = probs >= 0.2 * probs.max()
    freq = frequencies(SamplingParams(temperature=1.0, min_p=0.2), draws=10_000)
    want = torch.where(keep, probs, torch.zeros(6))
    assert_matches(freq, want / want.sum(), 10_000)


def test_filter_logits_by_hand():
    logits = torch.tensor([[0.5, 0.05, 0.3, 0.15]]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(top_k=2) == [0, 2]
    assert kept(top_k=0) == [0, 1, 2, 3]
    assert kept(top_p=0.4) == [0]
    assert kept(top_p=0.75) == [0, 2]
    assert kept(top_p=0.85) == [0, 2, 3]
    assert kept(top_k=1, top_p=0.99) == [0]
    assert kept(top_k=3, top_p=0.99) == [0, 2, 3]
    assert kept(min_p=0.5) == [0, 2]  # 0.3 >= 0.25, 0.15 < 0.25
    assert kept(min_p=0.1) == [0, 2, 3]  # 0.05 < 0.05? no: 0.05 is not below 0.05
    two_rows = filter_logits(torch.stack([logits[0], logits[0].flip(0)]), top_k=1)
    assert torch.isfinite(two_rows).nonzero().tolist() == [[0, 0], [1, 3]]


def test_top_p_on_candidates_equals_a_sort_of_the_whole_row():
    """The nucleus is found among a row's most likely tokens where they hold it (a peaked row), among more of them
    or by a sort of the whole row where they do not (flatter rows): the same tokens kept as the definition, a
    descending sort and the mass before each token, gives."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 10000, generator=g)
    logits[0, :5] += 12.0  # nucleus inside the first 64 candidates
    logits[1, :200] += 4.0  # beyond 64, inside 1024
    logits[2] *= 0.01  # nearly flat
    logits[3, 7] = 50.0  # one token holds it all
    for top_p in (0.1, 0.5, 0.9, 0.99):
        want = torch.isfinite(torch.stack([reference_filter(row, 0, top_p, 0.0) for row in logits]))
        got = torch.isfinite(filter_logits(logits, top_p=top_p))
        assert torch.equal(got, want), top_p
        assert torch.equal(filter_logits(logits, top_p=top_p)[got], logits[got])  # kept logits unchanged
        one = torch.isfinite(filter_logits(logits[1], top_p=top_p))  # a single row [V]
        assert torch.equal(one, want[1])
    sizes = torch.isfinite(filter_logits(logits, top_p=0.5)).sum(-1).tolist()
    assert sizes[0] <= 64 < sizes[1] <= 1024 < sizes[2] <= 8192 and sizes[3] == 1  # every candidate count served
    assert torch.isfinite(filter_logits(logits[2], top_p=0.99)).sum() > 8192  # and the sort


def reference_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The definitions, one row at a time: k-th largest value, a descending sort and the mass before each token,
    probabilities against min_p times the largest."""
    if 0 < top_k < row.numel():
        row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        values, order = row.sort(descending=True)
        probs = values.softmax(-1)
        drop = torch.zeros_like(row, dtype=torch.bool).scatter_(-1, order, probs.cumsum(-1) - probs >= top_p)
        row = row.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return row


def test_each_row_of_a_batch_keeps_its_own_truncation():
    """One batch, every row with its own top-k / top-p / min-p (some off, some combined): each row keeps what the
    definitions keep for it alone."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 3000, generator=g) * 2
    logits[:, :10] += torch.linspace(9, 3, 10)
    settings = [(0, 1.0, 0.0), (50, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.05), (20, 0.8, 0.0), (0, 0.95, 0.1),
                (5, 0.5, 0.2), (0, 0.999, 0.0)]
    got = filter_logits(logits, *map(list, zip(*settings, strict=True)))
    for i, (k, p, m) in enumerate(settings):
        want = reference_filter(logits[i], k, p, m)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), settings[i]
        assert torch.equal(got[i][torch.isfinite(want)], logits[i][torch.isfinite(want)])
    assert torch.isfinite(got[7]).sum() > 64  # its set is not among the first candidates


@pytest.mark.parametrize("seed", range(4))
def test_top_p_over_random_batches_equals_the_definition(seed):
    """Batches whose rows take different ways to their set (some straight from 64 to 8192 candidates, some through
    1024, some to the sort), at several top_p: each row keeps what the definition keeps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 10000, generator=g) * torch.tensor([[3.0], [1.0], [0.3], [0.05], [2.0], [0.5]])
    for top_p in (0.3, 0.7, 0.95):
        want = torch.stack([torch.isfinite(reference_filter(row, 0, top_p, 0.0)) for row in logits])
        assert torch.equal(torch.isfinite(filter_logits(logits, top_p=top_p)), want), top_p


def test_top_p_rows_reaching_the_same_candidates_by_different_ways():
    """Row 1 (flat) goes from 64 candidates straight to 8192, row 0 (64 strong tokens over a flat tail) through 1024:
    both are looked up among 8192 together, each keeping its own set."""
    g = torch.Generator().manual_seed(5)
    logits = 0.01 * torch.randn(2, 10000, generator=g)
    logits[0, :64] += math.log(0.3 / 64 * 9936 / 0.7)  # the first 64 hold 30%
    want = torch.stack([torch.isfinite(reference_filter(row, 0, 0.5, 0.0)) for row in logits])
    got = torch.isfinite(filter_logits(logits, top_p=0.5))
    assert torch.equal(got, want)
    assert 1024 < got[0].sum() <= 8192 and 1024 < got[1].sum() <= 8192


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = SampleRow(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), None,
                    prompt_ids=[0], output_ids=[1, 1, 3])
    got = apply_penalties(logits.clone(), [row])[0]
    # repetition: seen (prompt or output) positive logits / 2, negative * 2; then -0.5 * count - 0.25 * (count > 0)
    want = torch.tensor([2.0 / 2, -1.0 * 2 - 0.5 * 2 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25, -2.0])
    assert torch.allclose(got, want)


def test_greedy_and_suppressed_tokens():
    rows = [SampleRow(SamplingParams(temperature=0), None, [], []),
            SampleRow(SamplingParams(temperature=0), None, [], [], suppressed=[0]),
            SampleRow(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), [], [], suppressed=[0, 1])]
    logits = torch.tensor([[5.0, 4.0, -30.0]] * 3)
    assert sample(logits, rows).tolist() == [0, 1, 2]


def test_allowed_ids_bad_words_and_logit_bias_by_hand():
    """vLLM's order, before penalties: outside allowed_token_ids and each bad word's last token (its other tokens
    ending the output) at -inf, then the bias added; then the repetition penalty acts on the biased logit."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    inf = float("-inf")

    def processed(output_ids=(), **params):
        return penalised(logits, [SampleRow(SamplingParams(**params), None, [0], list(output_ids))])[0].tolist()

    assert processed(allowed_token_ids=[1, 3]) == [inf, -1.0, inf, 3.0, inf, inf]
    words = [[3], [2, 5], [1, 2, 4]]
    assert processed([0, 2], bad_words_ids=words) == [2.0, -1.0, 0.5, inf, -2.0, inf]  # [2] ends the output: 5 out
    assert processed([2, 1], bad_words_ids=words) == [2.0, -1.0, 0.5, inf, -2.0, 1.0]  # [1, 2] does not end it
    assert processed([1, 2], bad_words_ids=words) == [2.0, -1.0, 0.5, inf, inf, inf]
    assert processed(logit_bias={0: -4.0, 4: 2.5}) == [-2.0, -1.0, 0.5, 3.0, 0.5, 1.0]
    assert processed(logit_bias={0: -4.0}, repetition_penalty=2.0) == [-4.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]  # a copy was changed
    rows = [SampleRow(SamplingParams(temperature=0, allowed_token_ids=[4]), None, [], []),
            SampleRow(SamplingParams(temperature=1.0, logit_bias={2: 100.0}), torch.Generator().manual_seed(0),
                      [], [])]
    assert sample(logits.repeat(2, 1), rows).tolist() == [4, 2]


@pytest.mark.parametrize("params,message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
    (dict(allowed_token_ids=[1, 99]), "allowed_token_ids holds 99, not a token id in [0, 6)"),
    (dict(logit_bias={7: 1.0}), "logit_bias holds token 7, not a token id in [0, 6)"),
    (dict(logit_bias={1: float("nan")}), "logit_bias[1] = nan must be a finite number"),
    (dict(bad_words=["ok", " "]), "bad_words must be a list of non-empty strings"),
    (dict(stop=["end", ""]), "stop = ['end', ''] holds an empty string"),
    (dict(stop=""), "stop = [''] holds an empty string"),
])
def test_restrictions_out_of_range_are_refused(params, message):
    with pytest.raises(ParamError) as e:
        SamplingParams(**params).validate(vocab_size=6)
    assert message in str(e.value) and e.value.param == next(iter(params))
    assert isinstance(e.value, MegapipeError)


def test_engine_restrictions_hold_with_and_without_speculation(tiny_engine_factory):
    """Through the engine, greedy: every token in allowed_token_ids; a bias of 100 on one token makes it every
    token; a bad word the unrestricted output holds is gone from it, and n-gram speculation (drafts verified with
    the bad words applied after each draft) gives the same output."""
    engine = tiny_engine_factory()
    tok = engine.tokenizer
    prompt = "The quick brown fox"
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    free = engine.generate([prompt], SamplingParams(**greedy))[0].outputs[0]
    allowed = sorted(set(free.token_ids[3:9]))
    got = engine.generate([prompt], SamplingParams(**greedy, allowed_token_ids=allowed))[0].outputs[0]
    assert set(got.token_ids) <= set(allowed) and got.token_ids != free.token_ids
    biased = engine.generate([prompt], SamplingParams(**greedy, logit_bias={allowed[0]: 100.0}))[0].outputs[0]
    assert biased.token_ids == [allowed[0]] * 24
    pairs = [free.token_ids[i:i + 2] for i in range(2, 20)]  # two output tokens whose text encodes back to them
    word_ids = next(ids for ids in pairs if tok.encode(tok.decode(ids).lstrip()) == ids)
    params = SamplingParams(**greedy, bad_words=[tok.decode(word_ids)])
    banned = engine.generate([prompt], params)[0].outputs[0]
    checked = engine.check_request(tok.encode(prompt), params)
    assert word_ids in checked.bad_words_ids and banned.token_ids != free.token_ids
    for ids in checked.bad_words_ids:
        assert not any(banned.token_ids[i:i + len(ids)] == list(ids) for i in range(len(banned.token_ids)))
    speculating = tiny_engine_factory(speculative_method="ngram", speculative_tokens=3, prompt_lookup_min=1)
    assert speculating.generate([prompt], params)[0].outputs[0].token_ids == banned.token_ids
    assert speculating.stats()["spec_decode_num_draft_tokens"] > 0


def test_engine_first_token_frequencies_follow_the_tempered_model(tiny_engine_factory):
    """End to end: 3000 samples of one token; frequencies of the likely tokens against a full forward's softmax(l/T)."""
    engine = tiny_engine_factory(max_num_seqs=256)
    prompt = [5, 17, 9, 33, 2]
    with torch.no_grad():
        logits = engine.runner.model(torch.tensor([prompt]), return_hidden=True)
        logits = engine.runner.logits(logits[0, -1])
    draws = 3000
    for temperature in (0.5, 2.0):
        out = engine.generate([prompt], SamplingParams(n=1, max_tokens=1, temperature=temperature, seed=1,
                                                       ignore_eos=True))
        outs = [engine.generate([prompt], SamplingParams(n=100, max_tokens=1, temperature=temperature,
                                                         seed=100 * k, ignore_eos=True))[0] for k in range(draws // 100)]
        ids = torch.tensor([o.token_ids[0] for r in outs for o in r.outputs])
        freq = torch.bincount(ids, minlength=logits.shape[-1]).double() / draws
        probs = (logits / temperature).softmax(-1).double()
        top = probs.topk(5).indices
        sigma = (probs[top] * (1 - probs[top]) / draws).sqrt()
        assert ((freq[top] - probs[top]).abs() <= 5 * sigma).all(), (temperature, freq[top], probs[top])
        assert len(out[0].outputs[0].token_ids) == 1


def test_greedy_ids_are_argmax_with_its_ties_and_nans():
    """``max``'s indices stand in for argmax on the greedy path: the first of equal maxima, and a NaN where a row has
    one (argmax's rules), in rows of a real vocabulary's width."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (64, 49152), generator=g).float()  # every row full of ties at its maximum
    logits[3, 17] = float("nan")
    logits[5, [40000, 9]] = float("nan")
    want = logits.argmax(dim=-1)
    assert torch.equal(greedy_ids(logits), want)
    assert want[3] == 17 and want[5] == 9 and want[0] == (logits[0] == logits[0].max()).nonzero()[0, 0]
    assert torch.equal(greedy_ids(logits.bfloat16()), logits.bfloat16().argmax(dim=-1))
