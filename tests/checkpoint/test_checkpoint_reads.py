"""Every command that reads a checkpoint verifies it first: one byte of one shard flipped (same size, so only the
checksum can tell) is refused with exit 2 and a sentence naming the file, before any heavy work and with nothing
written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.cli import main
from tests.helpers.sft import CHAT_SET, train_chat_tokenizer

ROOT = Path(__file__).parents[2]
EXCERPT = ROOT / "tests" / "fixtures" / "shakespeare_excerpt.jsonl"
SHARD = "model/__0_0.distcp"
TINY = dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
            vocab_size=384, max_position_embeddings=128)


def write_tiny(path: Path, tokenizer: Path, lora: bool = False) -> Path:
    """A random tiny model saved as a checkpoint with ``tokenizer`` (``lora``: with fresh LoRA adapters on q, v)."""
    from megapipe.checkpoint import write_checkpoint
    from megapipe.config import ModelConfig
    from megapipe.models import build_model
    from megapipe.models.lora import LoRASpec, apply_lora

    cfg = ModelConfig(**TINY)
    model, fields = build_model(cfg, seed=0), {"model": cfg, "stage": "init"}
    if lora:
        spec = LoRASpec(rank=2, alpha=4.0, dropout=0.0, targets=("q", "v"))
        model, fields = apply_lora(model, spec, seed=0), {**fields, "stage": "sft", "lora": spec.to_manifest()}
    return write_checkpoint(path, model, step=0, manifest=fields, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(good checkpoint, good LoRA checkpoint, its tokenizer, a .bin/.idx prefix in it, the chat set)."""
    root = tmp_path_factory.mktemp("reads")
    tok = train_chat_tokenizer(root / "tokenizer")
    assert main(["preprocess", "--input", str(EXCERPT), "--output-prefix", str(root / "data" / "excerpt"),
                 "--tokenizer", str(tok), "--append-eod", "--quiet"]) == 0
    chat = root / CHAT_SET.name
    shutil.copy(CHAT_SET, chat)
    return dict(good=write_tiny(root / "good", tok), lora=write_tiny(root / "lora", tok, lora=True), tok=tok,
                data=str(root / "data" / "excerpt_text_document"), chat=chat)


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def damaged_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    flip_one_byte(dest / SHARD)
    return dest


TRAIN = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
         "--eval-iters", "0", "--lr", "1e-3", "--quiet"]
RL = ["--task", "arithmetic", "--prompts-per-step", "2", "--group-size", "2", "--max-completion-tokens", "4",
      "--max-prompt-tokens", "48", "--micro-batch-size", "4", "--train-iters", "1", "--precision", "fp32", "--quiet"]

# command name -> (checkpoint to damage: "good" or "lora", argv given the damaged copy BAD, the world W, a work dir OUT)
COMMANDS = {
    "export hf": ("good", lambda bad, w, out: ["export", "hf", bad, out / "hf", "-q"]),
    "export hf --lora-adapter-only": ("lora", lambda bad, w, out: ["export", "hf", bad, out / "peft",
                                                                   "--lora-adapter-only", "-q"]),
    "export trt": ("good", lambda bad, w, out: ["export", "trt", bad, out / "trt", "--format", "legacy", "-q"]),
    "checkpoint convert": ("good", lambda bad, w, out: ["checkpoint", "convert", bad, "--to", "safetensors",
                                                        out / "st"]),
    "checkpoint inspect": ("good", lambda bad, w, out: ["checkpoint", "inspect", bad]),
    "generate": ("good", lambda bad, w, out: ["generate", bad, "--prompt", "To be", "--max-new-tokens", "1"]),
    "eval": ("good", lambda bad, w, out: ["eval", bad, "--tasks", "perplexity", "--data-path", w["data"], "--limit",
                                          "1", "--seq-length", "16", "--output", out / "eval"]),
    "posttrain quantize": ("good", lambda bad, w, out: ["posttrain", "quantize", bad, "--quant", "fp8",
                                                        "--calib-data", w["data"], "--calib-samples", "2",
                                                        "--calib-seq-len", "16", "--output", out / "fp8", "--quiet"]),
    "posttrain prune": ("good", lambda bad, w, out: ["posttrain", "prune", bad, "--output", out / "pruned",
                                                     "--calib-data", w["data"], "--calib-samples", "2",
                                                     "--valid-samples", "2", "--seq-length", "16", "--ffn", "32",
                                                     "--quiet"]),
    "posttrain distill (teacher)": ("good", lambda bad, w, out: ["posttrain", "distill", "--teacher", bad,
                                                                 "--student", w["good"], "--data-path", w["data"],
                                                                 "--save", out / "run", *TRAIN]),
    "posttrain distill (student)": ("good", lambda bad, w, out: ["posttrain", "distill", "--teacher", w["good"],
                                                                 "--student", bad, "--data-path", w["data"],
                                                                 "--save", out / "run", *TRAIN]),
    "posttrain sft --load": ("good", lambda bad, w, out: ["posttrain", "sft", "--load", bad, "--data", w["chat"],
                                                          "--chat-template", "chatml", "--save", out / "run",
                                                          *TRAIN]),
    "posttrain sft --load (LoRA base weights)": ("good", lambda bad, w, out: [
        "posttrain", "sft", "--load", bad, "--data", w["chat"], "--chat-template", "chatml", "--lora-rank", "2",
        "--save", out / "run", *TRAIN]),
    "posttrain rl --load": ("good", lambda bad, w, out: ["posttrain", "rl", "--load", bad, "--save", out / "run",
                                                         *RL]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_flipped_byte_is_refused_naming_the_file(command, world, tmp_path, capsys, one_thread):
    which, argv = COMMANDS[command]
    bad = damaged_copy(world[which], tmp_path / "bad")
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    assert main([str(a) for a in argv(bad, world, out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{bad / SHARD} is damaged" in err and "Traceback" not in err, err
    assert not any(out.iterdir()), sorted(out.rglob("*"))  # nothing written


def test_serve_refuses_a_damaged_checkpoint_at_startup(world, tmp_path):
    """In its own process: a server that started anyway would never return."""
    bad = damaged_copy(world["good"], tmp_path / "bad")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "megapipe.cli", "serve", str(bad), "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and f"{bad / SHARD} is damaged" in err and "Traceback" not in err, err


def test_the_good_checkpoints_pass_the_same_readers(world, tmp_path, capsys):
    """The damage is what is refused: the same commands on the intact copies get past verification."""
    assert main(["checkpoint", "inspect", "--json", str(world["good"])]) == 0
    assert json.loads(capsys.readouterr().out)["integrity"].startswith("ok:")
    assert main(["export", "trt", str(world["good"]), str(tmp_path / "trt"), "--format", "legacy", "-q"]) == 0
    assert main(["export", "hf", str(world["lora"]), str(tmp_path / "peft"), "--lora-adapter-only", "-q"]) == 0


# --------------------------------------------------------------------------------------------------- start points


@pytest.fixture(scope="module")
def fp8(world):
    out = world["good"].parent / "fp8"
    assert main(["posttrain", "quantize", str(world["good"]), "--quant", "fp8", "--calib-data", world["data"],
                 "--calib-samples", "2", "--calib-seq-len", "16", "--eval-iters", "1", "--output", str(out),
                 "--quiet"]) == 0
    return out


STARTS = {  # command -> argv given the start checkpoint S, the world W and a run directory RUN
    "posttrain sft --load": lambda s, w, run: ["posttrain", "sft", "--load", s, "--data", w["chat"],
                                               "--chat-template", "chatml", "--save", run, *TRAIN],
    "posttrain sft --load --lora-rank": lambda s, w, run: ["posttrain", "sft", "--load", s, "--data", w["chat"],
                                                           "--chat-template", "chatml", "--lora-rank", "2",
                                                           "--save", run, *TRAIN],
    "posttrain distill --student": lambda s, w, run: ["posttrain", "distill", "--teacher", w["good"], "--student", s,
                                                      "--data-path", w["data"], "--save", run, *TRAIN],
    "posttrain rl --load": lambda s, w, run: ["posttrain", "rl", "--load", s, "--save", run, *RL],
}


@pytest.mark.parametrize("kind", ["fp8", "lora"])
@pytest.mark.parametrize("command", list(STARTS))
def test_a_quantized_or_lora_start_is_named_with_what_to_do(command, kind, world, fp8, tmp_path, capsys, one_thread):
    start = fp8 if kind == "fp8" else world["lora"]
    capsys.readouterr()
    assert main([str(a) for a in STARTS[command](start, world, tmp_path / "run")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    if kind == "fp8":
        want = (f"{start} is quantized (fp8): training starts from unquantized weights; load the checkpoint it was "
                f"quantized from ({world['good'].absolute()}) instead")
    else:
        want = (f"{start} holds LoRA adapters: merge them into a plain checkpoint first (megapipe export hf {start} "
                f"HF_DIR, then megapipe import hf HF_DIR CKPT) and load that")
    assert want in err and "_amax" not in err and "lora_A" not in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_prune_refuses_a_quantized_checkpoint(world, fp8, tmp_path, capsys, one_thread):
    out = tmp_path / "pruned"
    capsys.readouterr()
    assert main(["posttrain", "prune", str(fp8), "--output", str(out), "--calib-data", world["data"],
                 "--calib-samples", "2", "--valid-samples", "2", "--seq-length", "16", "--ffn", "32",
                 "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"{fp8} is quantized (fp8): pruning would drop its quantization; prune the checkpoint it was quantized "
            f"from ({world['good'].absolute()}), then quantize the pruned one" in err), err
    assert not out.exists()


# --------------------------------------------------------------------------------------------------- writers


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_of(ckpt: Path, root: Path) -> Path:
    """A run directory holding a copy of ``ckpt`` as its step 0, with a metrics file."""
    shutil.copytree(ckpt, root / "step_00000000")
    (root / "latest").write_text("step_00000000\n")
    (root / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 5.0 - s}) + "\n"
                                                for s in range(1, 4)))
    return root


WRITERS = {  # name -> argv given the run directory RUN (its checkpoint inside), the world W and a work dir T
    "eval --output RUN": lambda run, w, t: ["eval", run / "step_00000000", "--tasks", "perplexity", "--data-path",
                                            w["data"], "--limit", "1", "--seq-length", "16", "--output", run],
    "eval RUN --output RUN": lambda run, w, t: ["eval", run, "--tasks", "perplexity", "--data-path", w["data"],
                                                "--limit", "1", "--seq-length", "16", "--output", run],
    "eval --output the data": lambda run, w, t: ["eval", run, "--tasks", "perplexity", "--data-path", w["data"],
                                                 "--limit", "1", "--seq-length", "16", "--output",
                                                 w["data"] + ".bin"],
    "plot --output RUN": lambda run, w, t: ["plot", run, "--output", run],
    "plot --output inside RUN": lambda run, w, t: ["plot", run, "--output", run / "plots"],
    "export hf --lora-adapter-only --overwrite": lambda run, w, t: ["export", "hf", run, run, "--lora-adapter-only",
                                                                    "--overwrite", "-q"],
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_no_writer_changes_what_it_reads(writer, world, tmp_path, capsys, one_thread):
    run = run_of(world["lora"], tmp_path / "run")
    data = Path(world["data"]).parent
    before, data_before = snapshot(run), snapshot(data)
    capsys.readouterr()
    assert main([str(a) for a in WRITERS[writer](run, world, tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "write the output somewhere else" in err and "Traceback" not in err, err
    assert snapshot(run) == before and snapshot(data) == data_before


def test_a_pipeline_step_may_not_write_into_what_it_reads(world, tmp_path, capsys):
    pipe_dir = tmp_path / "pipe"
    base = run_of(world["good"], pipe_dir / "ev")  # the step's own directory: its output would land in the input
    before = snapshot(pipe_dir)
    file = tmp_path / "p.yaml"
    file.write_text(f"name: p\nrun_dir: {pipe_dir}\nsteps:\n  ev:\n    stage: eval\n    options:\n"
                    f"      ckpt: {base}\n      tasks: perplexity\n      data_path: {world['data']}\n")
    capsys.readouterr()
    assert main(["pipeline", "run", str(file)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"step 'ev' (eval): output {pipe_dir / 'ev' / 'eval'} lies inside the input {base}" in err, err
    assert snapshot(pipe_dir) == before
