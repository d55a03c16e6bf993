"""`megapipe pretrain --nproc-per-node N` end to end, the user's path: a run saved in one parallel layout and
continued in another (or in one process) follows the loss curve of an uninterrupted single-process run; impossible
layouts are refused before torchrun starts.

One chain of runs, each resuming the previous one's checkpoint: tp2 x pp2 (steps 1-2) -> dp_shard2 x cp2 (3-4) ->
one process (5-6), and tp2 x pp2 -> one process (3-6). Two torchrun launches of 4 processes; single-process runs
in-process. fp32 and the default optimizer, AdamW, so resuming must restore its moments resharded to the new layout
(SGD without momentum would have no state to lose). Bound: 1e-5 relative on every step's loss and the final
validation loss. Layouts differ only in the order of fp32 sums; AdamW divides by sqrt(v) of small gradients, which
amplifies that round-off step after step: observed <= 2e-7 relative over the 6 steps here, 50x under the bound,
while the loss itself moves by ~0.1 per step (a wrong update, optimizer state or data position shows).
Also: tools/loss_compare.py --pretrain (a 2-process launch) and impossible layouts refused in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.cli import main
from megapipe.errors import MegapipeError
from tests.helpers.torchrun import failure

STEPS = 6
REL = 1e-5
MODEL = ["--model", "tiny", "--set", "model.num_layers=4", "--set", "model.hidden_size=64", "--set",
         "model.intermediate_size=128", "--set", "model.num_heads=4", "--set", "model.num_kv_heads=2"]
TRAIN = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--split", "90,10,0",
         "--lr", "1e-2", "--lr-warmup-iters", "2", "--lr-decay-iters", str(STEPS), "--eval-iters", "1",
         "--log-interval", "1", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(pretrain_data):
    """Common arguments: the Shakespeare excerpt tokenized with the tiny tokenizer, the model, the batch."""
    prefix, tokenizer = pretrain_data
    return ["--data-path", str(prefix), "--tokenizer", str(tokenizer), *MODEL, *TRAIN]


def megapipe(args: list[str]) -> None:
    """``megapipe ARGS`` in a new process (the console script), as a user runs it."""
    exe = Path(sys.executable).with_name("megapipe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megapipe.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure(proc)


def losses(run_dir: Path, kind: str = "train") -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


def assert_follows(curve: dict[int, float], reference: dict[int, float], steps) -> None:
    assert sorted(curve) == list(steps), curve
    for s in steps:
        assert curve[s] == pytest.approx(reference[s], rel=REL), (s, curve, reference)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted single-process run: {step: loss} for train, and the final valid loss."""
    run = tmp_path_factory.mktemp("reference")
    assert main(["pretrain", *data, "--train-iters", str(STEPS), "--save", str(run)]) == 0
    return losses(run), losses(run, "valid")[STEPS]


def manifest(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / f"step_{step:08d}" / "megapipe.json").read_text())


@pytest.mark.dist
def test_checkpoints_continue_across_layouts(data, reference, tmp_path, capsys):
    ref, ref_valid = reference
    a, b, c, d = (tmp_path / n for n in ("tp2pp2", "dp2cp2", "single_from_dp2cp2", "single_from_tp2pp2"))
    megapipe(["pretrain", *data, "--nproc-per-node", "4", "--tp", "2", "--pp", "2", "--train-iters", "2",
              "--save", str(a)])
    assert_follows(losses(a), ref, range(1, 3))
    assert manifest(a, 2)["layout"] == {"world_size": 4, "parallel": "tp2,pp2"}

    megapipe(["pretrain", *data, "--nproc-per-node", "4", "--dp-shard", "2", "--cp", "2", "--load", str(a),
              "--save", str(b), "--train-iters", "4"])
    assert_follows(losses(b), ref, range(3, 5))
    assert manifest(b, 4)["layout"] == {"world_size": 4, "parallel": "dp_shard2,cp2"}
    assert manifest(b, 4)["parent"] == str((a / "step_00000002").absolute())

    assert main(["pretrain", *data, "--load", str(b), "--save", str(c), "--train-iters", str(STEPS)]) == 0
    assert_follows(losses(c), ref, range(5, STEPS + 1))
    assert losses(c, "valid")[STEPS] == pytest.approx(ref_valid, rel=REL)

    assert main(["pretrain", *data, "--load", str(a), "--save", str(d), "--train-iters", str(STEPS)]) == 0
    assert_follows(losses(d), ref, range(3, STEPS + 1))
    assert losses(d, "valid")[STEPS] == pytest.approx(ref_valid, rel=REL)

    # the layout check takes the model from the checkpoint when --load gives none (4 heads here)
    capsys.readouterr()
    args = ["pretrain", "--data-path", data[1], "--load", str(a), "--train-iters", str(STEPS), *TRAIN]
    assert main([*args, "--nproc-per-node", "3", "--tp", "3"]) == MegapipeError.exit_code
    assert "model.num_heads = 4 is not divisible by parallel.tp = 3" in " ".join(capsys.readouterr().err.split())


@pytest.mark.dist
def test_loss_compare_runs_megapipe_pretrain(data, reference, tmp_path):
    tool = Path(__file__).parents[2] / "tools" / "loss_compare.py"
    cmd = [sys.executable, str(tool), "single", "tp2", "--pretrain", "--steps", "2", "--", *data]
    out = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].endswith(": OK") and len(lines) == 4, out.stdout  # header, 2 steps, verdict
    assert [float(x) for x in lines[2].split()[1:3]] == pytest.approx([reference[0][2]] * 2, rel=REL)


@pytest.mark.parametrize("layout, message", [
    (["--nproc-per-node", "4", "--tp", "2", "--pp", "4"],
     "world size 4 is not divisible by tp*pp*cp*dp_replicate = 2*4*1*1 = 8"),
    (["--nproc-per-node", "6", "--tp", "3"], "model.num_heads = 4 is not divisible by parallel.tp = 3"),
    (["--nproc-per-node", "4", "--dp-shard", "4", "--global-batch-size", "4"],
     "train.global_batch_size = 4 is not divisible by train.micro_batch_size * data-parallel size = 2*4 = 8"),
    (["--nproc-per-node", "2", "--cp", "2", "--seq-length", "30"],
     "data.seq_length = 30 is not divisible by 2*parallel.cp = 4"),
    (["--nproc-per-node", "2", "--pp", "2", "--pp-layer-split", "1,2"],
     "parallel.pp_layer_split = [1, 2] sums to 3, not model.num_layers = 4"),
    (["--nproc-per-node", "2", "--pp", "2", "--pp-layer-split", "2,x"], "--pp-layer-split '2,x' is not"),
    (["--nproc-per-node", "2", "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--pp-virtual-stages", "1"],
     "parallel.pp_schedule = 'Interleaved1F1B' needs parallel.pp_virtual_stages >= 2 (got 1)"),
    (["--nnodes", "2", "--nproc-per-node", "2"], "--nnodes = 2 needs --rdzv-endpoint HOST:PORT"),
])
def test_impossible_layout_fails_before_torchrun(data, tmp_path, capsys, layout, message):
    # refused in this process: torchrun's own failure would exit 1 with its children's tracebacks, not
    # megapipe's user-error code with one sentence
    code = main(["pretrain", *data, "--train-iters", "2", "--save", str(tmp_path / "run"), *layout])
    err = " ".join(capsys.readouterr().err.split())
    assert code == MegapipeError.exit_code and message in err, err
    assert err.count("error:") == 1 and not (tmp_path / "run").exists()


def test_pp_schedule_flag_sets_the_stages_per_rank_it_needs():
    from megapipe.config import load_config
    from stages.pretrain import _default_virtual_stages, check_layout

    for schedule, v in (("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("GPipe", 1)):
        cfg = load_config(None, {"parallel.pp_schedule": schedule, "parallel.pp_virtual_stages": 3,
                                 "model.preset": "tiny", "model.vocab_size": 512})
        _default_virtual_stages(cfg.parallel)
        assert cfg.parallel.pp_virtual_stages == (3 if schedule == "Interleaved1F1B" else v)
    cfg = load_config(None, {"parallel.pp": 2, "parallel.pp_schedule": "Interleaved1F1B", "model.preset": "tiny",
                             "train.train_iters": 1, "data.data_path": ["unused"],
                             "model.vocab_size": 512, "train.global_batch_size": 8, "train.micro_batch_size": 2})
    _default_virtual_stages(cfg.parallel)
    dims = check_layout(cfg, 2)
    assert (dims.pp, dims.pp_virtual_stages, dims.dp_shard) == (2, 2, 1)


@pytest.mark.dist
def test_sigterm_to_the_launcher_reaches_the_workers_once(data, tmp_path):
    """``kill -TERM`` of the ``megapipe pretrain --nproc-per-node 2`` process: it forwards the signal to torchrun
    (its own process group), both workers finish the step, save together and the launcher exits 0; no process of
    the job is left."""
    import signal
    import time

    run_dir = tmp_path / "run"
    exe = Path(sys.executable).with_name("megapipe")
    args = [*data, "--train-iters", "400", "--save", str(run_dir), "--nproc-per-node", "2"]
    args = [a for a in args if a != "--quiet"]
    proc = subprocess.Popen([str(exe), "pretrain", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    end = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < end, "no training step in 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "stopped by SIGTERM" in out
    latest = (run_dir / "latest").read_text().strip()
    step = json.loads((run_dir / latest / "megapipe.json").read_text())["step"]
    assert 2 <= step < 400
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert leftover == [], leftover
