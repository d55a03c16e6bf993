"""``megapipe eval CKPT|HF_DIR --tasks T1,T2``: lm-evaluation-harness tasks and perplexity on the inference engine."""

from __future__ import annotations

from typing import List, Optional

import typer


def eval_command(
    ckpt: str = typer.Argument(..., help="Checkpoint directory, run directory (its latest checkpoint) or HF model dir."),
    tasks: List[str] = typer.Option(
        ..., "--tasks", "-t", help="Comma-separated: megapipe_mc, megapipe_gen, megapipe_text, megapipe_shapes (images) "
        "(shipped, offline), perplexity (on --data-path), a task YAML file or directory, or an lm-eval registry task (hub data)."),
    data_path: Optional[List[str]] = typer.Option(
        None, "--data-path", help="The perplexity task's data: a .bin/.idx PREFIX; repeat or list several."),
    include_path: Optional[List[str]] = typer.Option(
        None, "--include-path", help="Directory of lm-eval task YAMLs whose names --tasks may use; repeatable."),
    limit: Optional[str] = typer.Option(
        None, "--limit", help="Documents per task (an integer), or a fraction < 1 of each; perplexity: windows."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples (default: the task's)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Requests handed to the engine at a time."),
    output: Optional[str] = typer.Option(
        None, "--output", "-o", help="Directory for results.json (default: eval_<CKPT name> next to CKPT)."),
    seq_length: Optional[int] = typer.Option(
        None, "--seq-length", help="Perplexity window (default: the engine's max_model_len - 2)."),
    max_length: Optional[int] = typer.Option(
        None, "--max-length", help="lm-eval's context window (default: the engine's max_model_len - 2)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (as stored), float32, bfloat16 or float16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...; default: cuda if present."),
    bootstrap_iters: int = typer.Option(1000, "--bootstrap-iters", help="Bootstrap resamples for stderrs (0: none)."),
    log_samples: bool = typer.Option(False, "--log-samples", help="Also write samples_<task>.jsonl per task."),
    allow_tokenizer_mismatch: bool = typer.Option(
        False, "--allow-tokenizer-mismatch", help="Score --data-path made with another tokenizer anyway."),
    seed: int = typer.Option(1234, "--seed", help="Seed of lm-eval's few-shot sampling and of sampled generation."),
    json_output: bool = typer.Option(False, "--json", help="Print the results dict as JSON instead of the tables."),
) -> None:
    """Evaluate a checkpoint with EleutherAI's lm-evaluation-harness, on megapipe's engine; writes OUTPUT/results.json."""
    import json

    # lazy: imports torch; megapipe --help stays fast
    from megapipe.eval.run import format_tables, run_eval

    results, out_dir = run_eval(
        ckpt, tasks, data_paths=data_path or [], include_paths=include_path or [], limit=limit,
        num_fewshot=num_fewshot, batch_size=batch_size, output=output, seq_length=seq_length, max_length=max_length,
        dtype=dtype, device=device, bootstrap_iters=bootstrap_iters, log_samples=log_samples,
        allow_tokenizer_mismatch=allow_tokenizer_mismatch, seed=seed)
    if json_output:
        typer.echo(json.dumps(results["results"], indent=2))
        return
    typer.echo(format_tables(results))
    typer.echo(f"results: {out_dir / 'results.json'}")
