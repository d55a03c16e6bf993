"""One torchrun launch (2 processes, gloo): a single-process checkpoint loads into FSDP2 shards and an FSDP2
checkpoint loads into a single process, model and AdamW state equal tensor for tensor."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint import lineage, load_checkpoint, read_manifest, save_checkpoint
from megapipe.checkpoint.convert import to_safetensors
from tests.helpers.torchrun import failure

WORKER = Path(__file__).parents[1] / "dist" / "ckpt_fsdp_worker.py"


def _worker_module():
    spec = importlib.util.spec_from_file_location("ckpt_fsdp_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.dist
def test_fsdp2_checkpoints_load_in_a_single_process_and_back(tmp_path):
    w = _worker_module()
    torch.manual_seed(0)
    model = w.Net()
    opt = w.optimizer(model)
    w.step(model, opt, seed=1)
    src = save_checkpoint(tmp_path / "single", 1, model, opt)
    save_file(w.full_state(model, opt), f"{src}_ref.safetensors")

    dst = tmp_path / "fsdp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            str(src),
            str(dst),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, failure(proc)
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout

    torch.manual_seed(3)
    single = w.Net()
    single_opt = w.optimizer(single)
    manifest = load_checkpoint(dst, single, single_opt)
    assert manifest["layout"] == {"world_size": 2} and manifest["step"] == 2
    ref = load_file(f"{dst}_ref.safetensors")
    got = w.full_state(single, single_opt)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k].to(ref[k].dtype)), k
    # the sharded checkpoint also consolidates to one safetensors file with the full tensors
    full = load_file(to_safetensors(dst, tmp_path / "st"))
    assert full.keys() == {k[len("model.") :] for k in ref if k.startswith("model.")}
    for k, v in full.items():
        assert torch.equal(v, ref[f"model.{k}"]), k
    assert [c["stage"] for c in lineage(dst / "step_00000002")] == ["test", None]
    assert read_manifest(dst / "step_00000002")["parent"] == str(src)
