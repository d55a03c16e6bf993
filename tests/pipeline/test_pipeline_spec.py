"""Pipeline files: every mistake is refused before anything runs, in one sentence naming file:line."""

from __future__ import annotations

import textwrap

import pytest

from megapipe.cli import main, step_commands
from megapipe.errors import ConfigError
from megapipe.pipeline.spec import load_pipeline

GOOD = """\
name: demo
vars:
  iters: 5
steps:
  tok:
    stage: tokenizer train
    options:
      input: corpus.jsonl
      vocab_size: 320
  data:
    stage: preprocess
    options:
      input: corpus.jsonl
      tokenizer: ${tok.output}
      json_keys: [text]
  pretrain:
    stage: pretrain
    options:
      data_path: ${data.output}
      train_iters: ${vars.iters}
      tensor-model-parallel-size: 1
      compile: false
"""


def write(tmp_path, text: str, name: str = "p.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error(tmp_path, text: str, sets=None) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_pipeline(path, step_commands(), sets)
    message = str(e.value)
    assert "\n" not in message
    return message.replace(str(path), "FILE")


def test_good_file_resolves_references_variables_and_flags(tmp_path):
    p = load_pipeline(write(tmp_path, GOOD), step_commands(), run_dir=str(tmp_path / "run"))
    assert p.order == ["tok", "data", "pretrain"]
    assert p.steps["pretrain"].upstream == ["data"]
    opts = p.resolved_options("pretrain")
    assert opts["data_path"] == f"{tmp_path}/run/data/data_text_document"
    assert opts["train_iters"] == 5  # a whole-value reference keeps its type
    assert opts["tp"] == 1 and opts["compile"] is False  # a flag spelling names the parameter
    assert opts["save"] == f"{tmp_path}/run/pretrain/run"
    from megapipe.pipeline.stages import to_argv

    argv = to_argv(p.steps["pretrain"].cmd, opts)
    assert argv[:1] == ["pretrain"] and "--no-compile" in argv and argv[argv.index("--tensor-model-parallel-size") + 1] == "1"


def test_set_overrides_options_and_variables(tmp_path):
    p = load_pipeline(write(tmp_path, GOOD), step_commands(), ["vars.iters=7", "tok.vocab_size=400"])
    assert p.resolved_options("pretrain")["train_iters"] == 7
    assert p.resolved_options("tok")["vocab_size"] == 400


@pytest.mark.parametrize("bad, line, expected", [
    ("      vocab_size: 320\n", "      vocab_sise: 320\n",
     "FILE:9: step 'tok' (tokenizer train): unknown option 'vocab_sise' (did you mean 'vocab_size'?)"),
    ("    stage: preprocess\n", "    stage: preprocesss\n",
     "FILE:11: step 'data': unknown stage 'preprocesss' (did you mean 'preprocess'?)"),
    ("      tokenizer: ${tok.output}\n", "      tokenizer: ${tokk.output}\n",
     "FILE:14: step 'data' refers to '${tokk.output}', but there is no step 'tokk' (did you mean 'tok'?)"),
    ("      tokenizer: ${tok.output}\n", "      tokenizer: ${pretrain.output}\n",
     "FILE:14: step 'data' refers to step 'pretrain', which comes later (at FILE:16): move 'pretrain' above"),
    ("      tokenizer: ${tok.output}\n", "      tokenizer: ${data.output}\n",
     "FILE:14: step 'data' refers to its own output (a cycle)"),
    ("      tokenizer: ${tok.output}\n", "      tokenizer: ${tok.outptu}\n",
     "FILE:14: step 'data': '${tok.outptu}': a step has output and dir, not 'outptu'"),
    ("      train_iters: ${vars.iters}\n", "      train_iters: ${vars.steps}\n",
     "FILE:20: '${vars.steps}': no variable 'steps' (variables: iters)"),
    ("      train_iters: ${vars.iters}\n", "      train_iters: many\n",
     "FILE:20: step 'pretrain' (pretrain): Invalid value for '--train-iters': 'many': input should be a valid "
     "integer"),
    ("      compile: false\n", "      compile: maybe\n",
     "FILE:22: step 'pretrain': option 'compile' is a switch: give true or false, not 'maybe'"),
    ("      json_keys: [text]\n", "      json_keys: {a: 1}\n",
     "FILE:15: step 'data': option 'json_keys' takes values, not a mapping"),
    ("      vocab_size: 320\n", "      vocab_size: [1, 2]\n",
     "FILE:9: step 'tok': option 'vocab_size' takes one value, not a list"),
    ("      train_iters: ${vars.iters}\n", "      train_iters: 5\n      save: /tmp/elsewhere\n",
     "FILE:21: step 'pretrain' (pretrain): option 'save' is set by the pipeline"),
    ("      train_iters: ${vars.iters}\n", "      train_iters: 5\n      nproc_per_node: 2\n",
     "FILE:21: step 'pretrain' (pretrain): option 'nproc_per_node' is set by the executor: give "
     "resources.procs_per_node"),
    ("      tokenizer: ${tok.output}\n", "",
     "FILE:10: step 'data' (preprocess): the required option 'tokenizer' is not given"),
    ("  tok:\n", "  tok:\n    resources: {nodes: 0}\n", "FILE:6: resource 'nodes' must be an integer >= 1, got 0"),
    ("  tok:\n", "  tok:\n    resources: {procs_per_node: 4}\n", "FILE:6: step 'tok' (tokenizer train): "
     "resources.procs_per_node > 1 only applies to training stages"),
    ("  tok:\n", "  tok:\n    resurces: {}\n", "FILE:6: unknown key of step 'tok' 'resurces' (did you mean "
     "'resources'?)"),
    ("name: demo\n", "name: demo\nstepz: {}\n", "FILE:2: unknown top-level key 'stepz' (did you mean 'steps'?)"),
    ("      vocab_size: 320\n", "      vocab_size: 320\n      vocab_size: 330\n",
     "FILE:10: duplicate key 'vocab_size' (first at line 9)"),
    ("      vocab_size: 320\n", "      vocab_size: [320\n", "FILE:10: invalid YAML"),
    ("  tok:\n", "  9tok:\n", "FILE:5: step name '9tok' must be letters"),
])
def test_mistakes_name_file_and_line(tmp_path, bad, line, expected):
    assert bad in GOOD
    message = error(tmp_path, GOOD.replace(bad, line, 1))
    assert message.startswith(expected), message


def test_cycle_through_after_is_refused_with_its_path(tmp_path):
    text = GOOD.replace("    stage: tokenizer train\n", "    stage: tokenizer train\n    after: [pretrain]\n")
    assert error(tmp_path, text) == "FILE:7: steps form a cycle: tok -> data -> pretrain -> tok"


def test_after_may_order_a_step_before_an_earlier_one(tmp_path):
    text = GOOD + """\
  last:
    stage: data inspect
    options: {prefix: "${data.output}"}
  first:
    stage: data fetch
    options: {name: shakespeare}
"""
    text = text.replace("    stage: tokenizer train\n", "    stage: tokenizer train\n    after: [first]\n")
    p = load_pipeline(write(tmp_path, text), step_commands())
    assert p.order == ["first", "tok", "data", "pretrain", "last"]


def test_bad_set_overrides(tmp_path):
    assert error(tmp_path, GOOD, ["pretrian.lr=1"]).startswith(
        "--set pretrian.lr=1: no step 'pretrian' in FILE (did you mean 'pretrain'?)")
    assert error(tmp_path, GOOD, ["pretrain.lrr=1"]).startswith(
        "--set pretrain.lrr=1: step 'pretrain' (pretrain): unknown option 'lrr' (did you mean 'lr'?)")
    assert error(tmp_path, GOOD, ["pretrain.train_iters=x"]).startswith(
        "--set pretrain.train_iters=x: step 'pretrain' (pretrain): Invalid value for '--train-iters'")


def test_options_file_errors_name_that_file(tmp_path):
    (tmp_path / "opts.yaml").write_text("input: corpus.jsonl\nvocab_size: 320\nvocab: 3\n")
    text = GOOD.replace("""    options:
      input: corpus.jsonl
      vocab_size: 320
""", "    options: opts.yaml\n", 1)
    message = error(tmp_path, text)
    assert message.startswith(f"{tmp_path}/opts.yaml:3: step 'tok' (tokenizer train): unknown option 'vocab'"), message


def test_cli_prints_one_sentence_and_fails(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("vocab_size: 320", "vocab_size: 320\n      bogus: 1"))
    assert main(["pipeline", "run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:10: step 'tok' (tokenizer train): unknown option 'bogus'" in " ".join(err.split())
    assert "Traceback" not in err


def test_bad_selection_names(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["pipeline", "run", str(path), "--dry-run", "--from", "pretrainn"]) == 2
    assert "--from pretrainn: no step 'pretrainn'" in capsys.readouterr().err
    assert main(["pipeline", "run", str(path), "--dry-run", "--from", "pretrain", "--until", "tok"]) == 2
    assert "'tok' does not depend on 'pretrain'" in capsys.readouterr().err


def test_dry_run_prints_plan_and_commands(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["pipeline", "run", str(path), "--dry-run", "--run-dir", str(tmp_path / "r")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "run tok (tokenizer train)" in out and "not run yet" in out
    assert f"$ megapipe preprocess --input corpus.jsonl --tokenizer {tmp_path}/r/tok/tokenizer --json-keys text " \
           f"--output-prefix {tmp_path}/r/data/data" in out
    assert not (tmp_path / "r").exists()  # a dry run writes nothing


def test_variables_may_use_the_environment_and_earlier_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAPIPE_TEST_DATA", "/data")
    text = GOOD.replace("vars:\n  iters: 5\n", "vars:\n  iters: 5\n  root: ${env.MEGAPIPE_TEST_DATA}\n"
                        "  corpus: ${vars.root}/c.jsonl\n").replace("input: corpus.jsonl", "input: ${vars.corpus}")
    p = load_pipeline(write(tmp_path, text), step_commands())
    assert p.resolved_options("tok")["input"] == "/data/c.jsonl"
    assert error(tmp_path, text.replace("${vars.root}/c", "${vars.later}/c")).startswith(
        "FILE:5: '${vars.later}': no variable 'later' (variables: iters, root)")
    monkeypatch.delenv("MEGAPIPE_TEST_DATA")
    assert error(tmp_path, text).startswith("FILE:4: '${env.MEGAPIPE_TEST_DATA}': the environment variable "
                                            "MEGAPIPE_TEST_DATA is not set")


def test_a_refused_run_leaves_no_run_directory(tmp_path, capsys):
    """A mistake found before any step ran (a bad --set, a bad --from) leaves no run directory (nor its lock)."""
    path = write(tmp_path, GOOD)
    run_dir = tmp_path / "runs" / "new"
    assert main(["pipeline", "run", str(path), "--run-dir", str(run_dir), "--set", "pretrain.lrr=1"]) == 2
    assert main(["pipeline", "run", str(path), "--run-dir", str(run_dir), "--from", "pretrainn"]) == 2
    assert "--from pretrainn: no step 'pretrainn'" in capsys.readouterr().err
    assert not run_dir.exists()
