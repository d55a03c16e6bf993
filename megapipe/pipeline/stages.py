"""The stages a pipeline step can run: megapipe's CLI commands, handed in by the CLI, and what each one produces.

A step's ``stage`` is a command path of the ``megapipe`` CLI (``pretrain``, ``export hf``, ...); its options are
that command's parameters, checked against the command's real typer/click parameters. What a stage *produces* is
declared next to its command in the CLI's command table (``COMMANDS``, in cli.py) as an ``Output``: which
parameter receives the output path, the name it gets under the step's directory, what kind of thing it is (how
completeness is judged) and what ``${step.output}`` hands to the steps downstream. The CLI gives the pipeline its
commands (``commands_of``); nothing here imports the CLI.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

# the launch flags every training stage takes (stages/pretrain.py); the pipeline sets them from `resources`
LAUNCH_OPTIONS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint")


@dataclass(frozen=True)
class Resume:
    """How an interrupted run of a training stage continues: ``option`` gets the step's own output (a run
    directory whose newest complete checkpoint is loaded); the options in ``clear`` are dropped for the resumed
    attempt (``finetune`` would load the weights only and start a new run). ``option`` None: the same command
    resumes its own run (post-training stages: ``--load BASE --save RUN`` continues RUN when it holds a checkpoint),
    so the step only keeps its output instead of starting afresh."""

    option: Optional[str] = None
    clear: tuple[str, ...] = ()


@dataclass(frozen=True)
class Output:
    """What a stage writes. ``option``: the parameter that receives the path (None: the output is the command's
    stdout, saved to ``name``). ``kind``: file | dir | prefix (PREFIX.bin/.idx) | run (a run directory of
    checkpoints) | checkpoint (one checkpoint directory) | stdout. ``reference``: what ``${step.output}`` is, from
    the output path and the step's options (default: the path itself)."""

    option: Optional[str]
    name: str
    kind: str
    reference: Optional[Callable[[Path, dict], str]] = None
    resume: Optional[Resume] = None
    training: bool = False  # takes LAUNCH_OPTIONS (torchrun/srun), writes metrics.jsonl in its output: plotted
    metrics: str = "metrics.jsonl"  # relative to the output (training stages)
    complete: Optional[str] = None  # dir outputs: the file that shows the output is whole (else: not empty)

    def reference_of(self, path: Path, options: dict) -> str:
        return self.reference(path, options) if self.reference else str(path)


KINDS = ("file", "dir", "prefix", "run", "checkpoint", "stdout")

DEFAULT_OUTPUT = Output(None, "stdout.txt", "stdout")  # a command that writes nothing else: its stdout


def output_complete(out: Output, reference: str) -> bool:
    """Whether what a step produced is all there (a step records 'done' only after its command succeeded; this
    catches outputs deleted since)."""
    p = Path(reference)
    if out.kind in ("file", "stdout"):
        return p.is_file()
    if out.kind == "dir":
        return p.is_dir() and (p / out.complete).is_file() if out.complete else p.is_dir() and any(p.iterdir())
    if out.kind == "prefix":
        return Path(reference + ".bin").is_file() and Path(reference + ".idx").is_file()
    # lazy: megapipe.checkpoint imports torch, and the CLI imports this module (megapipe --help stays fast)
    from megapipe.checkpoint import find_latest, is_complete

    if out.kind == "run":
        return p.is_dir() and find_latest(p) is not None
    return p.is_dir() and is_complete(p)


def latest_checkpoint_step(run_dir: Path) -> Optional[int]:
    """The step of the newest complete checkpoint in a run directory (None when there is none)."""
    # lazy: megapipe.checkpoint imports torch, and the CLI imports this module (megapipe --help stays fast)
    from megapipe.checkpoint import find_latest, read_manifest

    if not run_dir.is_dir():
        return None
    ckpt = find_latest(run_dir)
    if ckpt is None:
        return None
    try:
        return int(read_manifest(ckpt).get("step", 0))
    except Exception:  # a manifest that became unreadable: treat as no checkpoint
        return None


# ----------------------------------------------------------------------------------------- the CLI's commands


@dataclass
class Command:
    """A leaf command of the megapipe CLI as a step runs it: its click command, its parameters by name, and what it
    produces (``declared``: as the command table names options)."""

    path: str
    command: Any  # typer's click command
    declared: Output
    params: dict[str, Any] = field(default_factory=dict)

    def param_for(self, key: str):
        """The parameter an option key names: its Python name (train_iters), or one of its flags without the
        dashes (train-iters, tensor-model-parallel-size, no-compile). Returns (param, negated) or (None, False)."""
        name = key.lstrip("-").replace("-", "_")
        if name in self.params:
            return self.params[name], False
        flag = "--" + key.lstrip("-").replace("_", "-")
        for p in self.params.values():
            if flag in (getattr(p, "opts", None) or []):
                return p, False
            if flag in (getattr(p, "secondary_opts", None) or []):
                return p, True
        return None, False

    @functools.cached_property
    def output(self) -> Output:
        """The declared output, its option names resolved to the command's own parameter names (the table names
        options as a user does: a parameter name or a flag without dashes, e.g. 'save' for a config-generated
        --save)."""
        out = self.declared
        if out.option is None and out.resume is None:
            return out

        def real(key: str) -> str:
            param, _ = self.param_for(key)
            return param.name if param is not None else key

        resume = out.resume and Resume(real(out.resume.option) if out.resume.option else None,
                                       tuple(real(k) for k in out.resume.clear))
        return dataclasses.replace(out, option=real(out.option) if out.option else None, resume=resume)


def commands_of(cli, outputs: dict[str, Output]) -> dict[str, Command]:
    """The commands a step may run, by their space-separated path ('export hf'): each path of ``outputs`` looked up
    in ``cli`` (the CLI's click group), with the output it declares."""
    found: dict[str, Command] = {}
    for path, output in outputs.items():
        cmd = cli
        for word in path.split():
            cmd = cmd.get_command(None, word)
        found[path] = Command(path, cmd, output, {p.name: p for p in cmd.params if p.name != "help"})
    return found


def is_argument(param) -> bool:
    return getattr(param, "param_type_name", "") == "argument"


def to_argv(cmd: Command, options: dict[str, Any]) -> list[str]:
    """The command line (after ``megapipe``) for resolved option values keyed by parameter name: positional
    arguments first in their declared order, then the options in the order given. None means 'not given'."""
    stage_words = cmd.path.split()
    positional: list[str] = []
    for name, p in cmd.params.items():
        if is_argument(p) and options.get(name) is not None:
            value = options[name]
            positional += [_text(v) for v in value] if isinstance(value, list) else [_text(value)]
    flags: list[str] = []
    for name, value in options.items():
        p = cmd.params[name]
        if is_argument(p) or value is None:
            continue
        if getattr(p, "is_flag", False):
            secondary = getattr(p, "secondary_opts", None) or []
            if value is True:
                flags.append(p.opts[0])
            elif secondary:
                flags.append(secondary[0])
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            flags += [p.opts[0], _text(v)]
    return [*stage_words, *positional, *flags]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
