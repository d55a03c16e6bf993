import csv
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megapipe.cli import main
from megapipe.data.indexed import IndexedDataset
from megapipe.data.preprocess import preprocess
from megapipe.data.readers import _PipeReader, iter_texts
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import DataError, MegapipeError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def texts(shakespeare_excerpt):
    return list(iter_texts([shakespeare_excerpt], "text"))


def run(tmp_path, inputs, tokenizer_dir, *extra, name="out", quiet=True):
    """The CLI; returns (exit code, output prefix of the text key)."""
    prefix = tmp_path / name
    args = ["preprocess", "--input", *map(str, inputs), "--output-prefix", str(prefix),
            "--tokenizer", str(tokenizer_dir), *(["--quiet"] if quiet else []), *extra]
    return main(args), f"{prefix}_text_document"


def read_bytes(prefix):
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def test_round_trip_decodes_every_document(tmp_path, tiny_tokenizer_dir, shakespeare_excerpt, tok, texts, capsys):
    code, prefix = run(tmp_path, [shakespeare_excerpt], tiny_tokenizer_dir, "--append-eod", quiet=False)
    assert code == 0
    out, err = capsys.readouterr()
    assert re.search(r"100% .*docs/s .*tok/s .*MB/s", err), err  # the progress bar's last state
    for row in ("documents +│ 189 ", "tokens +│ [0-9,]+ ", "input +│ 0.[0-9]+ MB", "skipped records +│ 0 ",
                r"time +│ [0-9.]+ s"):
        assert re.search(row, out), (row, out)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert ds.num_documents == len(ds) == len(texts) == 189
    for i, text in enumerate(texts):
        ids = ds[i]
        assert ids[-1] == tok.eod_id and tok.eod_id not in ids[:-1] or "<|endoftext|>" in text
        assert tok.decode(ids[:-1]) == text
    assert ds.num_tokens == sum(len(x) + 1 for x in tok.encode_batch(texts))


def test_megatron_core_reads_what_we_write(tmp_path, tiny_tokenizer_dir, shakespeare_excerpt, tok, texts,
                                           megatron_indexed):
    code, prefix = run(tmp_path, [shakespeare_excerpt], tiny_tokenizer_dir, "--append-eod")
    assert code == 0
    theirs = megatron_indexed.IndexedDataset(prefix)
    assert len(theirs) == len(texts)
    assert np.array_equal(theirs.document_indices, np.arange(len(texts) + 1))
    expected = [ids + [tok.eod_id] for ids in tok.encode_batch(texts)]
    for i, ids in enumerate(expected):
        assert theirs[i].tolist() == ids


def test_we_read_what_megatron_core_writes_byte_for_byte(tmp_path, tiny_tokenizer_dir, shakespeare_excerpt, tok,
                                                         texts, megatron_indexed):
    import torch

    IndexedDatasetBuilder = megatron_indexed.IndexedDatasetBuilder

    docs = [ids + [tok.eod_id] for ids in tok.encode_batch(texts)]
    theirs = tmp_path / "megatron"
    builder = IndexedDatasetBuilder(f"{theirs}.bin", dtype=np.uint16)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(f"{theirs}.idx")
    code, ours = run(tmp_path, [shakespeare_excerpt], tiny_tokenizer_dir, "--append-eod")
    assert code == 0
    assert read_bytes(theirs) == read_bytes(ours)

    # documents of several sequences (Megatron's sentence split) read back too
    multi = tmp_path / "multi"
    builder = IndexedDatasetBuilder(f"{multi}.bin", dtype=np.int32)
    builder.add_item(torch.tensor([5, 6, 7]))
    builder.add_item(torch.tensor([8]))
    builder.end_document()
    builder.add_document(torch.tensor([9, 10]), [2])
    builder.finalize(f"{multi}.idx")
    ds = IndexedDataset(multi)
    assert (ds.dtype, len(ds), ds.num_documents) == (np.int32, 3, 2)
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert [ds[i].tolist() for i in range(3)] == [[5, 6, 7], [8], [9, 10]]
    assert ds.get(0, 1, 2).tolist() == [6, 7]


def test_output_is_identical_for_one_and_two_workers_and_either_backend(tmp_path, tok, shakespeare_excerpt,
                                                                         monkeypatch):
    monkeypatch.setenv("MEGAPIPE_TOKENIZER_BACKEND", "tokenizers")
    reference = load_tokenizer(tok.path)
    assert (tok.backend, reference.backend) == ("gigatoken", "tokenizers")
    outputs = []
    for t, workers, block in [(tok, 1, None), (tok, 1, 2048), (tok, 2, 2048), (tok, 2, None), (reference, 2, 4096)]:
        prefix = tmp_path / f"w{workers}_{block}_{t.backend}"
        stats = preprocess([str(shakespeare_excerpt)], prefix, t, append_eod=True, workers=workers, block_bytes=block)
        assert stats.documents == 189 and stats.skipped == 0
        outputs.append(read_bytes(f"{prefix}_text_document"))
    assert all(o == outputs[0] for o in outputs[1:])


def test_several_inputs_globs_gzip_parquet_and_datasets_give_the_same_bytes(tmp_path, tiny_tokenizer_dir,
                                                                          shakespeare_excerpt):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = shakespeare_excerpt.read_bytes().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(b"".join(lines[:100]))
    (src / "b.jsonl").write_bytes(b"".join(lines[100:]))
    (src / "all.jsonl.gz").write_bytes(gzip.compress(shakespeare_excerpt.read_bytes()))
    pq.write_table(pa.Table.from_pylist(records), src / "all.parquet", row_group_size=50)
    datasets.Dataset.from_list(records).save_to_disk(str(src / "saved"))
    with open(src / "all.csv", "w", newline="", encoding="utf-8") as f:
        csv.DictWriter(f, ["text", "source"]).writerows([{"text": "text", "source": "source"}, *records])
    code, reference = run(tmp_path, [shakespeare_excerpt], tiny_tokenizer_dir, name="ref")
    assert code == 0
    for i, inputs in enumerate([[src / "a.jsonl", src / "b.jsonl"], [src / "[ab].jsonl"], [src / "all.jsonl.gz"],
                                [src / "all.parquet"], [src / "saved"], [src / "all.csv"]]):
        code, prefix = run(tmp_path, inputs, tiny_tokenizer_dir, name=f"o{i}")
        assert code == 0, inputs
        assert read_bytes(prefix) == read_bytes(reference), inputs


def test_several_json_keys_write_one_dataset_each(tmp_path, tok, shakespeare_excerpt):
    prefix = tmp_path / "k"
    assert main(["preprocess", "--input", str(shakespeare_excerpt), "--json-keys", "text", "source",
                 "--output-prefix", str(prefix), "--tokenizer", str(tok.path), "--quiet"]) == 0
    records = [json.loads(line) for line in shakespeare_excerpt.read_text().splitlines()]
    source = IndexedDataset(f"{prefix}_source_document")
    assert [tok.decode(source[i]) for i in range(len(source))] == [r["source"] for r in records]
    text = IndexedDataset(f"{prefix}_text_document")
    assert [tok.decode(text[i]) for i in range(len(text))] == [r["text"] for r in records]


def test_several_values_follow_one_flag_megatron_style():
    from stages.common import spread_multi_values

    names = {"--input", "--json-keys"}
    assert spread_multi_values(["--input", "a", "b", "--append-eod", "--json-keys=x", "y", "--workers", "2", "z"],
                               names) == ["--input", "a", "--input", "b", "--append-eod", "--json-keys=x",
                                          "--json-keys", "y", "--workers", "2", "z"]


def test_int32_tokens_for_vocabularies_of_65500_and_more(tmp_path, megatron_indexed):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70000)}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.jsonl").write_text('{"text": "w69999 w3"}\n{"text": "w65535 w65536"}\n')
    code, prefix = run(tmp_path, [tmp_path / "in.jsonl"], tmp_path / "tokenizer.json", "--workers", "2")
    assert code == 0
    theirs = megatron_indexed.IndexedDataset(prefix)
    assert theirs[0].dtype == np.int32
    assert [theirs[0].tolist(), theirs[1].tolist()] == [[69999, 3], [65535, 65536]]


def test_empty_documents_are_left_out_like_megatron(tmp_path, tok):
    (tmp_path / "in.jsonl").write_text('{"text": "To be"}\n{"text": ""}\n\n{"text": "or not"}\n')
    stats = preprocess([str(tmp_path / "in.jsonl")], tmp_path / "e", tok, append_eod=True)
    ds = IndexedDataset(stats.outputs["text"])
    assert (stats.documents, stats.empty, len(ds)) == (3, 1, 2)
    assert [tok.decode(ds[i]) for i in range(2)] == ["To be<|endoftext|>", "or not<|endoftext|>"]


BAD_LINES = [
    (b'{"text": "broken\n', r"in\.jsonl:2: the record is not valid JSON \(Unterminated string"),
    (b'{"body": "no text"}\n', r"in\.jsonl:2: the record has no key 'text' \(its keys: body\)"),
    (b'{"text": 17}\n', r"in\.jsonl:2: the record has a number under 'text', not a string"),
    (b'{"text": null}\n', r"in\.jsonl:2: the record has a null under 'text', not a string"),
    (b'["text"]\n', r"in\.jsonl:2: the record is a JSON array, not an object"),
    (b'{"text": "caf\xe9"}\n', r"in\.jsonl:2: the record is not valid UTF-8 \(byte 0xe9"),
    (b'{"text": "lone \\ud800 surrogate"}\n', r"in\.jsonl:2: the record has text under 'text' that is not valid"),
    (b'{"text": "x", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b'}\n',
     r"in\.jsonl:2: the record is nested too deeply to read"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES,
                         ids=["json", "key", "number", "null", "array", "utf8", "surrogate", "nesting"])
def test_a_bad_record_is_one_clear_error_and_leaves_nothing(tmp_path, tiny_tokenizer_dir, capsys, bad, message):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "Good morrow"}\n' + bad + b'{"text": "Good night"}\n')
    out = tmp_path / "out"
    out.mkdir()
    code, _ = run(out, [src], tiny_tokenizer_dir, quiet=False)
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1  # the progress bar is gone: only the error line remains
    assert re.search(message, err), err
    assert "--skip-bad-records" in err
    assert list(out.iterdir()) == []


def test_skip_bad_records_skips_and_counts_them(tmp_path, tok):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "first"}\n' + b"".join(bad for bad, _ in BAD_LINES) + b'{"text": "last"}\n')
    stats = preprocess([str(src)], tmp_path / "s", tok, skip_bad_records=True)
    assert (stats.documents, stats.skipped) == (2, len(BAD_LINES))
    assert stats.skipped_examples[0].endswith("in.jsonl:2: is not valid JSON (Unterminated string starting at "
                                              "column 10)")
    ds = IndexedDataset(stats.outputs["text"])
    assert [tok.decode(ds[i]) for i in range(len(ds))] == ["first", "last"]
    assert main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "c"), "--tokenizer",
                 str(tok.path), "--skip-bad-records", "--quiet"]) == 0


@pytest.mark.parametrize("name,content,message", [
    ("missing.jsonl", None, r"input file .*missing\.jsonl does not exist"),
    ("nothing*.jsonl", None, r"input pattern .*nothing\*\.jsonl matches no file"),
    ("corrupt.jsonl.gz", b"not gzip at all\n", r"cannot read input file .*corrupt\.jsonl\.gz \(Not a gzipped file"),
    ("cols.parquet", "parquet", r"input .*cols\.parquet has no column 'text' \(its columns: body\)"),
    ("cols.csv", b"body,n\nx,1\n", r"input .*cols\.csv has no column 'text' \(its columns: body, n\)"),
    ("empty.jsonl", b"\n\n", r"the input \(.*empty\.jsonl\) holds no records: nothing to write"),
    ("blank.jsonl", b'{"text": ""}\n', r"every one of the 1 records has empty text under text: nothing to write"),
    ("p_text_document.bin", "directory", r"cannot write the dataset .*p_text_document\.bin is a directory"),
])
def test_unreadable_inputs_are_one_clear_error(tmp_path, tiny_tokenizer_dir, capsys, name, content, message):
    if content == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["x"]}), tmp_path / name)
    elif content == "directory":  # in the way of the output; the input is fine
        (tmp_path / "out" / name).mkdir(parents=True)
        name = "good.jsonl"
        (tmp_path / name).write_text('{"text": "Good morrow"}\n')
    elif content is not None:
        (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    before = sorted(out.iterdir())
    code, _ = run(out, [tmp_path / name], tiny_tokenizer_dir, name="p")
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(message, err), err
    assert len(err.strip().splitlines()) == 1
    assert sorted(out.iterdir()) == before


def test_every_record_skipped_is_an_error(tmp_path, tok):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"body": 1}\n[2]\n')
    with pytest.raises(DataError, match=r"every one of the 2 records was bad and skipped \(e\.g\. .*in\.jsonl:1: "
                                        r"has no key 'text'"):
        preprocess([str(src)], tmp_path / "s", tok, skip_bad_records=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_name_that_is_no_local_path_is_looked_up_on_the_hub(tmp_path, tok, monkeypatch):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # never resolves (RFC 2606)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError, match=r"input someone/corpus is not a local path, and the Hugging Face hub "
                                        r"\(hub\.invalid\) cannot be reached"):
        preprocess(["someone/corpus"], tmp_path / "h", tok)
    with pytest.raises(DataError, match=r"input file someone/corpus\.jsonl does not exist"):
        preprocess(["someone/corpus.jsonl"], tmp_path / "h", tok)
    assert list(tmp_path.iterdir()) == []


def test_a_failure_after_many_blocks_leaves_nothing(tmp_path, tok, shakespeare_excerpt):
    src = tmp_path / "in.jsonl"
    src.write_bytes(shakespeare_excerpt.read_bytes() + b'{"text": 1}\n')
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=r"in\.jsonl:190: "):
        preprocess([str(src)], out / "p", tok, workers=2, block_bytes=1024)
    assert list(out.iterdir()) == []


def _die_on_late_blocks(block):
    from megapipe.data import preprocess as pp

    if block.first > 100:
        os._exit(9)  # as if killed for memory
    return pp._encode_block_unpatched(block)


def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path, tok, shakespeare_excerpt, monkeypatch):
    from megapipe.data import preprocess as pp

    monkeypatch.setattr(pp, "_encode_block_unpatched", pp._encode_block, raising=False)
    monkeypatch.setattr(pp, "_encode_block", _die_on_late_blocks)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(MegapipeError, match=r"a preprocess worker process died \(out of memory\? killed\?\)"):
        preprocess([str(shakespeare_excerpt)], out / "p", tok, workers=2, block_bytes=2048)
    assert list(out.iterdir()) == []


def test_a_read_from_a_silent_pipe_gives_way_to_a_signal():
    """Reads through the pipe wrapper return the data, and a wait on a silent pipe lets a signal's handler raise."""
    r, w = os.pipe()

    def handler(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with open(r, "rb", buffering=0) as raw, open(w, "wb", buffering=0) as writer:
            reader = _PipeReader(raw, poll=0.05)
            writer.write(b"abc")
            assert reader.read(10) == b"abc"
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                reader.read(10)
            assert time.monotonic() - start < 5
            writer.write(b"de")
            assert reader.read(10) == b"de"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _threads_of(proc) -> str:
    """A hung child's threads (state, kernel wait, signal masks) and its stderr, then the child is killed."""
    lines = [f"parent's blocked signals: {sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}"]
    for task in sorted(Path(f"/proc/{proc.pid}/task").iterdir()):
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        wchan = (task / "wchan").read_text() if (task / "wchan").exists() else "?"
        lines.append(f"thread {task.name} {status.get('Name')} {status.get('State')} wchan={wchan} "
                     + " ".join(f"{k}={status.get(k)}" for k in ("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")))
    if shutil.which("py-spy"):  # Python stacks, when the tool is at hand
        lines.append(subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True, text=True).stdout)
    proc.kill()
    lines.append("stderr: " + proc.stderr.read()[-3000:])
    return "\n".join(lines)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_an_interrupted_run_leaves_nothing(tmp_path, tiny_tokenizer_dir, sig):
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "megapipe.cli", "preprocess", "--input", str(fifo), "--output-prefix",
           str(out / "p"), "--tokenizer", str(tiny_tokenizer_dir), "--workers", "2", "--quiet"]
    # Ctrl-C's default action in the child, as a terminal gives it: a shell's background job (CI, nohup ... &)
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    with open(fifo, "w") as writer:  # the run blocks reading this pipe until we close it
        writer.write('{"text": "Now is the winter of our discontent"}\n' * 5000)
        writer.flush()
        deadline = time.time() + 60
        while not any(out.iterdir()) and time.time() < deadline:  # its temporaries exist: it is mid-run
            time.sleep(0.05)
        assert any(".tmp-" in p.name for p in out.iterdir())
        proc.send_signal(sig)
        try:
            assert proc.wait(timeout=60) != 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"{sig.name} did not stop the run within 60 s; {_threads_of(proc)}")
    assert list(out.iterdir()) == []
    assert "Traceback" not in proc.stderr.read()


def test_merge_and_inspect(tmp_path, tiny_tokenizer_dir, shakespeare_excerpt, texts, capsys):
    lines = shakespeare_excerpt.read_bytes().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_bytes(b"".join(lines[:70]))
    (tmp_path / "b.jsonl").write_bytes(b"".join(lines[70:]))
    _, a = run(tmp_path, [tmp_path / "a.jsonl"], tiny_tokenizer_dir, "--append-eod", name="a")
    _, b = run(tmp_path, [tmp_path / "b.jsonl"], tiny_tokenizer_dir, "--append-eod", name="b")
    _, whole = run(tmp_path, [shakespeare_excerpt], tiny_tokenizer_dir, "--append-eod", name="whole")
    assert main(["data", "merge", "--input", a, b + ".bin", "--output-prefix", str(tmp_path / "m"), "-q"]) == 0
    assert read_bytes(tmp_path / "m") == read_bytes(whole)

    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "m"), "--tokenizer", str(tiny_tokenizer_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    ds = IndexedDataset(whole)
    assert (info["documents"], info["sequences"], info["tokens"], info["dtype"]) == (189, 189, ds.num_tokens,
                                                                                     "uint16")
    assert info["max_length"] == int(ds.sizes.max())
    assert (texts[0] + "<|endoftext|>").startswith(info["sample"])
    assert main(["data", "inspect", str(tmp_path / "m")]) == 0
    assert "documents" in capsys.readouterr().out

    assert main(["data", "merge", "--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "dataset " + str(tmp_path / "nope") + " has no" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists()


def test_blocks_cut_at_line_ends_whatever_the_line_lengths(tmp_path):
    from megapipe.data.readers import iter_blocks, parse_block

    texts = ["x" * n for n in (0, 1, 70000, 5, 3000, 100, 0, 9)] + ["no newline at the end"]
    data = "\n".join(json.dumps({"text": t}) for t in texts).encode()
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(data))
    for name in ("a.jsonl", "a.jsonl.gz"):
        path = tmp_path / name
        for block_bytes in (7, 1000, 1 << 20):
            blocks = list(iter_blocks([path], ["text"], block_bytes))
            parsed = [parse_block(b, ["text"], skip_bad=False) for b in blocks]
            assert [t for p in parsed for t in p[0][0]] == texts
            assert [n for p in parsed for n in p[1]] == list(range(1, len(texts) + 1))
            assert sum(b.nbytes for b in blocks) == path.stat().st_size


@pytest.mark.parametrize("line, message", [
    (b'{"text": "caf\xe9"}', "byte 0xe9 at offset 13 begins a multi-byte character, but byte 0x22 at offset 14 does "
                             "not continue it"),
    (b'{"text": "abc \xe2\x82 x"}', "byte 0xe2 at offset 14 begins a multi-byte character, but byte 0x20 at offset "
                                    "16 does not continue it (after e2 82)"),
    (b'{"text": "ok \xff"}', "byte 0xff at offset 13 cannot start a character"),
    (b'{"text": "x"} \xf0\x9f', "byte 0xf0 at offset 14 begins a multi-byte character that the end of the line cuts off"),
    (b'{\x00"text": "\xff"}', "byte 0xff at offset 11 cannot start a character"),  # NUL: json would guess UTF-16
])
def test_invalid_utf8_names_the_offending_byte_and_its_offset(tmp_path, tok, line, message):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "fine"}\n' + line + b"\n")
    with pytest.raises(DataError) as e:
        preprocess([str(src)], tmp_path / "o", tok)
    assert f"in.jsonl:2: the record is not valid UTF-8 ({message})" in str(e.value)


def test_a_directory_input_names_the_file_inside_that_failed(tmp_path, tok):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text('{"text": "one"}\n')
    (d / "sub" / "b.jsonl").write_text('{"text": "two"}\n{"text": broken\n')
    (d / ".hidden.jsonl").write_text("not read\n")
    with pytest.raises(DataError, match=r"corpus/sub/b\.jsonl:2: the record is not valid JSON"):
        preprocess([str(d)], tmp_path / "o", tok)
    (d / "sub" / "b.jsonl").write_text('{"text": "two"}\n')
    stats = preprocess([str(d)], tmp_path / "o", tok)
    ds = IndexedDataset(stats.outputs["text"])
    assert [tok.decode(ds[i]) for i in range(len(ds))] == ["one", "two"]


def test_workers_have_a_sane_bound(tmp_path, tok, shakespeare_excerpt):
    from megapipe.data.preprocess import available_cpus

    limit = 4 * available_cpus()
    for workers, message in [(0, "--workers must be at least 1, got 0"),
                             (limit + 1, f"--workers {limit + 1} is more than 4 per CPU ({available_cpus()} CPUs "
                                         f"here, so at most {limit})")]:
        with pytest.raises(DataError) as e:
            preprocess([str(shakespeare_excerpt)], tmp_path / "o", tok, workers=workers)
        assert message in str(e.value)
    assert not list(tmp_path.iterdir())
