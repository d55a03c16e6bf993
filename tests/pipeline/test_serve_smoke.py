"""serve-smoke's refusals before any server starts (the real server runs in test_pipeline_demo.py)."""

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
    assert main(["serve-smoke", str(model), "--output", str(tmp_path / "out"), "--ready-timeout", "120"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "megapipe serve exited with status" in err and "before it was ready" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))
