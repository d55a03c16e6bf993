"""The ``megapipe`` command: a typer root and ``COMMANDS``, the table of its sub-commands.

Each row names a command's function in ``stages/`` and, next to it, what the command produces as a pipeline step
(megapipe/pipeline/stages.py: ``Output``). Importing the stage modules stays cheap (heavy libraries are imported
inside the command functions), so ``megapipe --help`` is instant. The pipeline never imports this module: `pipeline
run|status` hand it ``step_commands()`` through the click context.
"""

from __future__ import annotations

import errno
import functools
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import typer

from megapipe import __version__
from megapipe.errors import MegapipeError
from megapipe.pipeline.stages import DEFAULT_OUTPUT, Command, Output, Resume, commands_of
from stages import (
    checkpoint,
    data,
    distill,
    dpo,
    export_trt,
    generate,
    hf,
    inspect_sft,
    pipeline,
    plan,
    plot,
    preprocess,
    pretrain,
    prune,
    quantize,
    rl,
    rm,
    serve,
    sft,
    smoke,
    tokenizer,
)
from stages import eval as evaluate
from stages.common import MegapipeCommand, multi_value_command
from stages.pretrain import training_command_class


@dataclass(frozen=True)
class Entry:
    """A row of the command table: the command's function, what it produces as a pipeline step (None: it cannot be
    a step) and its click command class (None: stages.common.MegapipeCommand)."""

    function: Callable
    output: Optional[Output] = DEFAULT_OUTPUT
    cls: Optional[type] = None


RUN = Output("save", "run", "run", resume=Resume(), training=True)  # post-training: --load BASE --save RUN resumes RUN
CHECKPOINT = Output("output", "checkpoint", "checkpoint")

# Every command, in --help order (top-level commands first, then the groups in the order they first appear).
COMMANDS: dict[str, Entry] = {
    "tokenizer train": Entry(tokenizer.train, Output("output", "tokenizer", "dir"), multi_value_command("--input")),
    "data fetch": Entry(data.fetch, Output("output", "corpus.jsonl", "file")),
    "data merge": Entry(data.merge, Output("output_prefix", "merged", "prefix"), multi_value_command("--input")),
    "data inspect": Entry(data.inspect),
    "data inspect-sft": Entry(inspect_sft.inspect_sft),
    "preprocess": Entry(preprocess.preprocess, Output("output_prefix", "data", "prefix",
                                                      reference=preprocess.first_dataset),
                        multi_value_command("--input", "--json-keys")),
    "plan": Entry(plan.plan),
    "pretrain": Entry(pretrain.pretrain, Output("save", "run", "run", resume=Resume("load", clear=("finetune",)),
                                                training=True), training_command_class(pretrain.pretrain)),
    "posttrain sft": Entry(sft.sft, RUN, training_command_class(sft.sft)),
    "posttrain projector": Entry(sft.projector, RUN, training_command_class(sft.projector)),
    "posttrain distill": Entry(distill.distill, RUN, training_command_class(distill.distill)),
    "posttrain dpo": Entry(dpo.dpo, RUN, training_command_class(dpo.dpo)),
    "posttrain rm": Entry(rm.rm, RUN, training_command_class(rm.rm)),
    "posttrain prune": Entry(prune.prune, CHECKPOINT, training_command_class(prune.prune)),
    "posttrain rl": Entry(rl.rl, RUN, training_command_class(rl.rl)),
    "posttrain quantize": Entry(quantize.quantize, CHECKPOINT),
    "generate": Entry(generate.generate, Output(None, "completions.txt", "stdout")),
    # megapipe eval CKPT --tasks ... --output DIR: DIR/results.json (lm-eval's results dict)
    "eval": Entry(evaluate.eval_command, Output("output", "eval", "dir", complete="results.json"),
                  multi_value_command("--data-path", "--include-path")),
    "serve": Entry(serve.serve, cls=multi_value_command("--lora-modules")),
    "serve-smoke": Entry(smoke.serve_smoke, Output("output", "smoke", "dir", complete="responses.json")),
    "checkpoint inspect": Entry(checkpoint.inspect),
    "checkpoint verify": Entry(checkpoint.verify),
    "checkpoint convert": Entry(checkpoint.convert),
    "import hf": Entry(hf.import_hf_command, Output("out_ckpt", "checkpoint", "checkpoint")),
    "export hf": Entry(hf.export_hf_command, Output("out_dir", "hf", "dir")),
    "export trt": Entry(export_trt.export_trt_command, Output("out_dir", "trt", "dir")),
    "pipeline run": Entry(pipeline.run, output=None),  # a pipeline does not run pipelines
    "pipeline status": Entry(pipeline.status, output=None),
    "plot": Entry(plot.plot, Output("output", "plots", "dir")),
}

GROUP_HELP = {
    "data": "Fetch corpora; merge and inspect .bin/.idx datasets.",
    "tokenizer": "Train tokenizers.",
    "checkpoint": "Inspect, verify and convert megapipe checkpoints.",
    "import": "Bring a model from another format into a megapipe checkpoint.",
    "export": "Write a megapipe checkpoint in another format.",
    "posttrain": "Post-train a checkpoint: sft, projector, distill, dpo, rm, prune, quantize, rl.",
    "pipeline": "Run YAML pipelines of stages (cached, resumable; local or Slurm).",
}

app = typer.Typer(
    name="megapipe",
    help="Train and ship language models: preprocess -> pretrain -> post-train -> export -> serve.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"megapipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """megapipe: raw JSONL to a served model; every stage shares one checkpoint format."""
    ctx.obj = step_commands  # what `pipeline run|status` check their steps against


def group(parent: typer.Typer, name: str) -> typer.Typer:
    """The sub-command group ``name`` of ``parent``, created on first use (so several commands can share it)."""
    for info in parent.registered_groups:
        if info.name == name:
            return info.typer_instance
    sub = typer.Typer(help=GROUP_HELP.get(name), no_args_is_help=True)
    parent.add_typer(sub, name=name)
    return sub


def add_command(parent: typer.Typer, path: str, fn, cls=None) -> None:
    """``add_command(app, "export hf", fn)`` puts ``fn`` under the group ``export``, ``add_command(app, "plan", fn)``
    at the top."""
    *groups, name = path.split()
    target = parent
    for g in groups:
        target = group(target, g)
    target.command(name, cls=cls or MegapipeCommand)(fn)


for _path, _entry in COMMANDS.items():
    add_command(app, _path, _entry.function, _entry.cls)


@functools.cache
def step_commands() -> dict[str, Command]:
    """The commands a pipeline step may run, by path, each with what it produces."""
    return commands_of(typer.main.get_command(app), {path: e.output for path, e in COMMANDS.items() if e.output})


# OS errors that are the machine's state, not a bug: shown as one sentence naming the file (exit 1).
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def check_argv_utf8(argv: list[str]) -> None:
    """Arguments that are not valid UTF-8 reach Python as lone surrogates (PEP 383); refuse them by position."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            raw = arg.encode("utf-8", "surrogateescape")
            offset = len(arg[: e.start].encode("utf-8", "surrogateescape"))
            if arg.startswith("--") and "=" in arg:
                name, value = arg.split("=", 1)
                what, offset = f"the value of {name}", offset - len(name) - 1
                raw = value.encode("utf-8", "surrogateescape")
            elif i > 0 and argv[i - 1].startswith("-"):
                what = f"the argument after {argv[i - 1]}"
            else:
                what = f"argument {i + 1}"
            shown = raw.decode("utf-8", "backslashreplace")
            raise MegapipeError(f"{what} ('{shown}') is not valid UTF-8: byte 0x{raw[offset]:02x} at offset {offset}; "
                                "command-line text must be UTF-8") from None


def _print_error(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: user mistakes become one red sentence on stderr and a non-zero exit, never a traceback."""
    try:
        check_argv_utf8(sys.argv[1:] if argv is None else list(argv))
        app(args=argv, prog_name="megapipe")
    except SystemExit as e:  # click's standalone mode: usage errors (exit 2), --help, Ctrl-C (130), completion
        if e.code == 130:
            print("megapipe: interrupted", file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except MegapipeError as e:
        _print_error(str(e))
        return e.exit_code
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        _print_error(f"{where}{e.strerror or e} (a file-system error; nothing half-written is kept)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
