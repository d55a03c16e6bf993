"""Where RL prompts come from, and how a completion's answer is checked.

A task is an endless, deterministic stream of prompts: prompt number i depends only on i and the run's seed, so a
resumed run (or any data-parallel layout) sees exactly the prompts the uninterrupted run saw.

- ``arithmetic``: generated problems "What is a + b?" (operands within [0, --arithmetic-max], operators from
  --arithmetic-ops), reference answer the exact result;
- ``format``: the same prompts, rewarded only for matching --format-regex (the ``format`` reward);
- ``jsonl:FILE``: one JSON object per line with a prompt field (a string, or a list of chat messages) and an answer
  field (string or number); read in a seeded random order, reshuffled every epoch.

Answers: the completion's answer is the last match of --answer-regex (its first group when it has one); without
it, the last number in the completion for numeric matching, the whole stripped completion for exact matching.
Numeric answers match when they are equal to 1e-6 relative; exact ones when the strings are equal.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megapipe.data.readers import JSONRecordError, load_json_record
from megapipe.errors import ConfigError, DataError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass
class Prompt:
    index: int  # position in the task's stream
    prompt: Any  # the user's prompt as the task holds it: a string or a list of chat messages
    fields: dict = field(default_factory=dict)  # the record's other fields (answer, ...), for reward functions
    where: str = ""  # for error messages: FILE:LINE or "arithmetic prompt #i"


def parse_number(text: str) -> Optional[float]:
    try:
        value = float(text.replace(",", "").strip().rstrip("."))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class AnswerChecker:
    def __init__(self, match: str, regex: Optional[str]):
        self.match = match
        try:
            self.regex = re.compile(regex) if regex else None
        except re.error as e:
            raise ConfigError(f"rl.answer_regex (--answer-regex) {regex!r} is not a valid regular expression: {e}") \
                from None

    def extract(self, completion: str) -> Optional[str]:
        if self.regex is not None:
            found = list(self.regex.finditer(completion))
            if not found:
                return None
            m = found[-1]
            return (m.group(1) if m.re.groups and m.group(1) is not None else m.group(0)).strip()
        if self.match == "numeric":
            nums = NUMBER.findall(completion)
            return nums[-1] if nums else None
        return completion.strip()

    def correct(self, completion: str, answer: Any) -> bool:
        got = self.extract(completion)
        if got is None:
            return False
        if self.match == "numeric":
            a, b = parse_number(got), parse_number(str(answer))
            return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(b))
        return got == str(answer).strip()


class Task:
    name = "task"
    default_rewards = ("accuracy",)

    def __init__(self, checker: AnswerChecker):
        self.checker = checker

    def prompt(self, index: int) -> Prompt:
        raise NotImplementedError

    def accuracy(self, completion: str, fields: dict) -> float:
        return 1.0 if self.checker.correct(completion, fields["answer"]) else 0.0

    def describe(self) -> str:
        return self.name


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(self, seed: int, max_operand: int, ops: str, checker: AnswerChecker):
        super().__init__(checker)
        self.seed, self.max_operand, self.ops = seed, max_operand, ops

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{index}")
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = self.ops[rng.randrange(len(self.ops))]
        text = f"What is {a} {op} {b}? Reply with only the number."
        return Prompt(index, text, {"answer": str(OPS[op](a, b))}, f"arithmetic prompt #{index}")

    def describe(self) -> str:
        return f"{self.name} (operands 0..{self.max_operand}, {' '.join(self.ops)})"


class FormatTask(ArithmeticTask):
    name = "format"
    default_rewards = ("format",)


class JsonlTask(Task):
    name = "jsonl"

    def __init__(self, path: str, seed: int, prompt_field: str, answer_field: str, checker: AnswerChecker):
        super().__init__(checker)
        self.path, self.seed = Path(path), seed
        self.records = read_records(self.path, prompt_field, answer_field)
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.records)))
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a run reads
        return self._orders[epoch]

    def prompt(self, index: int) -> Prompt:
        n = len(self.records)
        line, record = self.records[self._order(index // n)[index % n]]
        fields = {k: v for k, v in record.items() if k != self.prompt_field}
        fields["answer"] = record[self.answer_field]
        return Prompt(index, record[self.prompt_field], fields, f"{self.path}:{line}")

    def describe(self) -> str:
        return f"jsonl:{self.path} ({len(self.records)} prompts)"


def read_records(path: Path, prompt_field: str, answer_field: str) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line; a malformed one is an error naming FILE:LINE."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"--task jsonl:{path}: the file does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--task jsonl:{path}: cannot read it ({e})") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = load_json_record(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except JSONRecordError as e:
            raise DataError(f"{where}: the record {e}") from None
        if not isinstance(rec, dict):
            raise DataError(f"{where}: a record must be a JSON object, not {type(rec).__name__}")
        prompt = rec.get(prompt_field)
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and
                                     isinstance(m.get("role"), str) for m in prompt):
                raise DataError(f"{where}: the prompt field {prompt_field!r} holds a list that is not chat messages "
                                "({'role': ..., 'content': ...})")
        elif not isinstance(prompt, str) or not prompt:
            raise DataError(f"{where}: the record has no prompt field {prompt_field!r} (a non-empty string or chat "
                            "messages); set --prompt-field")
        answer = rec.get(answer_field)
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DataError(f"{where}: the record has no answer field {answer_field!r} (a string or number); set "
                            "--answer-field")
        records.append((n, rec))
    if not records:
        raise DataError(f"--task jsonl:{path}: the file holds no records")
    return records


def build_task(rl, seed: int) -> Task:
    """The task named by rl.task (--task)."""
    name = rl.task
    if not name:
        raise ConfigError("rl.task (--task) is not set: give arithmetic, format or jsonl:FILE")
    if name in ("arithmetic", "format"):
        checker = AnswerChecker("numeric", rl.answer_regex)
        cls = ArithmeticTask if name == "arithmetic" else FormatTask
        return cls(seed, rl.arithmetic_max, rl.arithmetic_ops, checker)
    if name.startswith("jsonl:") and len(name) > len("jsonl:"):
        return JsonlTask(name[len("jsonl:"):], seed, rl.prompt_field, rl.answer_field,
                         AnswerChecker(rl.answer_match, rl.answer_regex))
    raise ConfigError(f"rl.task (--task) = {name!r} is not a task: give arithmetic, format or jsonl:FILE")
