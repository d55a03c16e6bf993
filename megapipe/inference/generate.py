"""Batch generation helpers over the engine (what ``megapipe generate`` and scripts call): one decoding path.

``generate_ids`` / ``generate`` build an :class:`LLMEngine` around a model already in memory, with a KV pool
exactly large enough for the batch, and run every prompt to completion. With a seed, each prompt samples from its
own generator seeded with it, so equal prompts give equal completions whatever the batch holds.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megapipe.checkpoint.load import eos_ids_of
from megapipe.errors import MegapipeError
from megapipe.inference.engine import EngineConfig, LLMEngine, plain_attention
from megapipe.inference.sampling import ParamError, SamplingParams


def _engine_for(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids,
                speculative_tokens: int = 0, speculative: Optional[dict] = None):
    limit = model.cfg.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise MegapipeError(f"prompt {i + 1} has no tokens")
        if len(p) + max_new_tokens > limit:  # learned: no position; RoPE: never trained there
            raise MegapipeError(f"prompt {i + 1} ({len(p)} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the "
                                f"model's max_position_embeddings = {limit}")
    bs = EngineConfig().kv_block_size(next(model.parameters()).device, plain_attention(model))
    need = sum(-(-(len(p) + max_new_tokens) // bs) for p in prompts)
    config = EngineConfig(block_size=bs, num_blocks=max(need, -(-limit // bs)), max_num_seqs=max(1, len(prompts)),
                          max_num_batched_tokens=max(2048, max(len(p) for p in prompts)),
                          speculative_tokens=speculative_tokens, **(speculative or {}))
    return LLMEngine(model, tokenizer, config, eos_token_ids=list(eos_ids))


def _params(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: Optional[int], stop=None):
    return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          stop=list(stop or []))


def _run(engine, prompts, params, images=None):
    """engine.generate with the CLI's flag names in parameter errors."""
    try:
        return engine.generate(prompts, params, images=images)
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
             eos_ids: Optional[Sequence[int]] = None, images: Optional[Sequence[str]] = None,
             speculative: Optional[dict] = None) -> list[str]:
    """Completions of ``prompts`` (without the prompt), ending at EOS, a stop string (excluded) or the limit;
    ``speculative_tokens``: drafts per step (megapipe.inference.speculative), by the drafter ``speculative`` names
    (EngineConfig's speculative_method, prompt_lookup_max, prompt_lookup_min; default: the model's MTP modules);
    ``eos_ids``: the ids that end a completion (default: the tokenizer's end-of-document id); ``images``: image
    files of a vision-language model, one per prompt or one for all (``with_images``)."""
    if isinstance(stop, str):
        stop = [stop]
    if max_new_tokens < 0:
        raise MegapipeError(f"--max-new-tokens = {max_new_tokens} must be >= 0")
    ids = [list(tokenizer.encode(p)) for p in prompts]
    pixels = None
    if images:
        ids, pixels = with_images(model, tokenizer, prompts, images)
    eos = list(eos_ids) if eos_ids is not None else eos_ids_of(None, tokenizer)
    engine = _engine_for(model, tokenizer, ids, max_new_tokens, eos, speculative_tokens, speculative)
    if max_new_tokens == 0:
        return ["" for _ in prompts]
    outs = _run(engine, ids, _params(max_new_tokens, temperature, top_k, top_p, seed, stop), pixels)
    return [o.outputs[0].text for o in outs]


def with_images(model, tokenizer, prompts: Sequence[str], images: Sequence[str]) -> tuple[list, list]:
    """The prompts' tokens and images: image i goes where prompt i writes ``<image>`` (else before its text), its
    placeholder repeated for its patches; one image serves every prompt."""
    from megapipe.data.images import ImageError, ImageProcessor, image_markers, open_image, prompt_with_images

    markers = image_markers(model.cfg, tokenizer)
    if markers is None:
        raise MegapipeError("--image needs a vision-language model with a tokenizer; this model takes text only")
    if len(images) not in (1, len(prompts)):
        raise MegapipeError(f"{len(images)} --image for {len(prompts)} --prompt: give one per prompt or one for all")
    processor = ImageProcessor.from_dir(tokenizer.path)
    ids, pixels = [], []
    for prompt, path in zip(prompts, list(images) * len(prompts) if len(images) == 1 else images, strict=True):
        try:
            one, values = prompt_with_images(prompt, [open_image(path, allow_files=True)], markers, tokenizer,
                                             processor, model.cfg.image_token_id)
        except ImageError as e:
            raise MegapipeError(f"--image {path}: {e}") from None
        ids.append(one)
        pixels.append(values)
    return ids, pixels
