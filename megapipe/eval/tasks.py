"""Which lm-eval tasks ``--tasks`` names: the ones shipped here, local YAML files or directories, lm-eval's registry.

Tasks from lm-eval's registry download their data from the Hugging Face hub; offline, use local task definitions:
an lm-eval YAML whose data is a local file (``dataset_path: json`` + ``dataset_kwargs.data_files``), given by path
(a YAML file, or a directory of them: every task in it) or by name with ``--include-path DIR``. Relative
``data_files`` resolve against the YAML's directory (lm-eval itself would take them from the working directory).
Every task is built (its data read) here, before any model is loaded, so a bad task fails fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from megapipe.errors import DataError, MegapipeError

SHIPPED_DIR = Path(__file__).parent / "tasks"
PERPLEXITY = "perplexity"  # built in: megapipe.eval.perplexity over --data-path
LOCAL_BUILDERS = ("json", "csv", "text", "parquet", "arrow")  # datasets' builders that read data_files
log = logging.getLogger(__name__)


def shipped_tasks() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.yaml"))}


@dataclass
class TaskSelection:
    lm_eval: list = field(default_factory=list)  # built lm-eval Task / Group objects, in the order asked
    perplexity: bool = False
    names: list[str] = field(default_factory=list)  # the leaf task names, for messages
    manager: object = None  # the TaskManager that built them (lm-eval's simple_evaluate would index its registry)
    images: list[str] = field(default_factory=list)  # the leaf tasks that show the model images (doc_to_image)


def _git_hash():
    """lm-eval's get_git_commit_hash (recorded in the results) without git's "fatal: not a git repository" on
    stderr when the working directory is not in one."""
    import subprocess

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def _bars_on_a_terminal_only():
    """tqdm bars (lm-eval's, megapipe's request bars) only when stderr is a terminal: in a log file (a pipeline
    step's) every bar would leave a line of carriage returns."""
    if sys.stderr.isatty():
        yield
        return
    from tqdm import std

    init = std.tqdm.__init__

    def without_bar(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "disable": True})

    with _patched(std.tqdm, "__init__", without_bar):
        yield


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval and datasets log every step at INFO/WARNING (and datasets draws a bar per split it reads); keep their
    errors only. lm-eval's own request bars stay on a terminal: they are the progress of the evaluation."""
    import lm_eval.evaluator
    from datasets.utils import logging as datasets_logging

    names = ("lm-eval", "lm_eval", "datasets", "evaluate", "absl")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    bars = datasets_logging.is_progress_bar_enabled()
    for lg in loggers:
        lg.setLevel(logging.ERROR)
        for h in lg.handlers:  # datasets binds sys.stderr once, at its first log; that stream may be closed since
            if isinstance(h, logging.StreamHandler) and getattr(h.stream, "closed", False):
                h.stream = sys.stderr  # not setStream: it flushes the closed stream first, which raises
    datasets_logging.disable_progress_bar()
    try:
        with _patched(lm_eval.evaluator, "get_git_commit_hash", _git_hash), _bars_on_a_terminal_only():
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()


def _resolve_data_files(cfg: dict, yaml_path: Path) -> dict:
    """``cfg`` with relative data_files made absolute against the YAML's directory; missing local files refused."""
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is None:
        if cfg.get("dataset_path") in LOCAL_BUILDERS:
            raise DataError(f"{yaml_path}: dataset_path: {cfg['dataset_path']} needs dataset_kwargs.data_files "
                            f"(the local file(s) to read)")
        return cfg

    def fix(value, where: str):
        if isinstance(value, (list, tuple)):
            return [fix(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if not isinstance(value, str):
            raise DataError(f"{yaml_path}: {where} = {value!r} is not a file path")
        if "://" in value:
            return value
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = yaml_path.parent / path
        if not any(c in value for c in "*?[") and not path.is_file():
            raise DataError(f"{yaml_path}: {where} = {value!r}: no such file {path}")
        return str(path)

    if isinstance(files, dict):
        kwargs["data_files"] = {k: fix(v, f"dataset_kwargs.data_files.{k}") for k, v in files.items()}
    else:
        kwargs["data_files"] = fix(files, "dataset_kwargs.data_files")
    return {**cfg, "dataset_kwargs": kwargs}


def _yaml_task(path: Path):
    """A YAML task file -> its config dict (includes and !function resolved, data_files fixed); a group/tag file ->
    its path (lm-eval builds those itself)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path, resolve_func=True)
    except Exception as e:  # yaml errors, a missing include or !function module
        raise DataError(f"task file {path} does not load: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        ) from None
    if isinstance(cfg.get("task"), str) and "group" not in cfg:
        return _resolve_data_files(cfg, path)
    if "task" not in cfg and "group" not in cfg:
        raise DataError(f"task file {path} has neither a 'task' nor a 'group' key: not an lm-eval task")
    return str(path)


def _looks_like_path(name: str) -> bool:
    return os.sep in name or name.endswith((".yaml", ".yml")) or name.startswith(".")


def _specs(names: Sequence[str], include_paths: Sequence[Path]):
    """``--tasks`` entries -> (lm-eval specs: config dicts or names, perplexity asked, the manager that knows them)."""
    from lm_eval.tasks import TaskManager

    shipped = shipped_tasks()
    manager = TaskManager(include_path=[str(SHIPPED_DIR), *map(str, include_paths)], include_defaults=False)
    specs, perplexity, unknown = [], False, []
    for name in names:
        path = Path(name).expanduser()
        if name == PERPLEXITY:
            perplexity = True
        elif path.is_dir():
            found = sorted(path.rglob("*.yaml")) + sorted(path.rglob("*.yml"))
            if not found:
                raise DataError(f"--tasks {name}: directory holds no task YAML files")
            specs.extend(_yaml_task(p) for p in found)
        elif path.is_file():
            specs.append(_yaml_task(path))
        elif _looks_like_path(name):
            raise DataError(f"--tasks {name}: no such task file or directory")
        elif name in shipped:
            specs.append(_yaml_task(shipped[name]))
        elif name in manager.task_index:
            entry = manager.task_index[name]
            specs.append(_yaml_task(entry.yaml_path) if entry.yaml_path and entry.kind.name == "TASK" else name)
        else:
            specs.append(name)
            unknown.append(name)
    if unknown:
        registry = TaskManager(include_path=[str(SHIPPED_DIR), *map(str, include_paths)])  # lm-eval's (slow)
        missing = [n for n in unknown if n not in registry.task_index]
        if missing:
            import difflib

            local = sorted(shipped) + [PERPLEXITY]
            extra = sorted(set(manager.all_tasks) - set(local))
            theirs = sorted(set(registry.all_tasks) - set(local) - set(extra))
            close = difflib.get_close_matches(missing[0], local + extra + theirs, n=3)
            raise MegapipeError(
                f"unknown task {missing[0]!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                + f": megapipe ships {', '.join(local)}"
                + (f"; --include-path adds {', '.join(extra[:10])}" if extra else "")
                + f"; lm-eval's registry has {len(theirs)} more (their data comes from the Hugging Face "
                "hub), or give a task YAML file or directory")
        manager = registry
    return specs, perplexity, manager, unknown


def _root_cause(e: BaseException) -> str:
    """The first line of what raised: datasets wraps its reader's error (a JSON parse error, row N) in a generic
    DatasetGenerationError, so that one's cause when it has one."""
    if type(e).__name__ == "DatasetGenerationError" and (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _top_level(loaded: dict) -> list:
    """The Task / Group objects to hand lm-eval: groups that are nobody's child, tasks in no group."""
    groups = loaded["groups"]
    children = {c for g in groups.values() for c in g.child_names}
    in_group = {t.task_name for g in groups.values() for t in g.get_all_tasks()}
    return [g for n, g in groups.items() if n not in children] + \
        [t for n, t in loaded["tasks"].items() if n not in in_group]


def select_tasks(names: Sequence[str], include_paths: Sequence[str | Path] = ()) -> TaskSelection:
    """Resolve and build the tasks named by ``--tasks`` (perplexity aside)."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise MegapipeError("--tasks names no task (e.g. --tasks megapipe_mc,megapipe_gen,perplexity)")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise MegapipeError(f"--tasks names {dupes[0]!r} twice")
    paths = []
    for p in include_paths:
        path = Path(p).expanduser()
        if not path.is_dir():
            raise DataError(f"--include-path {p}: no such directory")
        paths.append(path)
    with quiet_lm_eval():
        specs, perplexity, manager, from_registry = _specs(names, paths)
        selection = TaskSelection(perplexity=perplexity, manager=manager)
        if specs:
            try:
                loaded = manager.load(specs)
            except MegapipeError:
                raise
            except Exception as e:  # datasets / lm-eval: unreadable data, a bad template, no network for the hub
                what = "; ".join(s if isinstance(s, str) else s["task"] for s in specs)
                hint = (f" ({', '.join(from_registry)}: lm-eval registry task(s), whose data comes from the Hugging "
                        "Face hub or its cache; offline, give a local task YAML)") if from_registry else ""
                raise DataError(f"task(s) {what} could not be built: {_root_cause(e)}{hint}") from None
            selection.lm_eval = _top_level(loaded)
            selection.names = list(loaded["tasks"])
            selection.images = [n for n, t in loaded["tasks"].items() if getattr(t, "MULTIMODAL", False)]
    if perplexity:
        selection.names.append(PERPLEXITY)
    return selection

