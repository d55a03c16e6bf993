"""The shipped pipelines (pipelines/*.yaml) validate, and --dry-run shows the commands they would run."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megapipe.cli import main
from megapipe.pipeline import dry_run_lines, load_pipeline, make_plan
from megapipe.pipeline.execute import job_spec
from megapipe.pipeline.slurm import batch_script

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "pipelines").glob("*.yaml"))


def commands(path: Path, executor: str | None = None, tmp: Path | None = None) -> dict[str, list[str]]:
    p = load_pipeline(path, run_dir=str(tmp) if tmp else None)
    return {d.name: shlex.split(cmd) for d, cmd in dry_run_lines(p, make_plan(p), executor or p.executor)}


def flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:] + [""], strict=True) if a.startswith("--")}


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"tiny-cpu.yaml", "llama3-8b-h100x8.yaml", "llama3-8b-slurm-2x8.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_dry_run(recipe, tmp_path, capsys):
    assert main(["pipeline", "run", str(recipe), "--dry-run", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "$ megapipe" in out or "$ srun" in out
    assert not (tmp_path / "run").exists()


def test_llama3_8b_on_8_gpus(tmp_path):
    cmds = commands(ROOT / "pipelines" / "llama3-8b-h100x8.yaml", tmp=tmp_path)
    assert list(cmds) == ["data", "pretrain", "hf"]
    pre = cmds["pretrain"]
    assert pre[:2] == ["megapipe", "pretrain"] and "--bf16" in pre
    f = flags(pre)
    assert (f["--model"], f["--tensor-model-parallel-size"], f["--dp-shard"], f["--nproc-per-node"]) == ("llama3-8b", "2", "4", "8")
    assert f["--data-path"] == f"{tmp_path}/data/data_text_document" and f["--save"] == f"{tmp_path}/pretrain/run"
    assert cmds["hf"][3:5] == [f"{tmp_path}/pretrain/run", f"{tmp_path}/hf/hf"]


def test_llama3_8b_on_slurm_2_nodes(tmp_path):
    path = ROOT / "pipelines" / "llama3-8b-slurm-2x8.yaml"
    cmds = commands(path, tmp=tmp_path)
    pre = cmds["pretrain"]
    assert pre[:4] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1"]
    f = flags(pre)
    assert (f["--nproc-per-node"], f["--nnodes"], f["--rdzv-endpoint"]) == ("8", "2", "HEAD_NODE:PORT")
    assert (f["--tensor-model-parallel-size"], f["--dp-shard"], f["--dp-replicate"]) == ("2", "4", "2")  # 2 x 4 x 2 = 16 GPUs
    p = load_pipeline(path, run_dir=str(tmp_path))
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


def test_tiny_cpu_is_the_former_demo_script(tmp_path):
    """The demo pipeline runs the commands pipelines/tiny-cpu.sh ran (plus an HF export), with the pipeline's
    step directories for outputs."""
    cmds = commands(ROOT / "pipelines" / "tiny-cpu.yaml", tmp=tmp_path)
    assert list(cmds) == ["corpus", "tokenizer", "data", "inspect", "pretrain", "hf", "sample"]
    assert cmds["corpus"] == ["megapipe", "data", "fetch", "shakespeare", "--output", f"{tmp_path}/corpus/corpus.jsonl"]
    f = flags(cmds["pretrain"])
    expected = {"--model": "tiny", "--seq-length": "128", "--micro-batch-size": "16", "--global-batch-size": "16",
                "--train-iters": "400", "--lr": "2e-3", "--min-lr": "2e-4", "--lr-warmup-iters": "40",
                "--lr-decay-style": "cosine", "--weight-decay": "0.1", "--clip-grad": "1.0", "--split": "98,2,0",
                "--eval-interval": "200", "--eval-iters": "4", "--log-interval": "20", "--save-interval": "200"}
    assert {k: f[k] for k in expected} == expected
    assert cmds["sample"][-8:] == ["--max-new-tokens", "48", "--temperature", "0.8", "--top-k", "40", "--seed", "1"]
