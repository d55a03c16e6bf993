"""Caching, invalidation, --from / --until / --force, failures and `pipeline status`, on a DAG of real stages.

tests/pipeline/pipelines/small.yaml: tok -> data -> inspect, and side (independent). Every step is a real
`megapipe` command in a child process; one base run is copied for each test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from megapipe.cli import main, step_commands
from megapipe.errors import MegapipeError
from megapipe.pipeline.runner import StepFailed, run_pipeline, status_rows
from megapipe.pipeline.spec import load_pipeline
from megapipe.pipeline.state import read_pipeline_record, read_state

SMALL = Path(__file__).parent / "pipelines" / "small.yaml"
STEPS = ["tok", "data", "inspect", "side"]


def small(run_dir: Path, corpus: Path, *sets: str):
    return load_pipeline(SMALL, step_commands(), [f"vars.corpus={corpus}", *sets], str(run_dir))


def run(run_dir: Path, corpus: Path, *sets: str, **kw):
    return run_pipeline(small(run_dir, corpus, *sets), "local", **kw)


def generations(run_dir: Path) -> dict[str, str]:
    return {s: (read_state(run_dir / s) or {}).get("generation") for s in STEPS}


@pytest.fixture(scope="module")
def base(tmp_path_factory, shakespeare_excerpt):
    root = tmp_path_factory.mktemp("small")
    corpus = root / "corpus.jsonl"
    shutil.copy2(shakespeare_excerpt, corpus)
    result = run(root / "run", corpus)
    assert result.ran == STEPS
    return root


@pytest.fixture
def copy(base, tmp_path):
    """(run dir, corpus): a copy of the base run (a moved run directory keeps its cache), and the base's corpus."""
    shutil.copytree(base / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "run", base / "corpus.jsonl"


def test_first_run_writes_outputs_and_states(base):
    run_dir = base / "run"
    assert (run_dir / "tok" / "tokenizer" / "tokenizer.json").is_file()
    assert (run_dir / "data" / "data_text_document.bin").is_file()
    info = json.loads((run_dir / "inspect" / "stdout.txt").read_text())
    assert info["documents"] == 189 and info["prefix"] == str(run_dir / "data" / "data_text_document")
    rec = read_state(run_dir / "data")
    assert rec["state"] == "done" and rec["inputs"] == {"tok": read_state(run_dir / "tok")["generation"]}
    assert "--append-eod" in rec["command"] and rec["duration_s"] > 0


def test_rerun_is_a_cache_hit(copy, capsys):
    run_dir, corpus = copy
    before = generations(run_dir)
    mtime = (run_dir / "data" / "data_text_document.bin").stat().st_mtime_ns
    result = run(run_dir, corpus)
    assert result.ran == [] and [d.action for d in result.decisions] == ["cached"] * 4
    assert generations(run_dir) == before
    assert (run_dir / "data" / "data_text_document.bin").stat().st_mtime_ns == mtime
    assert {s["action"] for s in read_pipeline_record(run_dir)["steps"].values()} == {"cached"}
    # through the CLI, with the status table after it
    assert main(["pipeline", "run", str(SMALL), "--run-dir", str(run_dir), "--set", f"vars.corpus={corpus}"]) == 0
    assert "ran 0 step(s) (none), 4 cached" in capsys.readouterr().out
    assert main(["pipeline", "status", str(SMALL), "--run-dir", str(run_dir), "--json"]) == 0  # the run's --set
    assert [r["state"] for r in json.loads(capsys.readouterr().out)] == ["cached"] * 4
    assert [r.state for r in status_rows(small(run_dir, corpus))] == ["cached"] * 4


def test_changed_option_reruns_exactly_its_downstream(copy):
    run_dir, corpus = copy
    before = generations(run_dir)
    assert run(run_dir, corpus, "data.quiet=false").ran == []  # what a command prints is not part of its key
    result = run(run_dir, corpus, "data.workers=2")
    assert result.ran == ["data", "inspect"]
    reasons = {d.name: d.reason for d in result.decisions}
    assert reasons["data"] == "option workers changed: None -> 2" and reasons["inspect"] == "upstream 'data' reruns"
    after = generations(run_dir)
    assert after["tok"] == before["tok"] and after["side"] == before["side"]
    assert after["data"] != before["data"] and after["inspect"] != before["inspect"]

    result = run(run_dir, corpus, "data.workers=2", "tok.vocab_size=300")
    assert result.ran == ["tok", "data", "inspect"]
    assert read_state(run_dir / "tok")["options"]["vocab_size"] == 300
    tok = json.loads((run_dir / "tok" / "tokenizer" / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) + len(tok.get("added_tokens", [])) >= 290


def test_changed_input_file_reruns_its_readers(copy):
    run_dir, corpus = copy
    original, st = corpus.read_bytes(), corpus.stat()
    try:
        with open(corpus, "a") as f:
            f.write(json.dumps({"text": "A new document, so the corpus changed."}) + "\n")
        result = run(run_dir, corpus)
    finally:  # the other tests share this corpus
        corpus.write_bytes(original)
        os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert result.ran == STEPS
    assert {d.name: d.reason for d in result.decisions}["tok"] == f"input {corpus} changed"
    assert json.loads((run_dir / "inspect" / "stdout.txt").read_text())["documents"] == 190


def test_a_directory_input_changed_in_place_reruns_its_readers(copy, tmp_path):
    """A directory's identity covers every file in it: one file rewritten in place (same name, same size, new
    content) changes the key of the step that reads the directory."""
    run_dir, corpus = copy
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(run_dir / "tok" / "tokenizer", tokenizer)
    notes = tokenizer / "notes.txt"
    notes.write_text("v1\n")
    sets = (f"data.tokenizer={tokenizer}",)
    assert run(run_dir, corpus, *sets).ran == ["data", "inspect"]
    assert run(run_dir, corpus, *sets).ran == []
    notes.write_text("v2\n")
    result = run(run_dir, corpus, *sets)
    assert result.ran == ["data", "inspect"]
    assert {d.name: d.reason for d in result.decisions}["data"] == f"input {tokenizer} changed"


def test_force_from_until(copy):
    run_dir, corpus = copy
    assert run(run_dir, corpus, force=["tok"]).ran == ["tok", "data", "inspect"]
    assert run(run_dir, corpus, start="data").ran == ["data", "inspect"]
    assert run(run_dir, corpus, force=["data"], until="data").ran == ["data"]
    rows = {r.step: r for r in status_rows(small(run_dir, corpus))}
    assert (rows["inspect"].state, rows["inspect"].note) == ("stale", "upstream 'data' reran since")
    assert run(run_dir, corpus).ran == ["inspect"]
    before = generations(run_dir)
    result = run(run_dir, corpus, "tok.vocab_size=300", "side.vocab_size=290", until="data")
    assert result.ran == ["tok", "data"]
    assert {d.name: d.action for d in result.decisions} == {"tok": "run", "data": "run", "inspect": "skip",
                                                            "side": "skip"}
    assert generations(run_dir)["side"] == before["side"]
    rows = {r.step: r for r in status_rows(small(run_dir, corpus, "tok.vocab_size=300", "side.vocab_size=290"))}
    assert rows["tok"].state == "done" and rows["data"].state == "done"
    assert (rows["inspect"].state, rows["inspect"].note) == ("stale", "upstream 'data' changed")
    assert (rows["side"].state, rows["side"].note) == ("stale", "option vocab_size changed: 300 -> 290")


def test_from_needs_its_upstream_done(tmp_path, shakespeare_excerpt):
    with pytest.raises(MegapipeError, match=r"step 'data' needs step 'tok', which is not done \(not run yet\)"):
        run(tmp_path / "run", shakespeare_excerpt, start="data")


def test_failed_step_stops_the_pipeline_and_keeps_completed_outputs(copy, capsys):
    run_dir, corpus = copy
    tok_gen = generations(run_dir)["tok"]
    with pytest.raises(StepFailed) as e:
        run(run_dir, corpus, f"data.input={run_dir}/missing.jsonl")
    message = str(e.value)
    assert message.startswith("step 'data' (preprocess) failed: exit 2: error: ") and "missing.jsonl" in message
    assert message.endswith(f"(log: {run_dir}/data/log.txt)")
    assert not list((run_dir / "data").glob("data_text_document*"))  # nothing half-written is left
    assert generations(run_dir)["tok"] == tok_gen and (run_dir / "tok" / "tokenizer" / "tokenizer.json").is_file()
    args = ["pipeline", "status", str(SMALL), "--run-dir", str(run_dir), "--set", f"vars.corpus={corpus}", "--set",
            f"data.input={run_dir}/missing.jsonl"]
    assert main(args + ["--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert [rows[s]["state"] for s in STEPS] == ["cached", "failed", "stale", "cached"]
    assert rows["data"]["note"].startswith("exit 2: error: ") and rows["inspect"]["note"] == "upstream 'data' reruns"
    assert main(args) == 0
    table = capsys.readouterr().out
    for word in ("step", "state", "duration", "key", "failed", "stale", rows["data"]["key"]):
        assert word in table
    # the CLI: the failed step's name and error, exit 1
    assert main(["pipeline", "run", *args[2:]]) == 1
    assert "error: step 'data' (preprocess) failed: exit 2" in " ".join(capsys.readouterr().err.split())
    # fixed: only the failed step and its downstream run
    assert run(run_dir, corpus).ran == ["data", "inspect"]


def test_status_of_a_fresh_run_dir(tmp_path, shakespeare_excerpt):
    rows = status_rows(small(tmp_path / "none", shakespeare_excerpt))
    assert [(r.state, r.duration_s, r.output) for r in rows][0] == ("pending", None,
                                                                    str(tmp_path / "none/tok/tokenizer"))
    assert len({r.key for r in rows}) == 4 and all(len(r.key) == 12 for r in rows)


def test_deleted_output_is_rebuilt(copy):
    run_dir, corpus = copy
    shutil.rmtree(run_dir / "side" / "tokenizer")
    result = run(run_dir, corpus)
    assert result.ran == ["side"] and {d.name: d.reason for d in result.decisions}["side"] == \
        "its output is missing"


def test_one_run_at_a_time(copy):
    import socket
    import subprocess

    from megapipe.pipeline.state import RunLock, update_state

    run_dir, corpus = copy
    with RunLock(run_dir), pytest.raises(MegapipeError, match=rf"another `megapipe pipeline run` \(pid {os.getpid()}\)"
                                                                  rf" is using {run_dir}"):
        run(run_dir, corpus)
    # a step whose command still runs (its pipeline process was killed) is not started a second time
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        update_state(run_dir / "side", state="running", host=socket.gethostname(), pid=None, child_pid=sleeper.pid)
        with pytest.raises(MegapipeError, match=rf"step 'side' is still running \(pid {sleeper.pid}\)"):
            run(run_dir, corpus)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert run(run_dir, corpus).ran == ["side"]
