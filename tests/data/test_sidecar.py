"""The tokenizer sidecar ``PREFIX.megapipe.json``: written by preprocess and merge, read by the tokenizer check,
invisible to Megatron's reader; merge refuses to mix tokenizers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from megapipe.cli import main
from megapipe.data.indexed import IndexedDataset, IndexedDatasetWriter
from megapipe.data.preprocess import merge_datasets, preprocess
from megapipe.data.sidecar import check_data_tokenizer, read_sidecar, recorded_tokenizer, sidecar_path
from megapipe.data.tokenizer import load_tokenizer, train_tokenizer
from megapipe.errors import DataError


@pytest.fixture(scope="module")
def two(tmp_path_factory, tiny_tokenizer_dir, shakespeare_excerpt):
    """The excerpt tokenized with the tiny tokenizer (a) and with another one (b, 600 ids)."""
    from megapipe.data.readers import iter_texts

    root = tmp_path_factory.mktemp("sidecar")
    other = train_tokenizer(iter_texts([shakespeare_excerpt], "text"), 600, root / "tok600")
    tok = load_tokenizer(tiny_tokenizer_dir)
    a = preprocess([str(shakespeare_excerpt)], root / "a", tok, append_eod=True).outputs["text"]
    b = preprocess([str(shakespeare_excerpt)], root / "b", other).outputs["text"]
    return root, tok, other, a, b


def test_preprocess_records_the_tokenizer_and_megatron_reads_the_pair_unchanged(two, megatron_indexed):
    _, tok, other, a, _ = two
    body = json.loads(sidecar_path(a).read_text())
    assert body["format"] == "megapipe-dataset" and body["json_key"] == "text" and body["append_eod"] is True
    assert body["tokenizer"]["fingerprint"] == tok.fingerprint != other.fingerprint
    assert body["tokenizer"]["vocab_size"] == 512 and body["tokenizer"]["source"] == str(tok.path.absolute())
    ours, theirs = IndexedDataset(a), megatron_indexed.IndexedDataset(a)
    assert len(theirs) == len(ours) and all(np.array_equal(theirs[i], ours[i]) for i in range(len(ours)))


def test_the_fingerprint_follows_what_the_tokenizer_does_not_how_it_was_saved(two, tmp_path):
    _, tok, _, _, _ = two
    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps(json.loads((tok.path / "tokenizer.json").read_text())))  # other bytes, same tokenizer
    assert load_tokenizer(compact).fingerprint == tok.fingerprint
    assert load_tokenizer(tok.save(tmp_path / "copy")).fingerprint == tok.fingerprint
    changed = json.loads((tok.path / "tokenizer.json").read_text())
    changed["model"]["merges"] = changed["model"]["merges"][:-50]  # same vocabulary, other merges
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    assert load_tokenizer(tmp_path / "changed.json").fingerprint != tok.fingerprint


def test_check_data_tokenizer(two, tmp_path):
    _, tok, other, a, b = two
    assert check_data_tokenizer([a], tok) == []
    with pytest.raises(DataError, match=rf"data {b} was tokenized with tokenizer .*tok600 \(600 tokens\), not with "
                                        rf".* \(512 tokens\).*--allow-tokenizer-mismatch"):
        check_data_tokenizer([a, b], tok)
    megatron_made = tmp_path / "m"  # a pair without a sidecar: unknown, reported for a warning
    for suffix in (".bin", ".idx"):
        shutil.copy(a + suffix, f"{megatron_made}{suffix}")
    assert check_data_tokenizer([megatron_made, a], tok) == [str(megatron_made)]


def test_a_sidecar_that_no_longer_describes_its_pair_is_ignored(two, tmp_path, caplog):
    _, tok, _, a, _ = two
    p = tmp_path / "p"
    for suffix in (".bin", ".idx", ".megapipe.json"):
        shutil.copy(a + suffix, f"{p}{suffix}")
    assert recorded_tokenizer(p)["fingerprint"] == tok.fingerprint
    with IndexedDatasetWriter(f"{p}.other", np.uint16) as w:  # another tool rewrites the pair in place
        w.add_document([1, 2, 3])
    for suffix in (".bin", ".idx"):
        shutil.move(f"{p}.other{suffix}", f"{p}{suffix}")
    assert read_sidecar(p) is None and "describes other files" in caplog.text
    (tmp_path / "p.megapipe.json").write_text("{not json")
    with pytest.raises(DataError, match=r"p\.megapipe\.json is not valid JSON"):
        read_sidecar(p)


def test_rewriting_a_prefix_replaces_or_removes_its_sidecar(two, tmp_path):
    _, tok, _, a, _ = two
    p = tmp_path / "p"
    for suffix in (".bin", ".idx", ".megapipe.json"):
        shutil.copy(a + suffix, f"{p}{suffix}")
    with IndexedDatasetWriter(p, np.uint16) as w:  # no sidecar given: the old one must not survive
        w.add_document([1, 2])
    assert not sidecar_path(p).exists()


def test_merge_records_a_shared_tokenizer_and_refuses_two(two, tmp_path, capsys):
    _, tok, _, a, b = two
    copy = tmp_path / "a2"
    for suffix in (".bin", ".idx", ".megapipe.json"):
        shutil.copy(a + suffix, f"{copy}{suffix}")
    merged = merge_datasets([a, str(copy)], tmp_path / "aa")
    assert merged.num_documents == 2 * IndexedDataset(a).num_documents
    body = read_sidecar(tmp_path / "aa")
    assert body["tokenizer"]["fingerprint"] == tok.fingerprint and body["merged_from"] == [a, str(copy)]
    code = main(["data", "merge", "--input", a, b, "--output-prefix", str(tmp_path / "ab"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot merge {b} with {a}" in err and "--allow-mixed-tokenizers" in err, err
    assert not list(tmp_path.glob("ab*"))
    assert main(["data", "merge", "--input", a, b, "--output-prefix", str(tmp_path / "ab"), "-q",
                 "--allow-mixed-tokenizers"]) == 0
    assert read_sidecar(tmp_path / "ab")["tokenizer"] is None  # neither tokenizer describes the merge


def test_inspect_shows_the_tokenizer_and_refuses_to_decode_with_another(two, capsys):
    _, tok, other, a, _ = two
    assert main(["data", "inspect", "--json", a]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] == f"{tok.path.absolute()} (512 tokens)"
    assert main(["data", "inspect", a, "--tokenizer", str(other.path)]) == 2
    assert "was tokenized with tokenizer" in capsys.readouterr().err
