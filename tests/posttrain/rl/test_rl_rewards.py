"""Rewards and tasks: built-in rewards, user functions with weights, every reward error (one sentence naming the
function), the tasks' prompts and answer checks, and malformed jsonl tasks named by FILE:LINE."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.config import RLConfig
from megapipe.errors import ConfigError, DataError
from megapipe.posttrain.rl.rewards import RewardError, build_rewards, score, weighted
from megapipe.posttrain.rl.tasks import AnswerChecker, build_task

ROOT = Path(__file__).resolve().parents[3]

USER_MODULE = '''
import math

def brevity(prompts, completions, **fields):
    return [1.0 / (1 + len(c)) for c in completions]

def echo_answer(prompts, completions, answer, **fields):
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

def raises(prompts, completions, **fields):
    raise ValueError("no scores today")

def short(prompts, completions, **fields):
    return [1.0] * (len(completions) - 1)

def words(prompts, completions, **fields):
    return ["high"] * len(completions)

def nan(prompts, completions, **fields):
    return [math.nan] * len(completions)

def scalar(prompts, completions, **fields):
    return 1.0

def exits(prompts, completions, **fields):
    import sys
    sys.exit(0)

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def task(**kw):
    return build_task(RLConfig(task="arithmetic", **kw), seed=1)


def test_arithmetic_prompts_are_a_function_of_seed_and_index():
    t = task(arithmetic_max=9, arithmetic_ops="+-*")
    a, b = t.prompt(5), t.prompt(5)
    assert a == b and a.prompt.startswith("What is ") and a.where == "arithmetic prompt #5"
    x, op, y = a.prompt[len("What is "):].split("?")[0].split()
    assert 0 <= int(x) <= 9 and 0 <= int(y) <= 9
    assert int(a.fields["answer"]) == eval(f"{x} {op} {y}")  # noqa: S307 - digits and one operator
    assert [t.prompt(i).prompt for i in range(20)] != [build_task(RLConfig(task="arithmetic"), 2).prompt(i).prompt
                                                       for i in range(20)]


def test_answer_checks():
    num = AnswerChecker("numeric", None)
    assert num.correct("The answer is 1,234.", "1234") and num.correct("12 then 13", 13)
    assert not num.correct("12 then 13", 12) and not num.correct("no digits", 3)
    assert num.correct("x = 2.50", "2.5")
    exact = AnswerChecker("exact", None)
    assert exact.correct("  Paris \n", "Paris") and not exact.correct("Paris.", "Paris")
    rx = AnswerChecker("exact", r"<answer>(.*?)</answer>")
    assert rx.correct("think... <answer>a</answer> <answer>Paris</answer>", "Paris")
    assert not rx.correct("Paris", "Paris")
    with pytest.raises(ConfigError, match=r"--answer-regex.*not a valid regular expression"):
        AnswerChecker("exact", "(")


def test_builtin_and_user_rewards_with_weights(user_rewards):
    t = task()
    rewards = build_rewards(["accuracy=2", f"{user_rewards}:brevity=0.5", f"{user_rewards}:echo_answer", "format"],
                            t, r"^\s*\d+\s*$")
    assert [r.label for r in rewards] == ["accuracy", "brevity", "echo_answer", "format"]
    completions = ["7", "it is 7", "8"]
    rows = score(rewards, ["p"] * 3, completions, {"answer": ["7", "7", "7"]})
    assert rows == [[1.0, 0.5, 1.0, 1.0], [1.0, 1 / 8, 1.0, 0.0], [0.0, 0.5, 0.0, 1.0]]
    assert weighted(rewards, rows) == pytest.approx([2 + 0.25 + 1 + 1, 2 + 1 / 16 + 1, 0.25 + 1])
    assert [r.name for r in build_rewards([], t, "x")] == ["accuracy"]
    assert [r.name for r in build_rewards([], build_task(RLConfig(task="format"), 0), "x")] == ["format"]


@pytest.mark.parametrize("spec, message", [
    ("raises", r"reward function my_rewards:raises raised ValueError: no scores today \(called with 2 completions\)"),
    ("short", r"reward function my_rewards:short returned 1 values for 2 completions"),
    ("words", r"reward function my_rewards:words returned 'high' \(str\) for completion 0, not a number"),
    ("nan", r"reward function my_rewards:nan returned nan for completion 0: rewards must be finite numbers"),
    ("scalar", r"reward function my_rewards:scalar returned float, not a list of 2 numbers"),
    ("exits", r"reward function my_rewards:exits called sys.exit\(0\) \(called with 2 completions\)"),
])
def test_every_reward_error_names_the_function(user_rewards, spec, message):
    rewards = build_rewards([f"{user_rewards}:{spec}"], task(), "x")
    with pytest.raises(RewardError, match=message):
        score(rewards, ["a", "b"], ["1", "2"], {"answer": ["1", "2"]})


@pytest.mark.parametrize("spec, message", [
    ("nosuchmodule_xyz:f", r"--reward nosuchmodule_xyz:f: cannot import nosuchmodule_xyz \(raised ModuleNotFoundError"),
    ("my_rewards:missing", r"--reward my_rewards:missing: module my_rewards \(.*my_rewards.py\) has no function "
                           r"'missing'"),
    ("my_rewards:NOT_A_FUNCTION", r"my_rewards.NOT_A_FUNCTION is a int, not a function"),
    ("lenght", r"--reward 'lenght' is neither a built-in reward \(accuracy, format\) nor package.module:function"),
    ("accuracy=heavy", r"--reward 'accuracy=heavy': the weight 'heavy' is not a finite number"),
    ("accuracy=nan", r"the weight 'nan' is not a finite number"),
])
def test_reward_specs_that_cannot_load(user_rewards, spec, message):
    with pytest.raises(ConfigError, match=message):
        build_rewards([spec], task(), "x")


def test_duplicate_rewards_and_bad_regex():
    with pytest.raises(ConfigError, match="--reward accuracy is given twice"):
        build_rewards(["accuracy", "accuracy=2"], task(), "x")
    with pytest.raises(ConfigError, match=r"\(--format-regex\) '\[' is not a valid regular expression"):
        build_rewards(["format"], task(), "[")


def test_jsonl_task_reads_records_in_a_seeded_order_with_their_fields(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"q{i}", "gold": i * 2, "topic": "t"} for i in range(5)]
    rows.append({"question": [{"role": "user", "content": "chat q"}], "gold": "x"})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    t = build_task(RLConfig(task=f"jsonl:{path}", prompt_field="question", answer_field="gold",
                            answer_match="numeric"), seed=0)
    epoch = [t.prompt(i) for i in range(6)]
    assert sorted(str(p.prompt) for p in epoch) == sorted(str(r["question"]) for r in rows)
    again = build_task(RLConfig(task=f"jsonl:{path}", prompt_field="question", answer_field="gold"), seed=0)
    assert [again.prompt(i).prompt for i in range(12)] == [t.prompt(i).prompt for i in range(12)]
    assert [t.prompt(i).prompt for i in range(6)] != [t.prompt(i).prompt for i in range(6, 12)]  # reshuffled
    q0 = next(p for p in epoch if p.prompt == "q2")
    assert q0.fields == {"gold": 4, "topic": "t", "answer": 4} and q0.where == f"{path}:3"
    assert t.accuracy("it is 4.0", q0.fields) == 1.0


@pytest.mark.parametrize("line, message", [
    ("{not json", r"qa.jsonl:2: not valid JSON"),
    ("[1, 2]", r"qa.jsonl:2: a record must be a JSON object, not list"),
    ('{"answer": 3}', r"qa.jsonl:2: the record has no prompt field 'prompt'"),
    ('{"prompt": "q"}', r"qa.jsonl:2: the record has no answer field 'answer'"),
    ('{"prompt": [{"text": "q"}], "answer": 1}', r"qa.jsonl:2: the prompt field 'prompt' holds a list that is not "
                                                 r"chat messages"),
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": 1}', r"qa.jsonl:2: the record is nested too deeply"),
    ('{"prompt": "q \\udc00", "answer": 1}', r"qa.jsonl:2: the record holds a lone UTF-16 surrogate escape"),
])
def test_malformed_jsonl_is_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "qa.jsonl"
    path.write_text('{"prompt": "ok", "answer": 1}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        build_task(RLConfig(task=f"jsonl:{path}"), seed=0)


def test_task_names():
    with pytest.raises(ConfigError, match=r"rl.task \(--task\) is not set"):
        build_task(RLConfig(), 0)
    with pytest.raises(ConfigError, match=r"rl.task \(--task\) = 'gsm8k' is not a task"):
        build_task(RLConfig(task="gsm8k"), 0)
    with pytest.raises(DataError, match=r"--task jsonl:/no/such.jsonl: the file does not exist"):
        build_task(RLConfig(task="jsonl:/no/such.jsonl"), 0)


def test_the_command_refuses_a_bad_reward_before_anything_is_written(rl_base, tmp_path, user_rewards):
    """A user's mistake through the CLI: one sentence, exit 2, no run directory."""
    save = tmp_path / "run"
    env_path = str(Path(sys.modules.get(user_rewards).__file__).parent) if user_rewards in sys.modules else None
    cmd = [sys.executable, "-m", "megapipe.cli", "posttrain", "rl", "--load", str(rl_base), "--task", "arithmetic",
           "--reward", "accuracy", "my_rewards:missing", "--save", str(save), "--train-iters", "2",
           "--max-prompt-tokens", "48", "--max-completion-tokens", "8", "--prompts-per-step", "2", "--group-size", "2",
           "--micro-batch-size", "2"]
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env_path or str(tmp_path)]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "has no function 'missing'" in proc.stderr and "Traceback" not in proc.stderr
    assert not save.exists()
    # and a reward that fails at its first call (here: calls sys.exit(0)) stops the run the same way, before any
    # record or checkpoint
    cmd[cmd.index("my_rewards:missing")] = "my_rewards:exits"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "reward function my_rewards:exits called sys.exit(0)" in proc.stderr
    assert "Traceback" not in proc.stderr and not save.exists()


def test_prompt_and_completion_must_fit_the_model(rl_base, tmp_path):
    from tests.helpers.rl import make_config

    with pytest.raises(ConfigError, match=r"--max-prompt-tokens 250 \+ --max-completion-tokens 8 = 258 tokens is "
                                          r"beyond the model's position limit \(model.max_position_embeddings = 256\)"):
        make_config(rl_base, tmp_path / "run", max_prompt_tokens=250)


def test_rl_config_ranges():
    from megapipe.config import load_config

    for key, value, message in [
        ("rl.group_size", 1, r"rl.group_size = 1 must be >= 2"),
        ("rl.temperature", 0, r"rl.temperature = 0.0 must be > 0"),
        ("rl.clip_low", 1.0, r"rl.clip_low = 1.0 must be < 1"),
        ("rl.kl_coef", -0.1, r"rl.kl_coef = -0.1 must be >= 0"),
        ("rl.scale_rewards", "std", r"rl.scale_rewards = 'std' is not valid: expected one of 'group', 'batch'"),
        ("rl.loss_aggregation", "sum", r"rl.loss_aggregation = 'sum' is not valid"),
        ("rl.min_completion_tokens", 500, r"rl.min_completion_tokens = 500 must be within \[0, "
                                          r"rl.max_completion_tokens = 128\]"),
        ("rl.arithmetic_ops", "/", r"rl.arithmetic_ops = '/' must be made of \+ - \*"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, {key: value})
