"""serve-smoke: its refusals before any server starts, and its check that the server answers with the engine's own
greedy output (an empty one included); the demo's server runs in test_pipeline_demo.py."""

from __future__ import annotations

from megapipe.cli import main


def test_refusals_are_one_sentence_and_write_nothing(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "responses.json").write_text("{}")
    cases = [
        (["serve-smoke", str(tmp_path / "nope"), "--output", str(tmp_path / "o1")], "nope does not exist"),
        (["serve-smoke", str(model), "--output", str(tmp_path / "o2"), "--max-tokens", "0"],
         "--max-tokens = 0 must be >= 1"),
        (["serve-smoke", str(model), "--output", str(taken)], f"--output {taken} exists: pass --overwrite"),
    ]
    for args, message in cases:
        assert main(args) != 0, args
        err = " ".join(capsys.readouterr().err.split())
        assert message in err, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "taken"]
    assert (taken / "responses.json").read_text() == "{}"


def test_a_server_that_cannot_start_is_named(tmp_path, capsys):
    """A directory that is no model: `megapipe serve` exits before it is ready, and the smoke test says so."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "new" / "folders" / "out"
    assert main(["serve-smoke", str(model), "--output", str(out), "--ready-timeout", "120"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "megapipe serve exited with status" in err and "before it was ready" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the folders made for the output went too
    assert main(["serve-smoke", str(model), "--output", "/proc/megapipe-smoke"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "--output /proc/megapipe-smoke: cannot create it there" in err and "Traceback" not in err


def test_an_empty_greedy_answer_passes_when_it_is_the_engines_own(tmp_path, tiny_tokenizer_dir):
    """A model whose final norm is zero gives all-zero logits, so greedy decoding picks id 0, the tokenizer's
    end-of-document: its right answer is the empty completion, which the smoke test must accept (the server's answer
    equals the engine's greedy output), as the README's demo with --set sft.lr=1e-3 produces."""
    import torch

    from megapipe.checkpoint import write_checkpoint
    from megapipe.config import ModelConfig
    from megapipe.models import build_model
    from megapipe.pipeline.serve_smoke import serve_smoke

    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, vocab_size=512,
                      max_position_embeddings=64)
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        model.norm.weight.zero_()
    ckpt = write_checkpoint(tmp_path / "ckpt", model, step=0, manifest={"model": cfg, "stage": "init"},
                            tokenizer=tiny_tokenizer_dir)
    record = serve_smoke(str(ckpt), str(tmp_path / "out"), "To be, or not", None, max_tokens=4,
                         serve_args=["--threads", "1", "--num-blocks", "8"])
    assert record["completion"]["response"]["choices"][0]["text"] == "" and record["engine_greedy"] == [""]
    assert (tmp_path / "out" / "responses.json").is_file()
