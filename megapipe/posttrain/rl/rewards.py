"""Reward functions: built-in (``accuracy``: the task's answer check, ``format``: --format-regex) or the user's
``package.module:function``, each with a weight (``--reward NAME=WEIGHT``, default 1), and a learned reward model
(``--reward-model RM_CKPT[=WEIGHT]``: megapipe.posttrain.reward_model, in this process, named ``reward_model``); a
completion's reward is the weighted sum. Every function is called once per rollout batch of this rank as

    f(prompts, completions, **fields) -> list[float]

with ``prompts`` the task's prompts (a string or chat messages, repeated for each of a group's completions),
``completions`` the completion texts and every other field of the prompt records as a list (``answer`` ...), all
of the same length; it returns one finite number per completion (TRL's signature, so its reward functions work).
A function that cannot be imported, raises, returns the wrong length or something that is not a finite number is
a RewardError naming it.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from dataclasses import dataclass
from typing import Callable

from megapipe.errors import ConfigError, MegapipeError

BUILTIN = ("accuracy", "format")


class RewardError(MegapipeError):
    """A reward function failed or returned something unusable; the message names it."""


@dataclass
class Reward:
    name: str  # "accuracy", "format" or "package.module:function"
    weight: float
    fn: Callable

    @property
    def label(self) -> str:
        """Its name in metrics: the built-in name, or the user function's own name."""
        return self.name.rsplit(":", 1)[-1]


def parse_spec(spec: str) -> tuple[str, float]:
    """'NAME' or 'NAME=WEIGHT' -> (NAME, WEIGHT)."""
    name, eq, weight = spec.partition("=")
    name = name.strip()
    if not eq:
        return name, 1.0
    try:
        value = float(weight)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise ConfigError(f"--reward {spec!r}: the weight {weight!r} is not a finite number")
    return name, value


def load_function(name: str) -> Callable:
    module, colon, attr = name.rpartition(":")
    if not colon or not module or not attr:
        raise ConfigError(f"--reward {name!r} is neither a built-in reward ({', '.join(BUILTIN)}) nor "
                          "package.module:function")
    try:
        mod = importlib.import_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the import raised, the user's module is at fault
        raise ConfigError(f"--reward {name}: cannot import {module} ({_failure(e)})") from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ConfigError(f"--reward {name}: module {module} ({getattr(mod, '__file__', '?')}) has no function "
                          f"{attr!r}")
    if not callable(fn):
        raise ConfigError(f"--reward {name}: {module}.{attr} is a {type(fn).__name__}, not a function")
    return fn


def format_reward(pattern: str) -> Callable:
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"rl.format_regex (--format-regex) {pattern!r} is not a valid regular expression: {e}") \
            from None

    def format(prompts, completions, **fields):  # noqa: A001 - the reward's name in metrics
        return [1.0 if regex.search(c) else 0.0 for c in completions]

    return format


def accuracy_reward(task) -> Callable:
    def accuracy(prompts, completions, **fields):
        keys = list(fields)
        return [task.accuracy(c, {k: fields[k][i] for k in keys}) for i, c in enumerate(completions)]

    return accuracy


def build_rewards(specs: list[str], task, format_regex: str) -> list[Reward]:
    """The reward functions of --reward (the task's default ones when none is given)."""
    specs = list(specs) or list(task.default_rewards)
    rewards, seen = [], set()
    for spec in specs:
        name, weight = parse_spec(spec)
        if name in seen:
            raise ConfigError(f"--reward {name} is given twice")
        seen.add(name)
        if name == "accuracy":
            fn = accuracy_reward(task)
        elif name == "format":
            fn = format_reward(format_regex)
        else:
            fn = load_function(name)
        rewards.append(Reward(name, weight, fn))
    labels = [r.label for r in rewards]
    for label in labels:
        if labels.count(label) > 1:
            raise ConfigError(f"--reward: two reward functions are named {label!r}; their metrics would collide")
    return rewards


REWARD_MODEL = "reward_model"  # --reward-model's name in metrics (reward/reward_model)


def reward_model_spec(spec: str):
    """'RM_CKPT' or 'RM_CKPT=WEIGHT' (--reward-model) -> (the checkpoint, its weight); a checkpoint that is not a
    reward model (posttrain rm) is a ConfigError."""
    from pathlib import Path

    from megapipe.checkpoint import read_manifest, resolve_checkpoint

    path, eq, weight = spec.rpartition("=")
    if not eq or not path:
        path, weight = spec, "1"
    try:
        value = float(weight)
    except ValueError:
        path, value = spec, 1.0  # a '=' inside the path
    if not math.isfinite(value):
        raise ConfigError(f"--reward-model {spec!r}: the weight {weight!r} is not a finite number")
    ckpt = resolve_checkpoint(Path(path).expanduser())
    labels = (read_manifest(ckpt).get("model") or {}).get("num_labels")
    if labels != 1:
        raise ConfigError(f"--reward-model {path}: {ckpt} is not a reward model (model.num_labels = {labels}): train "
                          "one with megapipe posttrain rm")
    return ckpt, value


def reward_model_reward(spec: str, device) -> Reward:
    """The reward model of --reward-model on ``device``, scoring each completion after its prompt."""
    from megapipe.posttrain.reward_model import RewardModel

    ckpt, weight = reward_model_spec(spec)
    return Reward(REWARD_MODEL, weight, RewardModel.load(ckpt, device))


def _value(reward: Reward, v, i: int) -> float:
    if isinstance(v, numbers.Real):
        x = float(v)
        if math.isfinite(x):
            return x
        raise RewardError(f"reward function {reward.name} returned {x} for completion {i}: rewards must be finite "
                          "numbers")
    raise RewardError(f"reward function {reward.name} returned {v!r} ({type(v).__name__}) for completion {i}, not a "
                      "number")


def score(rewards: list[Reward], prompts: list, completions: list[str], fields: dict[str, list]) -> list[list[float]]:
    """[completion][function] rewards (unweighted), each function called once on the whole list."""
    n = len(completions)
    columns = []
    for r in rewards:
        try:
            out = r.fn(list(prompts), list(completions), **{k: list(v) for k, v in fields.items()})
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's function failed (or exited): name it
            raise RewardError(f"reward function {r.name} {_failure(e)} (called with {n} completions)") from None
        if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # numpy arrays, tensors
            out = out.tolist()
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
            raise RewardError(f"reward function {r.name} returned {type(out).__name__}, not a list of {n} numbers")
        if len(out) != n:
            raise RewardError(f"reward function {r.name} returned {len(out)} values for {n} completions")
        columns.append([_value(r, v, i) for i, v in enumerate(out)])
    return [list(row) for row in zip(*columns, strict=True)] if columns else [[] for _ in range(n)]


def _failure(e: BaseException) -> str:
    """What user code did: 'raised ValueError: ...', or 'called sys.exit(0)' (an exit is a failure there too:
    nothing else may end a run, least of all with status 0)."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    return f"raised {type(e).__name__}: {e}"


def weighted(rewards: list[Reward], rows: list[list[float]]) -> list[float]:
    return [sum(r.weight * x for r, x in zip(rewards, row, strict=True)) for row in rows]
