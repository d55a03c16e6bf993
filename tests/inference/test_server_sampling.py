"""The server's sampling options, sent through the official ``openai`` client, each against its definition:
presence / frequency penalties as OpenAI and vLLM write them (below), top_k, min_p and min_tokens through
transformers' own logits processors on the same model."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

from tests.inference.test_server import NAME

PROMPT = "The quick brown"


@pytest.fixture(scope="module")
def hf_tokenizer(hf_llama):
    return transformers.AutoTokenizer.from_pretrained(hf_llama[0])


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition (vLLM's too): over the tokens generated so far, with c[j] the count of token j,
    ``logits[j] -= frequency_penalty * c[j] + presence_penalty * (c[j] > 0)``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            counts = torch.bincount(ids[self.prompt_len:], minlength=scores.shape[-1])[: scores.shape[-1]]
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def hf_generate(hf, ids: list[int], max_new: int, **kw) -> list[int]:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=max_new, do_sample=False, pad_token_id=0, **{"eos_token_id": None} | kw)
    return out[0, len(ids):].tolist()


# cases where the greedy output repeats tokens, so that the two penalties differ (found by trying: on this random
# model, few do in 48 tokens)
PENALTY_CASES = [("A stitch in", 1.5, 0.0), ("The quick brown", -0.5, 0.0), ("The quick brown", -1.0, 0.6)]


@pytest.mark.parametrize("prompt,presence,frequency", PENALTY_CASES)
def test_presence_and_frequency_penalties(prompt, presence, frequency, live, hf_llama, hf_tokenizer):
    hf, c = hf_llama[1], live.client()
    ids = hf_tokenizer.encode(prompt)

    def reference(presence, frequency):
        processors = LogitsProcessorList([OpenAIPenalties(len(ids), presence, frequency)])
        return hf_tokenizer.decode(hf_generate(hf, ids, 48, logits_processor=processors), skip_special_tokens=True)

    want = reference(presence, frequency)
    # the case tells the two penalties apart (a swap would fail it) and the penalty changes the output
    assert want != reference(frequency, presence) and want != reference(0.0, 0.0)
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=48, temperature=0, presence_penalty=presence,
                             frequency_penalty=frequency, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want


def first_token_support(hf, ids: list[int], *warpers) -> set[int]:
    """The tokens transformers' warpers leave possible as the next token."""
    with torch.no_grad():
        scores = hf(torch.tensor([ids])).logits[:, -1].float()
    for warper in warpers:
        scores = warper(torch.tensor([ids]), scores)
    return set(torch.isfinite(scores[0]).nonzero()[:, 0].tolist())


@pytest.mark.parametrize("option", ["top_k", "min_p"])
def test_top_k_and_min_p_leave_exactly_the_tokens_transformers_does(option, live, hf_llama, hf_tokenizer):
    """128 seeded one-token samples of the first token: the tokens drawn are exactly those the definition leaves
    (each left token has probability >= 0.18 after renormalising, so every one is drawn)."""
    hf, c = hf_llama[1], live.client()
    ids = hf_tokenizer.encode(PROMPT)
    temperature, value = (1.0, 3) if option == "top_k" else (0.5, 0.5)  # min_p acts after the temperature
    warper = (transformers.TopKLogitsWarper(value) if option == "top_k" else transformers.MinPLogitsWarper(value))
    allowed = first_token_support(hf, ids, transformers.TemperatureLogitsWarper(temperature), warper)
    everything = first_token_support(hf, ids, transformers.TemperatureLogitsWarper(temperature))
    assert 2 <= len(allowed) < len(everything)
    if option == "min_p":  # the temperature matters: on the untempered distribution min_p would leave more tokens
        assert allowed != first_token_support(hf, ids, warper)
    texts = {hf_tokenizer.decode([t]) for t in allowed}
    assert len(texts) == len(allowed)
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=temperature, n=128, seed=7,
                             extra_body={option: value, "ignore_eos": True})
    assert {ch.text for ch in r.choices} == texts


@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_min_tokens_as_transformers_min_new_tokens(min_tokens, live, hf_llama, hf_tokenizer):
    """The stop token is the greedy first token: with min_tokens 0 it ends the completion at once (empty text), with
    k > 0 it is impossible for the first k tokens (transformers' MinNewTokensLengthLogitsProcessor)."""
    hf, c = hf_llama[1], live.client()
    ids = hf_tokenizer.encode(PROMPT)
    stop = hf_generate(hf, ids, 1)[0]
    want = hf_generate(hf, ids, 12, eos_token_id=stop, min_new_tokens=min_tokens)
    assert (want == [stop]) == (min_tokens == 0)
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                             extra_body={"min_tokens": min_tokens, "stop_token_ids": [stop], "ignore_eos": True})
    ch = r.choices[0]
    assert ch.text == hf_tokenizer.decode([t for t in want if t != stop], skip_special_tokens=True)
    assert r.usage.completion_tokens == len(want)
    assert ch.finish_reason == ("stop" if want[-1] == stop else "length")
