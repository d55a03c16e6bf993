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


def test_damaged_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match=r"nothing\.idx does not exist"):
        IndexedDataset(tmp_path / "nothing")
    write(tmp_path / "d", DOCS)
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(idx[:-8])
    with pytest.raises(DataError, match="is truncated"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"NOTMAGIC!" + idx[9:])
    with pytest.raises(DataError, match="bad magic"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(idx)
    (tmp_path / "d.bin").write_bytes(b"\x00" * 4)
    with pytest.raises(DataError, match=r"d\.bin is truncated"):
        IndexedDataset(tmp_path / "d")


def test_optimal_dtype_is_megatrons():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(None) is np.int32


def test_unwritable_output_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"cannot write the dataset .*file/x\.bin/\.idx"):
        IndexedDatasetWriter(tmp_path / "file" / "x", np.uint16)
