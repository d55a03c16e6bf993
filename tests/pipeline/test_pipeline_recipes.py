"""The shipped pipelines (pipelines/*.yaml) validate, and --dry-run shows the commands they would run."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megapipe.cli import main, step_commands
from megapipe.pipeline.execute import job_spec
from megapipe.pipeline.plan import make_plan
from megapipe.pipeline.runner import dry_run_lines
from megapipe.pipeline.slurm import batch_script
from megapipe.pipeline.spec import load_pipeline

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "pipelines").glob("*.yaml"))


def commands(path: Path, executor: str | None = None, tmp: Path | None = None) -> dict[str, list[str]]:
    p = load_pipeline(path, step_commands(), run_dir=str(tmp) if tmp else None)
    return {d.name: shlex.split(cmd) for d, cmd in dry_run_lines(p, make_plan(p), executor or p.executor)}


def flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:] + [""], strict=True) if a.startswith("--")}


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"tiny-cpu.yaml", "llama3-8b-h100x8.yaml", "llama3-8b-slurm-2x8.yaml"}


def uses_eval(recipe: Path) -> bool:
    import yaml

    return any(s.get("stage") == "eval" for s in yaml.safe_load(recipe.read_text())["steps"].values())


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_dry_run(recipe, tmp_path, capsys):
    from test_pipeline_demo import eval_installed

    if uses_eval(recipe) and not eval_installed():
        pytest.skip("megapipe eval not installed")
    assert main(["pipeline", "run", str(recipe), "--dry-run", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "$ megapipe" in out or "$ srun" in out
    assert not (tmp_path / "run").exists()


def test_llama3_8b_on_8_gpus(tmp_path):
    cmds = commands(ROOT / "pipelines" / "llama3-8b-h100x8.yaml", tmp=tmp_path)
    assert list(cmds) == ["data", "pretrain", "sft", "fp8", "hf", "trt"]
    pre = cmds["pretrain"]
    assert pre[:2] == ["megapipe", "pretrain"] and "--bf16" in pre
    f = flags(pre)
    assert (f["--model"], f["--tensor-model-parallel-size"], f["--dp-shard"], f["--nproc-per-node"]) == ("llama3-8b", "2", "4", "8")
    assert f["--data-path"] == f"{tmp_path}/data/data_text_document" and f["--save"] == f"{tmp_path}/pretrain/run"
    sft = flags(cmds["sft"])
    assert cmds["sft"][:3] == ["megapipe", "posttrain", "sft"] and "--bf16" in cmds["sft"]
    assert (sft["--load"], sft["--save"], sft["--chat-template"]) == (f"{tmp_path}/pretrain/run", f"{tmp_path}/sft/run",
                                                                      "llama3")
    assert (sft["--tensor-model-parallel-size"], sft["--dp-shard"], sft["--nproc-per-node"]) == ("2", "4", "8")
    assert cmds["fp8"][3] == f"{tmp_path}/sft/run"
    fp8 = flags(cmds["fp8"])
    assert (fp8["--quant"], fp8["--kv-cache-quant"], fp8["--output"]) == ("fp8", "fp8", f"{tmp_path}/fp8/checkpoint")
    assert "--nproc-per-node" not in cmds["fp8"]  # PTQ runs once, on one GPU
    assert cmds["hf"][3:5] == [f"{tmp_path}/sft/run", f"{tmp_path}/hf/hf"]
    assert cmds["trt"][:5] == ["megapipe", "export", "trt", f"{tmp_path}/fp8/checkpoint", f"{tmp_path}/trt/trt"]
    assert flags(cmds["trt"])["--format"] == "unified"


@pytest.mark.parametrize("recipe", ["llama3-8b-h100x8.yaml", "llama3-8b-slurm-2x8.yaml"])
def test_llama3_8b_layouts_are_ones_the_planner_fits(recipe, capsys):
    """Each training step's layout fits 80 GB H100s by `megapipe plan`, within 10 % of its fastest layout's step
    time (the planner does not model inter-node bandwidth, which the Slurm recipe's HSDP keeps off the all-gathers)."""
    import json

    p = load_pipeline(ROOT / "pipelines" / recipe, step_commands())
    for name in ("pretrain", "sft"):
        o, res = p.steps[name].options, p.steps[name].resources
        gpus = res.get("nodes", 1) * res["procs_per_node"]
        layout = {"dp_replicate": o.get("dp_replicate", 1), "dp_shard": o["dp_shard"], "cp": 1, "tp": o["tp"],
                  "pp": 1}
        args = ["plan", "--gpus", str(gpus), "--gpu-type", "h100", "--model", o["model"] if "model" in o else
                "llama3-8b", "--seq-length", str(o["seq_length"]), "--micro-batch-size", str(o["micro_batch_size"]),
                "--global-batch-size", str(o["global_batch_size"]), "--precision", "bf16", "--tp", str(o["tp"]),
                "--dp-shard", str(o["dp_shard"]), "--dp-replicate", str(layout["dp_replicate"]), "--json"]
        assert main(args) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["fits"], f"{recipe} {name}: {layout} needs {plan['memory_bytes'] / 1e9:.1f} GB per GPU"
        fastest = plan["best_layouts"][0]
        assert plan["step_time_s"] <= 1.1 * fastest["step_time_s"], (recipe, name, plan["step_time_s"], fastest)


def test_llama3_8b_on_slurm_2_nodes(tmp_path):
    path = ROOT / "pipelines" / "llama3-8b-slurm-2x8.yaml"
    cmds = commands(path, tmp=tmp_path)
    pre = cmds["pretrain"]
    assert pre[:4] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1"]
    f = flags(pre)
    assert (f["--nproc-per-node"], f["--nnodes"], f["--rdzv-endpoint"]) == ("8", "2", "HEAD_NODE:PORT")
    assert (f["--tensor-model-parallel-size"], f["--dp-shard"], f["--dp-replicate"]) == ("2", "4", "2")  # 2 x 4 x 2 = 16 GPUs
    p = load_pipeline(path, step_commands(), run_dir=str(tmp_path))
    d = {d.name: d for d in make_plan(p)}["pretrain"]
    script = batch_script(job_spec(p, d, "slurm"), p.step_dir("pretrain"), p.steps["pretrain"].resources)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=96", "#SBATCH --time=2-00:00:00", "#SBATCH --partition=gpu",
                 "#SBATCH --account=myproject", "#SBATCH --exclusive", "#SBATCH --signal=B:TERM@120",
                 f"-m megapipe.pipeline.job {tmp_path}/pretrain/job.json"):
        assert line in script, script
    data_script = batch_script(job_spec(p, {d.name: d for d in make_plan(p)}["data"], "slurm"), p.step_dir("data"),
                               p.steps["data"].resources)
    assert "#SBATCH --time=04:00:00" in data_script and "--gpus-per-node" not in data_script
    assert list(cmds) == ["data", "pretrain", "sft", "fp8", "hf", "trt"]
    sft = cmds["sft"]
    assert sft[:4] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1"]
    f = flags(sft)
    assert (f["--load"], f["--save"], f["--nnodes"], f["--dp-replicate"]) == (
        f"{tmp_path}/pretrain/run", f"{tmp_path}/sft/run", "2", "2")
    assert cmds["fp8"][:4] == ["megapipe", "posttrain", "quantize", f"{tmp_path}/sft/run"]
    fp8_script = batch_script(job_spec(p, {d.name: d for d in make_plan(p)}["fp8"], "slurm"), p.step_dir("fp8"),
                              p.steps["fp8"].resources)
    assert "#SBATCH --gpus-per-node=1" in fp8_script and "#SBATCH --nodes=1" in fp8_script
    assert cmds["trt"][3:5] == [f"{tmp_path}/fp8/checkpoint", f"{tmp_path}/trt/trt"]


def test_tiny_cpu_chains_every_stage(tmp_path):
    """The demo pipeline: corpus -> tokenizer -> data -> pretrain -> SFT -> DPO -> fp8 -> eval before/after -> HF and
    TensorRT-LLM exports -> serve smoke -> sample, each step reading its upstream's output under the run dir."""
    from test_pipeline_demo import demo_file, eval_installed

    t = tmp_path / "run"
    cmds = commands(demo_file(tmp_path), tmp=t)
    evals = ["eval_sft", "eval_fp8"] if eval_installed() else []
    assert list(cmds) == ["corpus", "tokenizer", "data", "inspect", "pretrain", "sft", "dpo", "fp8", *evals, "hf",
                          "trt", "serve", "sample"]
    assert cmds["corpus"] == ["megapipe", "data", "fetch", "shakespeare", "--output", f"{t}/corpus/corpus.jsonl"]
    assert cmds["tokenizer"][-6:] == ["--special-token", "<|im_start|>", "--special-token", "<|im_end|>",
                                      "--output", f"{t}/tokenizer/tokenizer"]
    f = flags(cmds["pretrain"])
    expected = {"--model": "tiny", "--seq-length": "128", "--micro-batch-size": "16", "--global-batch-size": "16",
                "--train-iters": "300", "--lr": "2e-3", "--min-lr": "2e-4", "--lr-decay-style": "cosine",
                "--split": "98,2,0", "--save": f"{t}/pretrain/run"}
    assert {k: f[k] for k in expected} == expected
    sft = flags(cmds["sft"])
    assert (sft["--load"], sft["--data"], sft["--chat-template"], sft["--save"], sft["--train-iters"]) == (
        f"{t}/pretrain/run", "pipelines/data/chat.jsonl", "chatml", f"{t}/sft/run", "80")
    dpo = flags(cmds["dpo"])
    assert (dpo["--load"], dpo["--data"], dpo["--chat-template"], dpo["--save"], dpo["--train-iters"]) == (
        f"{t}/sft/run", "pipelines/data/preference.jsonl", "chatml", f"{t}/dpo/run", "30")
    assert cmds["fp8"][3] == f"{t}/sft/run" and flags(cmds["fp8"])["--quant"] == "fp8"
    assert flags(cmds["fp8"])["--calib-data"] == f"{t}/data/data_text_document"
    assert cmds["hf"][3:5] == [f"{t}/sft/run", f"{t}/hf/hf"]
    assert cmds["trt"][3:7] == [f"{t}/fp8/checkpoint", f"{t}/trt/trt", "--format", "unified"]
    assert cmds["serve"][:3] == ["megapipe", "serve-smoke", f"{t}/hf/hf"]
    assert flags(cmds["serve"])["--output"] == f"{t}/serve/smoke"
    assert cmds["sample"][2] == f"{t}/fp8/checkpoint"
    for name in evals:
        e = flags(cmds[name])
        assert (e["--tasks"], e["--data-path"], e["--output"]) == (
            "megapipe_mc,megapipe_gen,perplexity", f"{t}/data/data_text_document", f"{t}/{name}/eval")
    if evals:
        assert cmds["eval_sft"][2] == f"{t}/sft/run" and cmds["eval_fp8"][2] == f"{t}/fp8/checkpoint"


def test_tiny_cpu_without_eval_is_refused_by_name():
    """Before `megapipe eval` is installed the demo file says which step needs it (and nothing runs)."""
    from test_pipeline_demo import eval_installed

    from megapipe.errors import ConfigError

    if eval_installed():
        pytest.skip("megapipe eval is installed")
    with pytest.raises(ConfigError, match=r"tiny-cpu.yaml:\d+: step 'eval_sft': unknown stage 'eval'"):
        load_pipeline(ROOT / "pipelines" / "tiny-cpu.yaml", step_commands())


def test_bundled_chat_set_is_the_tool_output(tmp_path):
    """pipelines/data/chat.jsonl is what tools/make_chat_fixture.py writes (deterministic)."""
    import subprocess
    import sys

    out = tmp_path / "chat.jsonl"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_chat_fixture.py"), str(out), "--count", "1000",
                    "--seed", "1"], check=True, capture_output=True)
    assert out.read_bytes() == (ROOT / "pipelines" / "data" / "chat.jsonl").read_bytes()
