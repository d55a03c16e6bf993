"""``megapipe generate CKPT|HF_DIR --prompt P``: complete prompts with a checkpoint (greedy or sampled), on the engine."""

from __future__ import annotations

from typing import List, Optional

import typer

from megapipe.errors import MegapipeError
from stages.common import (
    PROMPT_LOOKUP_MAX,
    PROMPT_LOOKUP_MIN,
    SPECULATIVE_METHOD,
    SPECULATIVE_TOKENS,
    speculative_fields,
)


def generate(
    ckpt: str = typer.Argument(..., help="Checkpoint directory, run directory (its latest checkpoint) or HF model dir."),
    prompt: List[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for a batch of prompts."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Most tokens generated per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; higher = more random."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0 = all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample among the most likely tokens holding this mass."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (each prompt its own generator)."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (excluded from the output); repeat."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer; default: the checkpoint's own."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...; default: cuda if present."),
    bf16: bool = typer.Option(False, "--bf16", help="Run the model in bfloat16 (= --dtype bfloat16)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (as stored), float32, bfloat16 or float16."),
    image: Optional[List[str]] = typer.Option(None, "--image", help="Image file of a vision-language model: one per "
                                              "--prompt or one for all; it goes where the prompt writes <image>, "
                                              "else first."),
    json_output: bool = typer.Option(False, "--json", help="Print a JSON list of {prompt, completion}."),
    speculative_tokens: int = SPECULATIVE_TOKENS,
    speculative_method: Optional[str] = SPECULATIVE_METHOD,
    prompt_lookup_max: Optional[int] = PROMPT_LOOKUP_MAX,
    prompt_lookup_min: Optional[int] = PROMPT_LOOKUP_MIN,
) -> None:
    """Complete each --prompt with the model of CKPT and print the completions."""
    import json

    from megapipe.omp import prefer_bounded_spin

    prefer_bounded_spin()  # before torch loads OpenMP
    import torch

    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.load import eos_ids_of, load_model
    from megapipe.data.tokenizer import load_tokenizer
    from megapipe.dtypes import resolve_device, resolve_dtype
    from megapipe.inference import generate as run_generate
    from megapipe.inference.engine import EngineConfig
    from megapipe.models.capabilities import require

    speculative = speculative_fields(speculative_method, speculative_tokens, prompt_lookup_max, prompt_lookup_min)
    engine_config = EngineConfig(speculative_tokens=speculative_tokens, **speculative)
    engine_config.check()  # before the model loads
    if bf16 and dtype not in ("auto", "bfloat16", "bf16"):
        raise MegapipeError(f"--bf16 and --dtype {dtype} ask for two dtypes: give one")
    device = resolve_device(device)
    loaded = load_model(ckpt, device=device, dtype=torch.bfloat16 if bf16 else resolve_dtype(dtype))
    drafter = engine_config.drafter_feature
    require(loaded.model.cfg, "generate", str(ckpt), engine=[drafter] if drafter else None)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else loaded.tokenizer
    if tok is None:
        raise MegapipeError(f"checkpoint {ckpt} holds no tokenizer/: give one with --tokenizer")
    # the checkpoint's generation config ends a completion as the engine's from_pretrained does
    eos = eos_ids_of(loaded.generation_config.get("eos_token_id"), tok)
    completions = run_generate(loaded.model, tok, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop,
                               speculative_tokens, eos, image, speculative)
    if json_output:
        typer.echo(json.dumps([{"prompt": p, "completion": c} for p, c in zip(prompt, completions, strict=True)]))
        return
    for i, (p, c) in enumerate(zip(prompt, completions, strict=True)):
        if i:
            typer.echo("-" * 40)
        typer.echo(p + c)
