"""`export trt` reads a checkpoint the same whatever parallel layout saved it: one torchrun launch saves FSDP2
shards (2 processes, gloo), another re-saves a Mixtral at ep2; their exports equal, file for file, those of the
single-process checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parents[1] / "posttrain"))

from quant_twins import make_checkpoint, model_config  # noqa: E402

from megapipe.checkpoint import write_checkpoint  # noqa: E402
from megapipe.checkpoint.trt import export_trt  # noqa: E402
from megapipe.models import build_model  # noqa: E402
from tests.helpers.torchrun import failure

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


def _assert_same_files(first: Path, second: Path) -> None:
    a, b = _files(first), _files(second)
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], bytes):
            assert a[name] == b[name], name
        else:
            assert a[name].keys() == b[name].keys()
            assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name


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
    assert proc.returncode == 0, failure(proc)
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout

    export_trt(single, tmp_path / "a", "legacy", tp=2)
    export_trt(tmp_path / "fsdp", tmp_path / "b", "legacy", tp=2)
    _assert_same_files(tmp_path / "a", tmp_path / "b")


@pytest.mark.dist
def test_moe_export_of_expert_parallel_checkpoint_equals_single_process(tmp_path, tiny_tokenizer_dir):
    """A Mixtral checkpoint re-saved at ep2 (experts DTensor-sharded; test_hf_moe's worker) exports, in both formats,
    the same files as the original."""
    single = make_checkpoint(tmp_path / "single", "mixtral", tiny_tokenizer_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).parent / "test_hf_moe.py"), str(single), str(tmp_path / "ep")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)

    for fmt, kw in (("legacy", {"tp": 2}), ("unified", {})):
        export_trt(single, tmp_path / f"a-{fmt}", fmt, **kw)
        export_trt(tmp_path / "ep", tmp_path / f"b-{fmt}", fmt, **kw)
        _assert_same_files(tmp_path / f"a-{fmt}", tmp_path / f"b-{fmt}")
