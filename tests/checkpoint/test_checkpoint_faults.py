"""Saves that fail for real: a file-size limit (RLIMIT_FSIZE, what `ulimit -f` sets) in a child process makes the
kernel refuse a write with EFBIG, exactly as a full disk refuses one with ENOSPC. The previous checkpoint and
`latest` must survive, the message must name the file that could not be written, nothing half-written may stay.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megapipe.checkpoint import find_latest, is_complete

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 64 << 10  # bytes per file: manifests, metrics and tokenizer files fit, model shards do not


def limited(limit: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return set_limit


def run(cmd: list[str], limit: int | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=limited(limit) if limit else None)


def megapipe(*args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "megapipe.cli", *args], limit)


def leftovers(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name)


def test_a_save_past_the_file_size_limit_keeps_the_previous_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import resource, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint_dcp import trained
        from megapipe.checkpoint import save_checkpoint
        from megapipe.errors import CheckpointError
        model, opt = trained(hidden=64)  # ~40 KB of fp32 weights, ~80 KB of AdamW state
        save_checkpoint({str(tmp_path / "run")!r}, 1, model, opt)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, resource.RLIM_INFINITY))
        model(torch.randint(0, 11, (2, 5))).sum().backward()
        opt.step()
        try:
            save_checkpoint({str(tmp_path / "run")!r}, 2, model, opt)
        except CheckpointError as e:
            print(e)
            sys.exit(3)
    """)
    proc = run([sys.executable, "-c", script])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    message = proc.stdout.strip()
    assert "saving checkpoint" in message and "step_00000002 failed: cannot write " in message, message
    assert "/optim/__0_0.distcp (File too large)" in message, message  # the model shard fits, the optimizer's not
    run_dir = tmp_path / "run"
    assert (run_dir / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest", "step_00000001"]
    assert find_latest(run_dir).name == "step_00000001" and is_complete(run_dir / "step_00000001")
    assert megapipe("checkpoint", "verify", str(run_dir / "step_00000001")).returncode == 0


TINY = ["--model", "tiny", "--set", "model.num_layers=2", "--set", "model.hidden_size=64", "--set",
        "model.intermediate_size=128", "--set", "model.num_heads=4", "--set", "model.num_kv_heads=2",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "90,10,0",
        "--eval-iters", "1", "--log-interval", "1", "--lr-decay-iters", "10", "--save-interval", "2", "--quiet"]


@pytest.fixture(scope="module")
def trained_run(pretrain_data, tmp_path_factory):
    """A pretrain run saved at step 2, and an HF export of it."""
    prefix, tok = pretrain_data
    root = tmp_path_factory.mktemp("faults")
    proc = megapipe("pretrain", "--data-path", prefix, "--tokenizer", str(tok), *TINY, "--train-iters", "2",
                    "--save", str(root / "run"))
    assert proc.returncode == 0, proc.stderr
    assert megapipe("export", "hf", str(root / "run"), str(root / "hf"), "-q").returncode == 0
    return root


def test_pretrain_whose_save_fails_exits_naming_the_file_and_keeps_latest(trained_run, pretrain_data, tmp_path):
    prefix, tok = pretrain_data
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(trained_run / "run", run_dir)
    proc = megapipe("pretrain", "--data-path", prefix, "--tokenizer", str(tok), *TINY, "--train-iters", "4",
                    "--save", str(run_dir), "--load", str(run_dir), limit=LIMIT)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "step_00000004 failed: cannot write " in proc.stderr and "(File too large)" in proc.stderr, proc.stderr
    assert (run_dir / "latest").read_text().strip() == "step_00000002"
    assert not (run_dir / "step_00000004").exists() and leftovers(run_dir) == []
    assert megapipe("checkpoint", "verify", str(run_dir)).returncode == 0
    resumed = megapipe("pretrain", "--data-path", prefix, "--tokenizer", str(tok), *TINY, "--train-iters", "4",
                       "--save", str(run_dir), "--load", str(run_dir))  # the space is back: it goes on from step 2
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "step_00000004" / "megapipe.json").read_text())["step"] == 4


@pytest.mark.parametrize("command", ["export", "import", "convert"])
def test_exports_and_imports_past_the_limit_leave_nothing(trained_run, tmp_path, command):
    out = tmp_path / "out"
    args = {"export": ["export", "hf", str(trained_run / "run"), str(out), "--dtype", "fp32", "-q"],
            "import": ["import", "hf", str(trained_run / "hf"), str(out), "-q"],
            "convert": ["checkpoint", "convert", str(trained_run / "run"), str(out), "--to", "safetensors"]}[command]
    proc = megapipe(*args, limit=LIMIT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "File too large" in proc.stderr and "cannot write" in proc.stderr, proc.stderr
    assert str(tmp_path / "out.tmp-") in proc.stderr, proc.stderr  # the very file that could not be written
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists() and leftovers(tmp_path) == []
