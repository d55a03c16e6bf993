"""Batch generation helpers over the engine (what ``megapipe generate`` and scripts call): one decoding path.

``generate_ids`` / ``generate`` build an :class:`LLMEngine` around a model already in memory, with a KV pool
exactly large enough for the batch, and run every prompt to completion. With a seed, each prompt samples from its
own generator seeded with it, so equal prompts give equal completions whatever the batch holds.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megapipe.checkpoint.load import eos_ids_of
from megapipe.errors import MegapipeError
from megapipe.inference.engine import EngineConfig, LLMEngine
from megapipe.inference.sampling import ParamError, SamplingParams


def _engine_for(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids,
                speculative_tokens: int = 0):
    limit = model.cfg.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise MegapipeError(f"prompt {i + 1} has no tokens")
        if len(p) + max_new_tokens > limit:  # learned: no position; RoPE: never trained there
            raise MegapipeError(f"prompt {i + 1} ({len(p)} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the "
                                f"model's max_position_embeddings = {limit}")
    bs = 16
    need = sum(-(-(len(p) + max_new_tokens) // bs) for p in prompts)
    config = EngineConfig(block_size=bs, num_blocks=max(need, -(-limit // bs)), max_num_seqs=max(1, len(prompts)),
                          max_num_batched_tokens=max(2048, max(len(p) for p in prompts)),
                          speculative_tokens=speculative_tokens)
    return LLMEngine(model, tokenizer, config, eos_token_ids=list(eos_ids))


def _params(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: Optional[int], stop=None):
    return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          stop=list(stop or []))


def _run(engine, prompts, params):
    """engine.generate with the CLI's flag names in parameter errors."""
    try:
        return engine.generate(prompts, params)
    except ParamError as e:
        flag = "--max-new-tokens" if e.param == "max_tokens" else "--" + e.param.replace("_", "-")
        raise MegapipeError(str(e).replace(e.param, flag, 1)) from None


def generate_ids(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 eos_ids: Sequence[int] = ()) -> list[list[int]]:
    """New token ids for each prompt (the EOS that ended one excluded)."""
    if max_new_tokens < 0:
        raise MegapipeError(f"--max-new-tokens = {max_new_tokens} must be >= 0")
    engine = _engine_for(model, None, prompts, max_new_tokens, eos_ids)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    outs = _run(engine, [list(p) for p in prompts], _params(max_new_tokens, temperature, top_k, top_p, seed))
    return [o.outputs[0].token_ids for o in outs]


def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
             stop: Optional[Sequence[str]] = None, speculative_tokens: int = 0,
             eos_ids: Optional[Sequence[int]] = None) -> list[str]:
    """Completions of ``prompts`` (without the prompt), ending at EOS, a stop string (excluded) or the limit;
    ``speculative_tokens``: drafts per step from the model's MTP modules (megapipe.inference.speculative);
    ``eos_ids``: the ids that end a completion (default: the tokenizer's end-of-document id)."""
    if isinstance(stop, str):
        stop = [stop]
    if max_new_tokens < 0:
        raise MegapipeError(f"--max-new-tokens = {max_new_tokens} must be >= 0")
    ids = [list(tokenizer.encode(p)) for p in prompts]
    eos = list(eos_ids) if eos_ids is not None else eos_ids_of(None, tokenizer)
    engine = _engine_for(model, tokenizer, ids, max_new_tokens, eos, speculative_tokens)
    if max_new_tokens == 0:
        return ["" for _ in prompts]
    outs = _run(engine, ids, _params(max_new_tokens, temperature, top_k, top_p, seed, stop))
    return [o.outputs[0].text for o in outs]
