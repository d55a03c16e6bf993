import json

import pytest

from megapipe.cli import main
from megapipe.data.readers import iter_texts
from megapipe.data.tokenizer import EOD_TOKEN, PAD_TOKEN, load_tokenizer
from megapipe.errors import DataError


def excerpt_texts(path):
    return list(iter_texts([path], "text"))


def test_train_cli_writes_a_directory_autotokenizer_loads(tmp_path, shakespeare_excerpt):
    from transformers import AutoTokenizer

    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(shakespeare_excerpt), "--vocab-size", "400",
                 "--output", str(out), "--quiet"]) == 0
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    ours = load_tokenizer(out)
    hf = AutoTokenizer.from_pretrained(out)
    assert len(hf) == ours.vocab_size == 400
    assert hf.convert_ids_to_tokens([0, 1]) == [EOD_TOKEN, PAD_TOKEN]
    assert (hf.eos_token_id, hf.pad_token_id) == (ours.eod_id, ours.pad_id) == (0, 1)
    texts = excerpt_texts(shakespeare_excerpt)[:20]
    assert [hf(t, add_special_tokens=False).input_ids for t in texts] == ours.encode_batch(texts)
    assert hf.decode(ours.encode(texts[3])) == texts[3]


def test_train_refuses_a_vocab_below_the_byte_alphabet(tmp_path, shakespeare_excerpt, capsys):
    assert main(["tokenizer", "train", "--input", str(shakespeare_excerpt), "--vocab-size", "100",
                 "--output", str(tmp_path / "t")]) == 2
    assert "--vocab-size 100 is too small" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_train_refuses_empty_input_and_clashing_outputs(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "file").write_text("")
    for extra, message in [
        (["--input", str(tmp_path / "empty.jsonl")], "empty.jsonl holds no text to train the tokenizer on"),
        (["--input", str(tmp_path / "empty.jsonl"), "--pad-token", "<|endoftext|>"], "are both '<|endoftext|>'"),
    ]:
        assert main(["tokenizer", "train", "--vocab-size", "300", "--output", str(tmp_path / "t"), *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(tmp_path / "empty.jsonl"), "--vocab-size", "300",
                 "--output", str(tmp_path / "file")]) == 2
    assert "tokenizer output " + str(tmp_path / "file") + " exists and is not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "file"]


def test_load_from_directory_or_file(tiny_tokenizer_dir):
    from_dir = load_tokenizer(tiny_tokenizer_dir)
    from_file = load_tokenizer(tiny_tokenizer_dir / "tokenizer.json")
    assert from_dir.path == tiny_tokenizer_dir
    assert from_file.path == tiny_tokenizer_dir / "tokenizer.json"
    assert from_dir.vocab_size == from_file.vocab_size == 512
    assert (from_dir.eod_id, from_dir.pad_id) == (0, 1)
    assert from_dir.encode("Friends, Romans") == from_file.encode("Friends, Romans")
    assert from_dir.encode(f"a{EOD_TOKEN}") == from_dir.encode("a") + [0]


def test_fast_backend_matches_hf_tokenizers_on_the_real_excerpt(tiny_tokenizer_dir, shakespeare_excerpt):
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert tok.backend == "gigatoken"
    texts = excerpt_texts(shakespeare_excerpt)
    assert any(ord(c) > 0x3000 for t in texts for c in t)  # CJK is in there
    assert any("\u0400" <= c <= "\u04ff" for t in texts for c in t)  # and Cyrillic
    ids = tok.encode_batch(texts)
    assert ids == tok.reference_encode_batch(texts)
    assert [tok.decode(i) for i in ids] == texts


def test_falls_back_to_hf_tokenizers_for_models_gigatoken_refuses(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    wl = Tokenizer(models.WordLevel({"to": 0, "be": 1, "or": 2, "not": 3, "<unk>": 4, "</s>": 5}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.add_special_tokens(["</s>"])
    wl.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.backend == "tokenizers"
    assert tok.encode_batch(["to be or not to be", "", "be quick"]) == [[0, 1, 2, 3, 0, 1], [], [1, 4]]
    assert (tok.eod_id, tok.pad_id) == (5, 5)  # no padding token: padding uses the end-of-document token


def test_save_writes_files_autotokenizer_loads(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    src = load_tokenizer(tiny_tokenizer_dir / "tokenizer.json")
    saved = src.save(tmp_path / "copy")
    assert (saved / "tokenizer.json").read_bytes() == (tiny_tokenizer_dir / "tokenizer.json").read_bytes()
    again = load_tokenizer(saved)
    assert (again.vocab_size, again.eod_id, again.pad_id) == (src.vocab_size, 0, 1)
    hf = AutoTokenizer.from_pretrained(saved)
    assert hf("Et tu, Brute?", add_special_tokens=False).input_ids == src.encode("Et tu, Brute?")


def with_specials(src, out, post_processor=None, **config):
    """A copy of the tokenizer directory ``src`` whose tokenizer.json has ``post_processor`` and whose
    tokenizer_config.json has ``config`` added."""
    import shutil

    shutil.copytree(src, out)
    if post_processor is not None:
        data = json.loads((out / "tokenizer.json").read_text())
        data["post_processor"] = post_processor
        (out / "tokenizer.json").write_text(json.dumps(data))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(cfg | config))
    return out


def test_special_tokens_are_added_as_transformers_adds_them(tmp_path, tiny_tokenizer_dir):
    """add_special_tokens=True gives AutoTokenizer's ids: none for a byte-level BPE, the post-processor's BOS where
    tokenizer.json has one (Llama 3's, and the processors transformers saved for Llama 2, Gemma, Mistral);
    tokenizer_config.json's add_bos_token / add_eos_token change nothing in transformers 5, nor here."""
    from transformers import AutoTokenizer

    bos_template = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|pad|>", "type_id": 0}},
                                                             {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {"<|pad|>": {"id": "<|pad|>", "ids": [1], "tokens": ["<|pad|>"]}}}
    cases = {
        "plain": (with_specials(tiny_tokenizer_dir, tmp_path / "plain"), ([], [])),
        "post_processor": (with_specials(tiny_tokenizer_dir, tmp_path / "post", bos_template), ([1], [])),
        "config": (with_specials(tiny_tokenizer_dir, tmp_path / "config", bos_template, add_bos_token=False,
                                 add_eos_token=True, eos_token="<|endoftext|>"), ([1], [])),
        "config_bos": (with_specials(tiny_tokenizer_dir, tmp_path / "config_bos", None, add_bos_token=True,
                                     bos_token="<|pad|>"), ([], [])),
    }
    for name, (path, added) in cases.items():
        tok, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert tok.added_tokens == added, name
        for text in ("Et tu, Brute?", "", " a"):
            assert tok.encode(text, add_special_tokens=True) == hf(text).input_ids, (name, text)
            assert tok.encode(text) == hf(text, add_special_tokens=False).input_ids, (name, text)


def test_bad_tokenizer_paths_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer .*nope does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(DataError, match=r"has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(DataError, match=r"x.json is not a Hugging Face tokenizer"):
        load_tokenizer(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{not json")
    with pytest.raises(DataError, match=r"y.json is not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "y.json")
