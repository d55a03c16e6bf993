"""``megapipe generate CKPT --prompt P``: complete prompts with a checkpoint (greedy or sampled)."""

from __future__ import annotations

from typing import List, Optional

import typer

from stages.common import add_command

ORDER = 70


def generate(
    ckpt: str = typer.Argument(..., help="Checkpoint directory, or a run directory (its latest checkpoint)."),
    prompt: List[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for a batch of prompts."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Most tokens generated per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; higher = more random."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0 = all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample among the most likely tokens holding this mass."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (each prompt its own generator)."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (excluded from the output); repeat."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer; default: the checkpoint's own."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...; default: cuda if present."),
    bf16: bool = typer.Option(False, "--bf16", help="Run the model in bfloat16."),
    json_output: bool = typer.Option(False, "--json", help="Print a JSON list of {prompt, completion}."),
) -> None:
    """Complete each --prompt with the model of CKPT and print the completions."""
    import json

    import torch

    from megapipe.checkpoint import load_model_for_inference
    from megapipe.data.tokenizer import load_tokenizer
    from megapipe.errors import MegapipeError
    from megapipe.inference import generate as run_generate
    from megapipe.inference import resolve_device

    device = resolve_device(device)
    model, _, tokenizer_dir = load_model_for_inference(ckpt, device=device, dtype=torch.bfloat16 if bf16 else None)
    if tokenizer is None and tokenizer_dir is None:
        raise MegapipeError(f"checkpoint {ckpt} holds no tokenizer/: give one with --tokenizer")
    tok = load_tokenizer(tokenizer or tokenizer_dir)
    completions = run_generate(model, tok, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop)
    if json_output:
        typer.echo(json.dumps([{"prompt": p, "completion": c} for p, c in zip(prompt, completions, strict=True)]))
        return
    for i, (p, c) in enumerate(zip(prompt, completions, strict=True)):
        if i:
            typer.echo("-" * 40)
        typer.echo(p + c)


def register(app: typer.Typer) -> None:
    add_command(app, "generate", generate)
