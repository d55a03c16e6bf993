"""Pipeline files: parse, apply variables and ``--set`` overrides, validate every step against its command.

```yaml
name: tiny-cpu                      # optional; default: the file's stem
run_dir: runs/tiny-cpu              # optional; default: runs/<name>; --run-dir overrides
executor: local                     # optional default for --executor (local | slurm)
vars: {steps: 400}                  # ${vars.steps}; --set vars.steps=50
resources: {partition: gpu}         # defaults for every step's resources (Slurm; procs_per_node also locally)
env: {OMP_NUM_THREADS: "2"}         # environment of every step
steps:
  corpus:
    stage: data fetch               # a megapipe command
    options: {name: shakespeare}    # its parameters by name (or flag without dashes); or a YAML file by path
  pretrain:
    stage: pretrain
    options: {data_path: "${data.output}", train_iters: "${vars.steps}"}
    resources: {nodes: 2, gpus_per_node: 8}
    after: [other_step]             # ordering without a data reference
```

Every mistake is refused before anything runs, in one sentence that starts with ``file:line``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megapipe.config import parse_override
from megapipe.errors import ConfigError
from megapipe.fileio import refuse_overlap
from megapipe.pipeline.keys import strings_in
from megapipe.pipeline.refs import REF, STEP_ATTRS, refs_in, substitute, unescape, vars_lookup
from megapipe.pipeline.stages import LAUNCH_OPTIONS, Command, Output, is_argument, to_argv
from megapipe.pipeline.yamlpos import Loc, Located, load_located

TOP_KEYS = ("name", "description", "run_dir", "executor", "vars", "resources", "env", "steps")
STEP_KEYS = ("stage", "description", "options", "after", "resources", "env")
RESOURCES = {  # name -> type; Slurm reads them all, the local executor procs_per_node (and refuses nodes > 1)
    "nodes": int, "procs_per_node": int, "gpus_per_node": int, "cpus_per_task": int, "mem": str, "time": str,
    "partition": str, "account": str, "qos": str, "constraint": str, "sbatch": list,
}
EXECUTORS = ("local", "slurm")
STEP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
RESERVED = ("vars", "env")


@dataclass
class Step:
    name: str
    stage: str
    cmd: Command
    output: Output
    loc: Loc
    options: dict[str, Any]  # parameter name -> value; vars/env resolved, ${step.*} still symbolic
    option_locs: dict[str, Loc]
    resources: dict[str, Any]
    env: dict[str, str]
    after: list[str] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)  # referenced or `after` steps

    def resolved(self, lookup) -> dict[str, Any]:
        return unescape(substitute(self.options, lookup))


@dataclass
class Pipeline:
    file: Path
    name: str
    run_dir: Path
    executor: str
    steps: dict[str, Step]  # in file order
    order: list[str]  # a topological order (file order where the file allows)
    sets: list[str] = field(default_factory=list)  # the --set overrides it was loaded with

    def step_dir(self, name: str) -> Path:
        return self.run_dir / name

    def output_path(self, name: str) -> Path:
        return self.step_dir(name) / self.steps[name].output.name

    def reference(self, name: str, attr: str) -> str:
        if attr == "dir":
            return str(self.step_dir(name))
        step = self.steps[name]
        return step.output.reference_of(self.output_path(name), step.options)

    def lookup(self, ns: str, attr: str):
        return self.reference(ns, attr) if ns in self.steps else None

    def resolved_options(self, name: str) -> dict[str, Any]:
        """The options the command gets: references resolved, the output option set to the step's output."""
        step = self.steps[name]
        opts = step.resolved(self.lookup)
        if step.output.option is not None:
            opts[step.output.option] = str(self.output_path(name))
        return opts

    def downstream(self, names: set[str]) -> set[str]:
        out = set(names)
        for n in self.order:
            if any(u in out for u in self.steps[n].upstream):
                out.add(n)
        return out

    def upstream_closure(self, names: set[str]) -> set[str]:
        out = set(names)
        for n in reversed(self.order):
            if n in out:
                out.update(self.steps[n].upstream)
        return out


def load_pipeline(path: str | Path, commands: dict[str, Command], sets: Optional[list[str]] = None,
                  run_dir: Optional[str] = None) -> Pipeline:
    """The pipeline of ``path``, each step checked against the command it runs (``commands``: what a step may run,
    by path, as the CLI hands them over)."""
    doc = load_located(path)
    data = doc.value
    if not isinstance(data, dict):
        raise ConfigError(f"{doc.loc()}: a pipeline file is a mapping with a 'steps:' section")
    _check_keys(data, TOP_KEYS, doc, (), "top-level key")
    if not isinstance(data.get("steps"), dict) or not data["steps"]:
        raise ConfigError(f"{doc.loc('steps')}: 'steps:' must be a mapping of step names to steps")
    for key in ("vars", "resources", "env"):
        if not isinstance(data.setdefault(key, {}) or {}, dict):
            raise ConfigError(f"{doc.loc(key)}: '{key}:' must be a mapping")
        data[key] = data[key] or {}
    steps_raw = data["steps"]
    for name, raw in steps_raw.items():
        where = doc.loc("steps", name)
        if not STEP_NAME.match(name) or name in RESERVED:
            raise ConfigError(f"{where}: step name '{name}' must be letters, digits, '_' or '-' (not starting with a "
                              f"digit or '-', and not {' or '.join(RESERVED)})")
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: step '{name}' must be a mapping with 'stage:' and 'options:'")
        _check_keys(raw, STEP_KEYS, doc, ("steps", name), f"key of step '{name}'")
        for key in ("options", "resources", "env"):
            raw.setdefault(key, {})
            raw[key] = raw[key] if raw[key] is not None else {}
        raw["options"] = _options_file(raw["options"], doc, name, Path(path))
    _apply_sets(data, doc, sets or [])

    variables: dict[str, Any] = {}  # a variable may use ${env.*} and the variables above it
    lookup = vars_lookup(variables)

    def resolve_vars(value, loc: Loc):
        try:
            return substitute(value, lookup)
        except ConfigError as e:
            raise ConfigError(f"{loc}: {e}") from None

    for key, value in data["vars"].items():
        variables[key] = resolve_vars(value, doc.loc("vars", key))

    pipeline_name = str(data.get("name") or Path(path).stem)
    executor = str(data.get("executor") or "local")
    if executor not in EXECUTORS:
        raise ConfigError(f"{doc.loc('executor')}: executor '{executor}' is not one of {', '.join(EXECUTORS)}")
    rd = Path(run_dir or resolve_vars(data.get("run_dir") or f"runs/{pipeline_name}", doc.loc("run_dir")))
    defaults_res = _resources(resolve_vars(data["resources"], doc.loc("resources")), doc, ("resources",))
    defaults_env = _env(resolve_vars(data["env"], doc.loc("env")), doc, ("env",))

    steps: dict[str, Step] = {}
    for name, raw in steps_raw.items():
        base = ("steps", name)
        stage = raw.get("stage")
        if not isinstance(stage, str) or not stage.strip():
            raise ConfigError(f"{doc.loc(*base)}: step '{name}' has no 'stage:' (a megapipe command, e.g. pretrain)")
        stage = " ".join(stage.split())
        cmd = commands.get(stage)
        if cmd is None:
            raise ConfigError(f"{doc.loc(*base, 'stage')}: step '{name}': unknown stage '{stage}'"
                              f"{_suggest(stage, commands)} (stages: {', '.join(sorted(commands))})")
        output = cmd.output
        options, option_locs = {}, {}
        for key, value in raw["options"].items():
            loc = doc.loc(*base, "options", key)
            param, negated = cmd.param_for(key)
            if param is None:
                names = [p for p in cmd.params]
                raise ConfigError(f"{loc}: step '{name}' ({stage}): unknown option '{key}'{_suggest(key, names)} "
                                  f"(options: {', '.join(names)})")
            if param.name in options:
                raise ConfigError(f"{loc}: step '{name}': options '{key}' and an earlier key both set "
                                  f"'{param.name}'")
            _check_owned(stage, output, param.name, name, loc)
            value = resolve_vars(value, loc)
            if negated:
                if not isinstance(value, bool):
                    raise ConfigError(f"{loc}: step '{name}': '{key}' is a switch: give true or false")
                value = not value
            _check_shape(param, value, name, key, loc)
            options[param.name] = value
            option_locs[param.name] = loc
        after = raw.get("after") or []
        if isinstance(after, str):
            after = [after]
        if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
            raise ConfigError(f"{doc.loc(*base, 'after')}: step '{name}': 'after:' must be a list of step names")
        resources = {**defaults_res, **_resources(resolve_vars(raw["resources"], doc.loc(*base, "resources")),
                                                   doc, base + ("resources",))}
        env = {**defaults_env, **_env(resolve_vars(raw["env"], doc.loc(*base, "env")), doc, base + ("env",))}
        if not output.training:
            for key in ("nodes", "procs_per_node"):
                if resources.get(key, 1) > 1:
                    where = doc.loc(*base, "resources", key) if key in raw["resources"] else doc.loc("resources", key)
                    raise ConfigError(f"{where}: step '{name}' ({stage}): resources.{key} > 1 only applies to "
                                      "training stages, which start one process per GPU (this one runs once)")
        steps[name] = Step(name, stage, cmd, output, doc.loc(*base), options, option_locs, resources, env, after)

    _link(steps, doc)
    order = _topological(steps, doc)
    pipeline = Pipeline(Path(path), pipeline_name, rd, executor, steps, order, list(sets or []))
    for name in order:
        _check_command_line(pipeline, name)
        _check_output(pipeline, name)
    return pipeline


# ------------------------------------------------------------------------------------------------ helpers


def _check_keys(mapping: dict, allowed: tuple, doc: Located, base: tuple, what: str) -> None:
    for key in mapping:
        if key not in allowed:
            raise ConfigError(f"{doc.loc(*base, key)}: unknown {what} '{key}'{_suggest(key, allowed)} "
                              f"(allowed: {', '.join(allowed)})")


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _options_file(options: Any, doc: Located, name: str, pipeline_file: Path) -> dict:
    """``options: FILE.yaml`` (relative to the pipeline file): the step's options from that file, with its lines."""
    if isinstance(options, dict):
        return options
    if not isinstance(options, str):
        raise ConfigError(f"{doc.loc('steps', name, 'options')}: step '{name}': 'options:' must be a mapping or the "
                          "path of a YAML file holding one")
    path = Path(options)
    if not path.is_absolute():
        path = pipeline_file.parent / path
    if not path.is_file():
        raise ConfigError(f"{doc.loc('steps', name, 'options')}: step '{name}': options file {path} does not exist")
    sub = load_located(path)
    if sub.value is not None and not isinstance(sub.value, dict):
        raise ConfigError(f"{sub.loc()}: an options file must be a mapping of option names to values")
    for key_path, loc in sub.locs.items():  # its keys are located in their own file
        doc.locs[("steps", name, "options") + key_path] = loc
    return sub.value or {}


def _apply_sets(data: dict, doc: Located, sets: list[str]) -> None:
    """``--set vars.X=V``, ``--set resources.X=V``, ``--set STEP.OPTION=V``, ``--set STEP.resources.X=V``."""
    for item in sets:
        where = Loc(f"--set {item}", 0)
        key, value = parse_override(item)
        parts = key.split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"{where}: give STEP.OPTION=VALUE or vars.NAME=VALUE")
        head = parts[0]
        if head in ("vars", "resources", "env") and len(parts) == 2:
            data[head][parts[1]] = value
            doc.locs[(head, parts[1])] = where
            continue
        if head not in data["steps"]:
            raise ConfigError(f"{where}: no step '{head}' in {doc.file}{_suggest(head, data['steps'])} (steps: "
                              f"{', '.join(data['steps'])})")
        step = data["steps"][head]
        if len(parts) == 3 and parts[1] in ("resources", "env"):
            step[parts[1]][parts[2]] = value
            doc.locs[("steps", head, parts[1], parts[2])] = where
        elif len(parts) == 2:
            step["options"][parts[1]] = value
            doc.locs[("steps", head, "options", parts[1])] = where
        else:
            raise ConfigError(f"{where}: give STEP.OPTION=VALUE (or STEP.resources.KEY=VALUE)")


def _check_owned(stage: str, output: Output, param: str, step: str, loc: Loc) -> None:
    if param == output.option:
        raise ConfigError(f"{loc}: step '{step}' ({stage}): option '{param}' is set by the pipeline (the step's "
                          f"output, under the run directory; later steps use ${{{step}.output}}): remove it")
    if output.training and param in LAUNCH_OPTIONS:
        raise ConfigError(f"{loc}: step '{step}' ({stage}): option '{param}' is set by the executor: give "
                          "resources.procs_per_node (and resources.nodes on Slurm) instead")


def _check_shape(param, value, step: str, key: str, loc: Loc) -> None:
    many = getattr(param, "multiple", False) or (is_argument(param) and getattr(param, "nargs", 1) == -1)
    if isinstance(value, dict):
        raise ConfigError(f"{loc}: step '{step}': option '{key}' takes {'values' if many else 'a value'}, not a "
                          "mapping")
    if isinstance(value, list):
        if not many:
            raise ConfigError(f"{loc}: step '{step}': option '{key}' takes one value, not a list")
        if any(isinstance(v, (list, dict)) for v in value):
            raise ConfigError(f"{loc}: step '{step}': option '{key}' takes a list of plain values")
    if getattr(param, "is_flag", False) and value is not None and not isinstance(value, bool):
        raise ConfigError(f"{loc}: step '{step}': option '{key}' is a switch: give true or false, not {value!r}")


def _resources(raw: dict, doc: Located, base: tuple) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"{doc.loc(*base)}: 'resources:' must be a mapping")
    out = {}
    for key, value in raw.items():
        loc = doc.loc(*base, key)
        if key not in RESOURCES:
            raise ConfigError(f"{loc}: unknown resource '{key}'{_suggest(key, RESOURCES)} (resources: "
                              f"{', '.join(RESOURCES)})")
        kind = RESOURCES[key]
        if value is None:
            continue
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < (0 if key ==
                                                                                             "gpus_per_node" else 1)):
            raise ConfigError(f"{loc}: resource '{key}' must be an integer >= {0 if key == 'gpus_per_node' else 1}, "
                              f"got {value!r}")
        if kind is str:
            value = str(value)
        if kind is list and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{loc}: resource '{key}' must be a list of sbatch arguments (e.g. ['--exclusive'])")
        out[key] = value
    return out


def _env(raw: dict, doc: Located, base: tuple) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"{doc.loc(*base)}: 'env:' must be a mapping of variable names to values")
    for key, value in raw.items():
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{doc.loc(*base, key)}: env {key} must be a plain value")
    return {str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in raw.items()}


def _link(steps: dict[str, Step], doc: Located) -> None:
    """Each step's upstream: the steps it references (earlier in the file) and those in its `after:`."""
    index = {n: i for i, n in enumerate(steps)}
    for name, step in steps.items():
        ups: list[str] = []
        for key, value in step.options.items():
            loc = step.option_locs[key]
            try:
                found = refs_in(value)
            except ConfigError as e:
                raise ConfigError(f"{loc}: step '{name}': {e}") from None
            for ns, attr in found:
                if ns not in steps:
                    raise ConfigError(f"{loc}: step '{name}' refers to '${{{ns}.{attr}}}', but there is no step "
                                      f"'{ns}'{_suggest(ns, steps)} (steps: {', '.join(steps)})")
                if attr not in STEP_ATTRS:
                    raise ConfigError(f"{loc}: step '{name}': '${{{ns}.{attr}}}': a step has "
                                      f"{' and '.join(STEP_ATTRS)}, not '{attr}'")
                if ns == name:
                    raise ConfigError(f"{loc}: step '{name}' refers to its own {attr} (a cycle): a step cannot "
                                      "consume what it produces")
                if index[ns] > index[name]:
                    raise ConfigError(f"{loc}: step '{name}' refers to step '{ns}', which comes later (at "
                                      f"{steps[ns].loc}): move '{ns}' above '{name}'")
                if ns not in ups:
                    ups.append(ns)
        for a in step.after:
            if a not in steps:
                raise ConfigError(f"{doc.loc('steps', name, 'after')}: step '{name}' runs after '{a}', but there is "
                                  f"no step '{a}'{_suggest(a, steps)}")
            if a == name:
                raise ConfigError(f"{doc.loc('steps', name, 'after')}: step '{name}' cannot run after itself (a "
                                  "cycle)")
            if a not in ups:
                ups.append(a)
        step.upstream = sorted(ups, key=index.get)


def _topological(steps: dict[str, Step], doc: Located) -> list[str]:
    """Kahn's order, taking the earliest step in the file first; a cycle is reported with its path."""
    pending = {n: set(s.upstream) for n, s in steps.items()}
    order: list[str] = []
    while pending:
        ready = [n for n in steps if n in pending and not pending[n]]
        if not ready:
            cycle = _find_cycle(steps, set(pending))
            raise ConfigError(f"{doc.loc('steps', cycle[0], 'after')}: steps form a cycle: {' -> '.join(cycle)}")
        n = ready[0]
        order.append(n)
        del pending[n]
        for deps in pending.values():
            deps.discard(n)
    return order


def _find_cycle(steps: dict[str, Step], among: set[str]) -> list[str]:
    for start in steps:
        if start not in among:
            continue
        path, seen = [start], {start}
        node = start
        while True:
            nxt = next(u for u in steps[node].upstream if u in among)
            if nxt in seen:
                cycle = path[path.index(nxt):] + [nxt]
                return list(reversed(cycle))  # as "a -> b": a runs before b
            path.append(nxt)
            seen.add(nxt)
            node = nxt
    raise AssertionError("no cycle found among blocked steps")


def _check_output(pipeline: Pipeline, name: str) -> None:
    """A step's output may not be, contain or lie inside a path its options read (nor the pipeline file): the
    no-overlap rule of every writer (megapipe.fileio.refuse_overlap), before anything runs."""
    step = pipeline.steps[name]
    if step.output.option is None:
        return
    inputs = [pipeline.file, *(v for v in strings_in(step.options) if not REF.search(v) and _names_a_path(v))]

    def error(sentence: str) -> ConfigError:
        return ConfigError(f"{step.loc}: step '{name}' ({step.stage}): {sentence}")

    refuse_overlap([pipeline.output_path(name)], inputs, error)


def _names_a_path(value: str) -> bool:
    """``value`` names an existing file, directory or .bin/.idx PREFIX."""
    if not value or len(value) > 4096 or "\n" in value:
        return False
    return Path(value).exists() or Path(value + ".bin").is_file() or Path(value + ".idx").is_file()


def _check_command_line(pipeline: Pipeline, name: str) -> None:
    """Parse the step's resolved command line with the command's own parser: wrong types and values, bad choices
    and missing required options are refused with the option's line."""
    import typer

    step = pipeline.steps[name]
    argv = to_argv(step.cmd, pipeline.resolved_options(name))
    try:
        step.cmd.command.make_context(step.stage, argv[len(step.stage.split()):])
    except typer.exceptions.TyperException as e:
        param = getattr(e, "param", None)
        loc = step.option_locs.get(param.name, step.loc) if param is not None else step.loc
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        if type(e).__name__ == "MissingParameter" and param is not None:
            message = f"the required option '{param.name}' is not given"
        raise ConfigError(f"{loc}: step '{name}' ({step.stage}): {message.rstrip('.')}") from None
