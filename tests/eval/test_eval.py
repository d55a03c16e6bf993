"""`megapipe eval`: results.json, the built-in perplexity against a direct computation, quantized checkpoints, local
task files, and every user mistake refused in one sentence with nothing written."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapipe.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(args, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())


def direct_perplexity(hf_dir: Path, prefix: str, seq_length: int, count: int) -> tuple[float, int]:
    """Mean next-token loss of transformers' own model over Megatron windows (seq_length + 1 tokens, overlap 1)."""
    from megapipe.data.indexed import IndexedDataset
    from tests.helpers.hf_tiny import hf_auto_class

    data = IndexedDataset(prefix)
    stream = torch.cat([torch.as_tensor(data[i].astype("int64")) for i in range(len(data))])
    model = hf_auto_class(hf_dir).from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(count):
            w = stream[i * seq_length: i * seq_length + seq_length + 1][None]
            logits = model(w[:, :-1]).logits
            total += float(torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum"))
            tokens += w.shape[1] - 1
    return total / tokens, tokens


def test_cli_writes_results_and_perplexity_matches_transformers(tiny_llama, pretrain_data, tmp_path, capfd,
                                                                monkeypatch, one_thread):
    """Outside a git repository, with stderr not a terminal (captured here, a log file in a pipeline step): no
    git message (lm-eval records the commit it runs in) and no progress bars."""
    hf_dir, ckpt = tiny_llama
    prefix, _ = pretrain_data
    out = tmp_path / "eval"
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run_cli(["eval", ckpt, "--tasks", "megapipe_mc,megapipe_gen,perplexity", "--data-path", prefix,
                                 "--limit", 4, "--seq-length", 64, "--output", out, "--log-samples"], capfd)
    assert code == 0, err
    assert "fatal" not in err and "it/s" not in err and "%|" not in err, err
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {"megapipe_mc", "megapipe_gen", "perplexity"}
    ppl = results["results"]["perplexity"]
    loss, tokens = direct_perplexity(hf_dir, prefix, 64, 4)
    assert ppl["tokens,none"] == tokens == 4 * 64
    assert ppl["loss,none"] == pytest.approx(loss, rel=1e-5)
    assert ppl["ppl,none"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert results["results"]["megapipe_mc"]["acc,none"] in (0, 0.25, 0.5, 0.75, 1.0)
    assert results["n-samples"]["megapipe_mc"]["effective"] == 4
    # the table is lm-eval's make_table, perplexity in it
    assert "|megapipe_mc" in stdout and "|perplexity" in stdout and "acc_norm" in stdout and "ppl" in stdout
    rows = [json.loads(line) for line in (out / "samples_megapipe_mc.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {"doc", "resps", "acc"} <= set(rows[0])


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bars_show_on_a_terminal_only(monkeypatch, terminal):
    import io

    from tqdm.auto import tqdm

    from megapipe.eval.tasks import quiet_lm_eval

    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    with quiet_lm_eval():
        bar = tqdm(total=1, disable=False, file=io.StringIO())
    assert bar.disable is not terminal


def test_perplexity_of_every_window_and_several_prefixes(tiny_llama, pretrain_data, tmp_path, one_thread):
    """No --limit: every token after the first is predicted once (a short last window); two prefixes pool."""
    from megapipe.data.indexed import IndexedDataset
    from megapipe.eval.run import run_eval

    hf_dir, ckpt = tiny_llama
    prefix, _ = pretrain_data
    total = IndexedDataset(prefix).num_tokens
    copy = str(tmp_path / "copy")
    for suffix in (".bin", ".idx", ".megapipe.json"):
        shutil.copy(prefix + suffix, copy + suffix)
    results, _ = run_eval(ckpt, "perplexity", [prefix, copy], seq_length=254, output=tmp_path / "e",
                          batch_size=32)
    pooled, one = results["results"]["perplexity"], results["results"][f"perplexity:{copy}"]
    assert one["tokens,none"] == total - 1 and pooled["tokens,none"] == 2 * (total - 1)
    assert pooled["loss,none"] == pytest.approx(one["loss,none"], rel=1e-9)
    loss, _ = direct_perplexity(hf_dir, prefix, 254, 3)
    first3, _ = run_eval(ckpt, "perplexity", [prefix], seq_length=254, limit=3, output=tmp_path / "f")
    assert first3["results"]["perplexity"]["loss,none"] == pytest.approx(loss, rel=1e-5)


def test_quantized_checkpoint_scores_its_fake_quant_model(tiny_llama, pretrain_data, tmp_path, one_thread):
    """fp8 fake quant: eval's perplexity equals the one `posttrain quantize` measured on the same windows, before
    and after quantizing."""
    pytest.importorskip("modelopt")
    from megapipe.eval.run import run_eval
    from megapipe.posttrain.quantize import quantize_checkpoint

    _, ckpt = tiny_llama
    prefix, _ = pretrain_data
    summary = quantize_checkpoint(ckpt, tmp_path / "q", "fp8", prefix, calib_samples=4, seq_length=64,
                                  batch_size=2, eval_iters=2, eval_data=prefix)
    before, _ = run_eval(ckpt, "perplexity", [prefix], seq_length=64, limit=4, output=tmp_path / "e1")
    after, _ = run_eval(tmp_path / "q", "perplexity", [prefix], seq_length=64, limit=4, output=tmp_path / "e2")
    assert before["results"]["perplexity"]["ppl,none"] == pytest.approx(summary["perplexity_before"], rel=1e-5)
    assert after["results"]["perplexity"]["ppl,none"] == pytest.approx(summary["perplexity_after"], rel=1e-5)
    assert after["results"]["perplexity"]["ppl,none"] != before["results"]["perplexity"]["ppl,none"]


def test_local_task_yaml_and_directory(tiny_llama, tmp_path, one_thread):
    """A user's task: a YAML beside its JSONL (relative data_files), by path, by directory, by --include-path."""
    from megapipe.eval.run import run_eval

    _, ckpt = tiny_llama
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "colors.jsonl").write_text("".join(json.dumps({"q": f"Color {i}:", "choices": ["red", "blue"],
                                                            "label": i % 2}) + "\n" for i in range(6)))
    (tasks / "colors.yaml").write_text(
        "task: my_colors\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: colors.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    by_path, _ = run_eval(ckpt, str(tasks / "colors.yaml"), output=tmp_path / "a")
    by_dir, _ = run_eval(ckpt, str(tasks), output=tmp_path / "b")
    by_name, _ = run_eval(ckpt, "my_colors", include_paths=[str(tasks)], output=tmp_path / "c")
    accs = {r["results"]["my_colors"]["acc,none"] for r in (by_path, by_dir, by_name)}
    assert len(accs) == 1 and by_path["n-samples"]["my_colors"]["effective"] == 6


@pytest.fixture(scope="module")
def other_tokenizer_data(tmp_path_factory):
    """A data prefix made with another tokenizer than the model's (same vocabulary size, other merges)."""
    from megapipe.data.preprocess import preprocess
    from megapipe.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("other_tok")
    texts = ["a completely different corpus of words", "numbers 1 2 3 4 5 6 7 8 9", "zebra yak xylophone"] * 30
    tok = train_tokenizer(texts, 300, root / "tok")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    stats = preprocess([str(src)], root / "other", tok, append_eod=True)
    return stats.outputs["text"]


BAD = [
    (["--tasks", "megapipe_mc,megapipe_mcq"], "unknown task 'megapipe_mcq' (did you mean megapipe_mc, megapipe_gen, "
     "megapipe_text?): megapipe ships megapipe_gen, megapipe_mc, megapipe_shapes, megapipe_text, perplexity; lm-eval's "
     "registry has"),
    (["--tasks", "missing/dir/task.yaml"], "no such task file or directory"),
    (["--tasks", "megapipe_mc", "--limit", "0"], "--limit '0' must be an integer >= 1"),
    (["--tasks", "megapipe_mc", "--limit", "2.5"], "--limit '2.5' must be an integer >= 1"),
    (["--tasks", "megapipe_mc", "--limit", "many"], "--limit 'many' is not a number"),
    (["--tasks", "megapipe_mc", "--num-fewshot", "-1"], "--num-fewshot = -1 must be an integer >= 0"),
    (["--tasks", "megapipe_mc", "--batch-size", "0"], "--batch-size = 0 must be an integer >= 1"),
    (["--tasks", "perplexity"], "the perplexity task needs --data-path PREFIX"),
    (["--tasks", "megapipe_mc", "--data-path", "{prefix}"], "is read only by the perplexity task"),
    (["--tasks", "perplexity", "--data-path", "{root}/nope"], "nope.bin does not exist"),
    (["--tasks", "perplexity", "--data-path", "{prefix}", "{prefix}"], "names {prefix} twice"),
    (["--tasks", "perplexity", "--data-path", "{prefix}", "--seq-length", "255"],
     "--seq-length = 255 must be within [1, 254]"),
    (["--tasks", "perplexity", "--data-path", "{other}"], "was tokenized with tokenizer"),
    (["--tasks", "megapipe_mc", "--max-length", "300"], "max_length = 300 exceeds what the engine can score: 254"),
    (["--tasks", "{root}/bad.yaml"], "dataset_kwargs.data_files.test = 'absent.jsonl': no such file"),
    (["--tasks", "{root}/broken.yaml"], "task(s) broken could not be built: ArrowInvalid: JSON parse error"),
    (["--tasks", ","], "--tasks names no task"),
    (["--tasks", "megapipe_mc,megapipe_shapes"], "task megapipe_shapes shows the model images, but {ckpt} is a text-only "
     "model (no vision tower): evaluate a vision-language checkpoint"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m[:30] for _, m in BAD])
def test_mistakes_are_refused_in_one_sentence(args, message, tiny_llama, pretrain_data, other_tokenizer_data,
                                              tmp_path, capsys, one_thread):
    _, ckpt = tiny_llama
    (tmp_path / "bad.yaml").write_text("task: bad\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                       "    test: absent.jsonl\noutput_type: multiple_choice\n")
    (tmp_path / "broken.jsonl").write_text('{"q": "a", "choices": ["x"], "label": 0}\n{"q": \n')
    (tmp_path / "broken.yaml").write_text((tmp_path / "bad.yaml").read_text().replace("bad", "broken").replace(
        "absent.jsonl", "broken.jsonl"))
    fill = {"prefix": pretrain_data[0], "root": tmp_path, "other": other_tokenizer_data, "ckpt": ckpt}
    out = tmp_path / "out"
    code, _, err = run_cli(["eval", ckpt, *[a.format(**fill) for a in args], "--output", out], capsys)
    assert code != 0 and message.format(**fill) in err, err
    assert "Traceback" not in err
    assert not out.exists()  # nothing written


def test_missing_checkpoint(tmp_path, capsys):
    code, _, err = run_cli(["eval", tmp_path / "nowhere", "--tasks", "megapipe_mc"], capsys)
    assert code != 0 and "does not exist" in err


def test_task_data_tool_reproduces_the_shipped_files(tmp_path):
    shipped = ROOT / "megapipe" / "eval" / "tasks"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if f"Python {version}\n" not in (shipped / "SOURCE").read_text():
        pytest.skip(f"the shipped task data was written on another Python than {version} (docstrings differ)")
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_eval_tasks.py"), "--output", str(tmp_path)],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    for name in ("megapipe_mc.jsonl", "megapipe_gen.jsonl", "megapipe_text.jsonl", "megapipe_shapes.jsonl"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name


def test_hf_directory_and_checkpoint_score_alike_and_default_output(tiny_llama, one_thread):
    """CKPT may be the HF directory itself; without --output, results go to eval_<name> beside it, whole."""
    from megapipe.eval.run import run_eval

    hf_dir, ckpt = tiny_llama
    from_hf, out = run_eval(hf_dir, "megapipe_mc", limit=5, log_samples=True)
    assert out == hf_dir.parent / "eval_hf" and (out / "results.json").is_file()
    from_ckpt, _ = run_eval(ckpt, "megapipe_mc", limit=5, log_samples=True, output=hf_dir.parent / "c")
    lls = [[r[0][0] for r in s["resps"]] for s in from_hf["samples"]["megapipe_mc"]]
    assert lls == [[r[0][0] for r in s["resps"]] for s in from_ckpt["samples"]["megapipe_mc"]]
    assert json.loads((out / "results.json").read_text())["results"] == from_hf["results"]
    assert not list(out.glob("*.tmp*"))
