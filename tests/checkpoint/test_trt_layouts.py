"""`export trt` reads a checkpoint the same whatever parallel layout saved it: one torchrun launch saves FSDP2
shards (2 processes, gloo); both exports of it equal, file for file, those of the single-process checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parents[1] / "posttrain"))

from quant_twins import model_config  # noqa: E402

from megapipe.checkpoint import write_checkpoint  # noqa: E402
from megapipe.checkpoint.trt import export_trt  # noqa: E402
from megapipe.models import build_model  # noqa: E402

WORKER = Path(__file__).parents[1] / "dist" / "trt_export_worker.py"


def _files(directory: Path) -> dict:
    out = {}
    for p in sorted(directory.iterdir()):
        if p.suffix == ".safetensors":
            with safe_open(p, "pt") as f:
                out[p.name] = {k: f.get_tensor(k) for k in f.keys()}
        else:
            out[p.name] = p.read_bytes()
    return out


@pytest.mark.dist
def test_export_of_fsdp2_checkpoint_equals_single_process(tmp_path):
    arch = "llama"
    single = write_checkpoint(tmp_path / "single", build_model(model_config(arch), seed=0),
                              manifest={"model": model_config(arch), "stage": "pretrain"})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
         str(tmp_path / "fsdp"), arch, str(Path(__file__).parents[1] / "posttrain")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout

    export_trt(single, tmp_path / "a", "legacy", tp=2)
    export_trt(tmp_path / "fsdp", tmp_path / "b", "legacy", tp=2)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], bytes):
            assert a[name] == b[name], name
        else:
            assert a[name].keys() == b[name].keys()
            assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name
