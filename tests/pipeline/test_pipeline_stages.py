"""Every post-training and export stage as a step: where its output goes, what ${step.output} hands downstream, and
how an interrupted training step is resumed (pretrain: --load of its own run; post-training: the same command)."""

from __future__ import annotations

import shlex

import pytest
import yaml

from megapipe.cli import step_commands
from megapipe.errors import ConfigError
from megapipe.pipeline.execute import job_spec
from megapipe.pipeline.plan import make_plan
from megapipe.pipeline.runner import dry_run_lines
from megapipe.pipeline.spec import load_pipeline

CHAIN = {
    "pretrain": {"stage": "pretrain", "options": {"data_path": "/d/x_text_document", "tokenizer": "/tok",
                                                  "model": "tiny", "train_iters": 10}},
    "prune": {"stage": "posttrain prune", "options": {"ckpt": "${pretrain.output}", "calib_data": "/d/x_text_document",
                                                      "hidden": 128}},
    "distill": {"stage": "posttrain distill", "options": {"teacher": "${pretrain.output}",
                                                          "student": "${prune.output}",
                                                          "data_path": "/d/x_text_document", "train_iters": 10}},
    "sft": {"stage": "posttrain sft", "options": {"load": "${distill.output}", "data": ["/chat.jsonl"],
                                                  "chat_template": "chatml", "train_iters": 10}},
    "dpo": {"stage": "posttrain dpo", "options": {"load": "${sft.output}", "data": ["/pairs.jsonl"],
                                                  "chat_template": "chatml", "train_iters": 10}},
    "rm": {"stage": "posttrain rm", "options": {"load": "${sft.output}", "data": ["/pairs.jsonl"],
                                                "chat_template": "chatml", "train_iters": 10}},
    "projector": {"stage": "posttrain projector", "options": {"load": "${sft.output}", "data": ["/captions.jsonl"],
                                                              "train_iters": 10}},
    "rl": {"stage": "posttrain rl", "options": {"load": "${dpo.output}", "reward_model": "${rm.output}",
                                                "task": "arithmetic", "train_iters": 5}},
    "fp8": {"stage": "posttrain quantize", "options": {"ckpt": "${rl.output}", "quant": "fp8",
                                                       "calib_data": "/d/x_text_document"}},
    "trt": {"stage": "export trt", "options": {"ckpt": "${fp8.output}", "fmt": "legacy", "tp": 2}},
    "smoke": {"stage": "serve-smoke", "options": {"model": "${rl.output}", "stop": ["<|im_end|>"]}},
}


@pytest.fixture
def chain(tmp_path):
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump({"steps": CHAIN}, sort_keys=False))
    return load_pipeline(path, step_commands(), run_dir=str(tmp_path / "run")), tmp_path / "run"


def test_every_stage_has_its_output_under_the_step(chain):
    p, run = chain
    cmds = {d.name: shlex.split(c) for d, c in dry_run_lines(p, make_plan(p), "local")}
    assert cmds["prune"][:4] == ["megapipe", "posttrain", "prune", f"{run}/pretrain/run"]
    assert cmds["prune"][-2:] == ["--output", f"{run}/prune/checkpoint"]
    assert cmds["distill"][-2:] == ["--save", f"{run}/distill/run"]
    assert "--teacher" in cmds["distill"] and f"{run}/prune/checkpoint" in cmds["distill"]
    assert cmds["sft"][3:5] == ["--load", f"{run}/distill/run"] and cmds["sft"][-2:] == ["--save", f"{run}/sft/run"]
    for name in ("dpo", "rm", "projector"):
        assert cmds[name][3:5] == ["--load", f"{run}/sft/run"] and cmds[name][-2:] == ["--save", f"{run}/{name}/run"]
    assert cmds["rl"][3:5] == ["--load", f"{run}/dpo/run"] and cmds["rl"][-2:] == ["--save", f"{run}/rl/run"]
    assert cmds["rl"][cmds["rl"].index("--reward-model") + 1] == f"{run}/rm/run"
    assert cmds["fp8"][3] == f"{run}/rl/run" and cmds["fp8"][-2:] == ["--output", f"{run}/fp8/checkpoint"]
    assert cmds["trt"][3:5] == [f"{run}/fp8/checkpoint", f"{run}/trt/trt"]
    assert cmds["smoke"][:3] == ["megapipe", "serve-smoke", f"{run}/rl/run"]
    assert cmds["smoke"][-2:] == ["--output", f"{run}/smoke/smoke"]
    kinds = {n: (p.steps[n].output.kind, p.steps[n].output.training) for n in p.steps}
    assert kinds == {"pretrain": ("run", True), "prune": ("checkpoint", False), "distill": ("run", True),
                     "sft": ("run", True), "dpo": ("run", True), "rm": ("run", True), "projector": ("run", True),
                     "rl": ("run", True), "fp8": ("checkpoint", False), "trt": ("dir", False),
                     "smoke": ("dir", False)}


@pytest.mark.parametrize("step,option", [("prune", "output"), ("sft", "save"), ("fp8", "output"),
                                         ("trt", "out_dir"), ("smoke", "output")])
def test_the_output_option_is_the_pipelines(tmp_path, step, option):
    steps = {k: dict(v, options=dict(v["options"])) for k, v in CHAIN.items()}
    steps[step]["options"][option] = "/elsewhere"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"steps": steps}, sort_keys=False))
    with pytest.raises(ConfigError, match=rf"step '{step}' \(.*\): option '{option}' is set by the pipeline"):
        load_pipeline(path, step_commands())


def test_resumed_training_steps(chain):
    """A resumed pretrain loads its own run (and drops --finetune); a resumed SFT / distill / DPO / RM / RL step runs
    the very command that started it, which continues its --save run; neither removes what the attempt left."""
    p, run = chain
    decisions = {d.name: d for d in make_plan(p)}
    for name in ("pretrain", "distill", "sft", "dpo", "rm", "rl"):
        d = decisions[name]
        d.resume_from = 4
        job = job_spec(p, d, "local")
        assert job["fresh"] is False
        argv = job["argv"]
        if name == "pretrain":
            assert argv[argv.index("--load") + 1] == f"{run}/pretrain/run"
            assert "--finetune" not in argv
        else:
            d.resume_from = None
            first = job_spec(p, d, "local")
            assert argv == first["argv"] and first["fresh"] is True
    commands = step_commands()
    assert commands["posttrain sft"].output.resume.option is None
    assert commands["pretrain"].output.resume.option == "load"


def test_table_entries_name_real_parameters():
    """Each output the command table declares names one of its command's parameters."""
    for stage, cmd in step_commands().items():
        if cmd.output.option is not None:
            assert cmd.output.option in cmd.params, (stage, cmd.output.option)
