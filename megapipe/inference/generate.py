"""Text generation: greedy or sampled (temperature, top-k, top-p) decoding with a KV cache, batched prompts.

Prompts of different lengths share one batch by left padding: the cache masks the pad slots and every row gets
its own positions, so a prompt's completion is the same as when it is generated alone. With a seed, each prompt
samples from its own generator seeded with that seed, for the same reason (equal prompts give equal completions).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megapipe.errors import MegapipeError
from megapipe.inference.kv_cache import KVCache


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the smallest set whose probability reaches top_p."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays (mass_before = 0)
        drop = (mass_before >= top_p).scatter(-1, order, mass_before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def pick_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
              generators: Sequence[torch.Generator]) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]; greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


def _check(prompts, max_new_tokens, temperature, top_k, top_p) -> None:
    if max_new_tokens < 0:
        raise MegapipeError(f"--max-new-tokens = {max_new_tokens} must be >= 0")
    if temperature < 0:
        raise MegapipeError(f"--temperature = {temperature} must be >= 0 (0 = greedy)")
    if top_k < 0:
        raise MegapipeError(f"--top-k = {top_k} must be >= 0 (0 = no limit)")
    if not 0 < top_p <= 1:
        raise MegapipeError(f"--top-p = {top_p} must be within (0, 1]")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise MegapipeError(f"prompt {i + 1} has no tokens")


def resolve_device(name: Optional[str]) -> torch.device:
    """``--device`` -> a torch.device that exists here (default: cuda when present, else cpu)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MegapipeError(f"--device {name!r} is not a device (use cpu, cuda or cuda:N)") from None
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise MegapipeError(f"--device {name!r}: no {device.type} device is available on this machine")
    count = backend.device_count() if device.type != "cpu" and hasattr(backend, "device_count") else None
    if device.index is not None and count is not None and device.index >= count:
        raise MegapipeError(f"--device {name!r}: this machine has {count} {device.type} device(s)")
    return device


def _generators(n: int, seed: Optional[int], device) -> list[torch.Generator]:
    gens = []
    for _ in range(n):
        g = torch.Generator(device=device)
        g.manual_seed(seed) if seed is not None else g.seed()
        gens.append(g)
    return gens


@torch.inference_mode()
def generate_ids(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, eos_ids: Sequence[int] = (),
                 stop: Optional[Callable[[int, list[int]], bool]] = None, use_cache: bool = True) -> list[list[int]]:
    """New token ids for each prompt (EOS excluded). ``stop(row, new_ids)`` may end a row early.

    ``use_cache=False`` recomputes the whole sequence at every step, one prompt at a time (the reference).
    """
    _check(prompts, max_new_tokens, temperature, top_k, top_p)
    if not use_cache and len(prompts) > 1:
        return [generate_ids(model, [p], max_new_tokens, temperature, top_k, top_p, seed, eos_ids,
                             (lambda _, ids, i=i: stop(i, ids)) if stop else None, use_cache=False)[0]
                for i, p in enumerate(prompts)]
    model.eval()
    device = next(model.parameters()).device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    longest = int(lengths.max())
    cfg = model.cfg
    if longest + max_new_tokens > cfg.max_position_embeddings:  # learned: no position; RoPE: never trained there
        raise MegapipeError(f"prompt ({longest} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the model's "
                            f"max_position_embeddings = {cfg.max_position_embeddings}")
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    real = torch.zeros_like(tokens, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p):] = torch.tensor(list(p), device=device)
        real[i, longest - len(p):] = True
    positions = (real.cumsum(dim=1) - 1).clamp(min=0)

    if use_cache:
        cache = KVCache.for_model(model, len(prompts), longest + max_new_tokens)
        cache.set_padding(real)
        logits = model(tokens, positions, cache, last_only=True)[:, -1]

        def step(nxt: torch.Tensor, t: int) -> torch.Tensor:
            return model(nxt[:, None], (lengths + t)[:, None], cache, last_only=True)[:, -1]
    else:
        seq = tokens

        def step(nxt: torch.Tensor, t: int) -> torch.Tensor:
            nonlocal seq
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            return model(seq)[:, -1]

        logits = model(seq)[:, -1]

    generators = _generators(len(prompts), seed, device) if temperature > 0 else []
    eos = set(eos_ids)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for t in range(max_new_tokens):
        nxt = pick_next(logits, temperature, top_k, top_p, generators)
        for i, tok in enumerate(nxt.tolist()):
            if done[i]:
                continue
            if tok in eos:
                done[i] = True
                continue
            out[i].append(tok)
            done[i] = stop is not None and stop(i, out[i])
        if all(done) or t == max_new_tokens - 1:
            break
        logits = step(nxt, t)
    return out


def _encode(tokenizer, text: str) -> list[int]:
    enc = tokenizer.encode(text)
    return list(enc.ids if hasattr(enc, "ids") else enc)


def _eos_ids(tokenizer) -> list[int]:
    for name in ("eod_id", "eos_token_id"):  # megapipe Tokenizer, transformers tokenizer
        value = getattr(tokenizer, name, None)
        if value is not None:
            return [value]
    return []


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stop if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
             stop: Optional[Sequence[str]] = None) -> list[str]:
    """Completions of ``prompts`` (without the prompt), ending at EOS, a stop string (excluded) or the limit."""
    if isinstance(stop, str):
        stop = [stop]
    stop = [s for s in (stop or []) if s]
    ids = [_encode(tokenizer, p) for p in prompts]

    def hit_stop(_row: int, new_ids: list[int]) -> bool:
        return _cut_at_stop(tokenizer.decode(new_ids), stop)[1]

    outs = generate_ids(model, ids, max_new_tokens, temperature, top_k, top_p, seed, _eos_ids(tokenizer),
                        hit_stop if stop else None)
    return [_cut_at_stop(tokenizer.decode(o), stop)[0] for o in outs]
