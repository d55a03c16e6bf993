import struct

import numpy as np
import pytest

from megapipe.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from megapipe.errors import DataError

DOCS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]


def write(prefix, docs, dtype=np.uint16, batched=False):
    with IndexedDatasetWriter(prefix, dtype) as w:
        if batched:
            w.add_documents(np.concatenate([np.array(d) for d in docs]), [len(d) for d in docs])
        else:
            for d in docs:
                w.add_document(d)
    return IndexedDataset(prefix)


def test_layout_is_megatrons(tmp_path):
    ds = write(tmp_path / "d", DOCS)
    idx = (tmp_path / "d.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", idx[9:34]) == (1, 8, 4, 5)  # version, uint16 code, sequences, doc-index entries
    sizes = np.frombuffer(idx, np.int32, 4, 34)
    pointers = np.frombuffer(idx, np.int64, 4, 34 + 16)
    doc_idx = np.frombuffer(idx, np.int64, 5, 34 + 16 + 32)
    assert sizes.tolist() == [3, 1, 2, 4]
    assert pointers.tolist() == [0, 6, 8, 12]  # byte offsets: 2 bytes per uint16 token
    assert doc_idx.tolist() == [0, 1, 2, 3, 4]
    assert len(idx) == 34 + 16 + 32 + 40
    assert (tmp_path / "d.bin").read_bytes() == np.arange(1, 11, dtype=np.uint16).tobytes()
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert (ds.num_documents, ds.num_tokens, ds.dtype) == (4, 10, np.uint16)
    assert ds.get(3, 1, 2).tolist() == [8, 9]


def test_one_by_one_batched_and_merged_writes_agree(tmp_path):
    write(tmp_path / "a", DOCS, np.int32)
    write(tmp_path / "b", DOCS, np.int32, batched=True)
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    write(tmp_path / "c", DOCS[:2], np.int32)
    with IndexedDatasetWriter(tmp_path / "m", np.int32) as w:
        w.add_dataset(tmp_path / "c")
        w.add_document(DOCS[2])
        w.add_documents(np.array(DOCS[3]), [4])
    assert (tmp_path / "m.idx").read_bytes() == (tmp_path / "a.idx").read_bytes()
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "a.bin").read_bytes()


def test_empty_dataset(tmp_path):
    ds = write(tmp_path / "e", [])
    assert (len(ds), ds.num_documents, ds.num_tokens) == (0, 0, 0)


def test_error_leaves_nothing_and_merge_checks_dtype(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([1, 2])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    write(tmp_path / "i32", DOCS, np.int32)
    with pytest.raises(DataError, match="its tokens are int32, the output's are uint16"):
        with IndexedDatasetWriter(tmp_path / "y", np.uint16) as w:
            w.add_dataset(tmp_path / "i32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i32.bin", "i32.idx"]
    # the directories made for an output that failed go too (not those that were there before)
    with pytest.raises(DataError):
        with IndexedDatasetWriter(tmp_path / "new" / "deeper" / "y", np.uint16) as w:
            w.add_dataset(tmp_path / "i32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i32.bin", "i32.idx"]


def _patch(data: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


# (what is damaged, new .idx from the good one, new .bin from the good one, the message): DOCS hold 4 sequences of
# uint16 tokens, so sizes start at byte 34, pointers at 50, the document index at 82.
DAMAGE = [
    ("idx truncated", lambda i: i[:-8], None, r"d\.idx is truncated: 114 bytes, the header promises 122"),
    ("idx trailing bytes", lambda i: i + b"\0" * 8, None, r"d\.idx has 8 bytes after the index"),
    ("bad magic", lambda i: b"NOTMAGIC!" + i[9:], None, "bad magic"),
    ("dtype byte", lambda i: _patch(i, 17, "<B", 4), None,
     r"d\.idx is inconsistent: its dtype code 4 says int32 \(4-byte tokens\), but its pointers are spaced for "
     r"2-byte tokens \(the dtype byte is wrong\)"),
    ("bin of another dtype", None, lambda b: np.frombuffer(b, np.uint16).astype(np.int32).tobytes(),
     r"d\.bin does not match .*d\.idx: the index describes 10 uint16 tokens \(20 bytes\) but the \.bin has 40 "
     r"bytes, the size of 4-byte tokens"),
    ("bin truncated", None, lambda b: b[:4], r"d\.bin does not match .*d\.idx: .* has 4 bytes \(truncated\)"),
    ("bin longer", None, lambda b: b + b"\0" * 6, r"d\.bin does not match .*the \.bin has 26 bytes \(longer than"),
    ("pointer", lambda i: _patch(i, 50 + 2 * 8, "<q", 7), None,
     r"d\.idx is inconsistent: pointer 2 is 7, but the lengths before it put sequence 2 at byte 8"),
    ("negative length", lambda i: _patch(i, 34 + 4, "<i", -1), None,
     r"d\.idx is damaged: sequence 1 has a negative length \(-1\)"),
    ("document index", lambda i: _patch(i, 82 + 4 * 8, "<q", 9), None,
     r"d\.idx has a malformed document index: it must rise from 0 to the sequence count 4, found 5 entries from "
     r"0 to 9"),
]


def test_missing_files_are_named(tmp_path):
    with pytest.raises(DataError, match=r"nothing\.idx does not exist"):
        IndexedDataset(tmp_path / "nothing")


@pytest.mark.parametrize("what,idx,bin_,message", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_an_inconsistent_pair_names_the_file_and_what_disagrees(tmp_path, what, idx, bin_, message):
    """Each damage is read as garbage without the consistency checks (every case keeps the header readable)."""
    write(tmp_path / "d", DOCS)
    for suffix, change in ((".idx", idx), (".bin", bin_)):
        if change is not None:
            path = tmp_path / f"d{suffix}"
            path.write_bytes(change(path.read_bytes()))
    with pytest.raises(DataError, match=message):
        IndexedDataset(tmp_path / "d")


def test_optimal_dtype_is_megatrons():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(None) is np.int32


def test_unwritable_output_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"cannot write the dataset .*file/x\.bin/\.idx"):
        IndexedDatasetWriter(tmp_path / "file" / "x", np.uint16)
