"""``megapipe serve-smoke MODEL --output DIR``: start ``megapipe serve`` on MODEL, ask it one completion and one chat
completion through the official OpenAI client, write the answers, stop it with SIGTERM (a pipeline step)."""

from __future__ import annotations

from typing import List, Optional

import typer

from stages.common import print_table


def serve_smoke(
    model: str = typer.Argument(..., help="Checkpoint, run directory or Hugging Face model dir to serve."),
    output: str = typer.Option(..., "--output", "-o", help="Directory for responses.json, sample.txt, server.log."),
    prompt: str = typer.Option("Once upon a time", "--prompt", help="Text of the completion request."),
    chat: Optional[str] = typer.Option("Hello!", "--chat", help="User message of the chat request ('' : none)."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Most tokens of each answer (greedy)."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string of both requests (may be a special "
                                                                  "token, e.g. <|im_end|>); repeatable."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="serve --dtype."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="serve --max-model-len."),
    threads: Optional[int] = typer.Option(None, "--threads", help="serve --threads."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="serve --kv-cache-memory."),
    ready_timeout: float = typer.Option(300.0, "--ready-timeout", help="Seconds the server gets to load."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output if it exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors."),
) -> None:
    """Smoke-test `megapipe serve` on MODEL through the OpenAI client: a completion, a chat completion, SIGTERM."""
    # lazy: not loaded by megapipe --help, which stays fast
    from megapipe.pipeline.serve_smoke import serve_smoke as run

    args = []
    for flag, value in (("--dtype", dtype), ("--max-model-len", max_model_len), ("--threads", threads),
                        ("--kv-cache-memory", kv_cache_memory)):
        if value is not None:
            args += [flag, str(value)]
    record = run(model, output, prompt, chat or None, max_tokens, stop, args, ready_timeout, overwrite=overwrite,
                 echo=None if quiet else typer.echo)
    if quiet:
        return

    rows = [("output", output), ("server ready", f"{record['ready_seconds']:.1f} s"),
            ("completion", record["completion"]["prompt"] + record["completion"]["response"]["choices"][0]["text"])]
    if "chat" in record:
        rows.append(("chat", record["chat"]["response"]["choices"][0]["message"]["content"]))
    rows.append(("shutdown", f"SIGTERM, exit {record['shutdown']['exit_status']}"))
    print_table("serve-smoke", rows)
