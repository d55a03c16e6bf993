"""SFT data: record shapes and their errors (file:line), chat templates, the assistant mask from the rendered
text's offsets, the input formats, the cached index, packing, and ``megapipe data inspect-sft``."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from megapipe.cli import main
from megapipe.data.sft import ChatEncoder, iter_records, parse_record
from megapipe.data.sft_dataset import build_sft_datasets, pack_best_fit, prepare_sft_index
from megapipe.errors import DataError
from tests.helpers.sft import CHAT_SET, train_chat_tokenizer

SMOLLM2 = Path.home() / ".cache/megapipe/smollm2"
CHAT = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "ANSWER: 5"},
    {"role": "user", "content": "And 4 plus 4?"}, {"role": "assistant", "content": "ANSWER: 8"},
]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return train_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def trained_text(encoder: ChatEncoder, record: dict) -> str:
    ids, trained = encoder.encode(parse_record(record, "x:1"))
    return encoder.hf.decode(ids[trained])


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_mask_covers_the_assistant_turns_and_their_end_tokens(tok):
    enc = ChatEncoder(tok, "chatml")
    ids, trained = enc.encode(parse_record(CHAT, "x:1"))
    assert enc.hf.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 3?"
                                  "<|im_end|>\n<|im_start|>assistant\nANSWER: 5<|im_end|>\n<|im_start|>user\nAnd 4 "
                                  "plus 4?<|im_end|>\n<|im_start|>assistant\nANSWER: 8<|im_end|>\n")
    assert enc.hf.decode(ids[trained]) == "ANSWER: 5<|im_end|>\nANSWER: 8<|im_end|>\n"
    # the ids are those of the whole rendered text (never fragments tokenized apart)
    assert ids.tolist() == enc.hf(enc.render(CHAT["messages"]), add_special_tokens=False)["input_ids"]
    weighted = {"messages": [*CHAT["messages"][:3], {**CHAT["messages"][3]}, {**CHAT["messages"][4], "weight": 0}]}
    assert trained_text(enc, weighted) == "ANSWER: 5<|im_end|>\n"
    assert ChatEncoder(tok, "chatml", train_on_prompt=True).encode(parse_record(CHAT, "x:1"))[1].all()


def test_prompt_completion_text_and_tool_records(tok):
    enc = ChatEncoder(tok, "chatml")
    assert trained_text(enc, {"prompt": "2 plus 3 =", "completion": " 5"}) == " 5<|im_end|>"  # the end-of-document token: the tokenizer's eos
    assert trained_text(enc, {"text": "plain text"}) == "plain text<|im_end|>"
    conv = {"prompt": CHAT["messages"][:2], "completion": CHAT["messages"][2:3]}
    assert trained_text(enc, conv) == "ANSWER: 5<|im_end|>\n"
    tools = {"tools": [{"type": "function", "function": {"name": "add"}}], "messages": [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "content": "5"}, {"role": "assistant", "content": "ANSWER: 5"}]}
    text = trained_text(enc, tools)
    assert text.startswith("\n<tool_call>\n{") and '"add"' in text and text.endswith("ANSWER: 5<|im_end|>\n")
    assert '"name": "add"' in enc.render(tools["messages"], tools["tools"])  # the tool list goes to the template


def test_templates_own_builtin_file_and_their_errors(tok, tmp_path):
    with pytest.raises(DataError,
                       match="has no chat template: pass --chat-template chatml, llama3, harmony or a FILE.jinja"):
        ChatEncoder(tok).encode(parse_record(CHAT, "data.jsonl:3"))
    with pytest.raises(DataError, match="--chat-template llama3 needs the special token <\\|begin_of_text\\|>"):
        ChatEncoder(tok, "llama3")
    with pytest.raises(DataError, match="'vicuna' is neither a known template nor a file"):
        ChatEncoder(tok, "vicuna")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(DataError, match=f"{bad}:2: the chat template is not valid Jinja"):
        ChatEncoder(tok, str(bad))
    good = tmp_path / "mine.jinja"
    good.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    assert trained_text(ChatEncoder(tok, str(good)), CHAT) == "ANSWER: 5<|im_end|>ANSWER: 8<|im_end|>"
    # a template that rewrites earlier turns once later ones follow cannot be masked from its offsets
    moving = tmp_path / "moving.jinja"
    moving.write_text("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match="x:1: the chat template .* does not render this conversation turn by turn"):
        trained_text(ChatEncoder(tok, str(moving)), CHAT)


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(), reason="SmolLM2 not prepared (tools/prepare_smollm2.py)")
def test_a_real_tokenizers_own_template():
    enc = ChatEncoder(SMOLLM2)
    assert enc.template_name == "tokenizer"
    assert trained_text(enc, CHAT) == "ANSWER: 5<|im_end|>\nANSWER: 8<|im_end|>\n"
    # SmolLM2's template adds its default system prompt: not trained
    no_system = {"messages": CHAT["messages"][1:3]}
    assert "You are a helpful AI assistant" in enc.render(no_system["messages"])
    assert trained_text(enc, no_system) == "ANSWER: 5<|im_end|>\n"


BAD_RECORDS = [
    ('{"messages": [', "data.jsonl:2: the record is not valid JSON"),
    ("[1, 2]", "data.jsonl:2: the record is a JSON array, not an object"),
    ('{"input": "x"}', "data.jsonl:2: the record has no 'messages', 'prompt'/'completion' or 'text' key (its keys: input)"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "data.jsonl:2: messages[0].role = 'bot' is not one of"),
    ('{"messages": [{"role": "user", "content": 3}]}', "data.jsonl:2: messages[0].content is a number, not a string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "data.jsonl:2: the conversation has no assistant message"),
    ('{"messages": []}', "data.jsonl:2: 'messages' is an empty list, not a list of messages"),
    ('{"prompt": "a"}', "data.jsonl:2: the record has 'prompt' but no 'completion'"),
    ('{"prompt": "a", "completion": ["b"]}', "data.jsonl:2: 'prompt' and 'completion' must both be strings or both"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 2}]}',
     "data.jsonl:2: messages[1].weight = 2 must be 0 or 1"),
    ('{"text": 7}', "data.jsonl:2: 'text' is a number, not a string"),
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "data.jsonl:2: the record is nested too deeply to read"),
    ('{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok"}]}',
     "data.jsonl:2: the record holds a lone UTF-16 surrogate escape"),
]


@pytest.mark.parametrize("line, message", BAD_RECORDS, ids=[m.split(": ", 1)[1][:40] for _, m in BAD_RECORDS])
def test_a_bad_record_names_file_line_and_key(tok, tmp_path, line, message):
    path = write_jsonl(tmp_path / "data.jsonl", [CHAT, line, CHAT])
    enc = ChatEncoder(tok, "chatml")
    with pytest.raises(DataError) as e:
        prepare_sft_index([str(path)], enc, cache_dir=str(tmp_path / "cache"))
    assert str(e.value).startswith(str(tmp_path / message)) and "pass --skip-bad-records" in str(e.value)
    assert not any((tmp_path / "cache").glob("*sft-*"))  # nothing half-written left behind
    index = prepare_sft_index([str(path)], enc, skip_bad=True, cache_dir=str(tmp_path / "cache"))
    assert (index.num_conversations, index.meta["bad_records"]) == (2, 1)
    assert index.meta["bad_examples"][0].startswith(str(tmp_path / message))


def test_a_missing_chat_template_is_a_setup_error_even_when_skipping_bad_records(tok, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "plain"}, CHAT])
    for skip in (False, True):
        with pytest.raises(DataError) as e:
            prepare_sft_index([str(path)], ChatEncoder(tok), skip_bad=skip, cache_dir=str(tmp_path / "cache"))
        assert "has no chat template: pass --chat-template" in str(e.value)
        assert "--skip-bad-records" not in str(e.value)
    assert not any((tmp_path / "cache").glob("*sft-*"))


def test_jsonl_gz_parquet_and_saved_datasets_give_the_same_index(tok, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in CHAT_SET.read_text().splitlines()[:40] if '"messages"' in line]
    plain = write_jsonl(tmp_path / "chat.jsonl", records)
    with gzip.open(tmp_path / "chat.jsonl.gz", "wt") as f:
        f.write(plain.read_text())
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    enc = ChatEncoder(tok, "chatml")

    def arrays(name):
        index = prepare_sft_index([str(tmp_path / name)], enc, cache_dir=str(tmp_path / "cache"))
        return [(index.tokens[i].tolist(), index.mask[i].tolist()) for i in range(index.num_conversations)]

    want = arrays("chat.jsonl")
    assert len(want) == len(records)
    for name in ("chat.jsonl.gz", "chat.parquet", "saved"):
        assert arrays(name) == want, name
    with pytest.raises(DataError, match="is not JSONL .* parquet or a saved Hugging Face dataset"):
        list(iter_records(write_jsonl(tmp_path / "chat.csv", ["a,b"])))


def test_the_index_is_built_once_and_rebuilt_when_an_input_changes(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT] * 3)
    enc = ChatEncoder(tok, "chatml")
    first = prepare_sft_index([str(path)], enc)  # default cache: next to the input
    assert not first.cache_hit and first.path.parent == tmp_path / "megapipe_sft_cache"
    again = prepare_sft_index([str(path)], enc)
    assert again.cache_hit and again.path == first.path
    os.utime(path, ns=(0, 0))
    assert not prepare_sft_index([str(path)], enc).cache_hit
    assert prepare_sft_index([str(path)], ChatEncoder(tok, "chatml", train_on_prompt=True)).path != first.path


def test_packing_places_every_conversation_once_and_keeps_them_apart(tok, tmp_path):
    enc = ChatEncoder(tok, "chatml")
    index = prepare_sft_index([str(CHAT_SET)], enc, cache_dir=str(tmp_path / "cache"))
    seq = 96
    args = (index, "90,10,0", seq, {"train": 1000}, 5)
    packed = build_sft_datasets(*args, True, "truncate", 1)["train"]
    single = build_sft_datasets(*args, False, "truncate", 1)["train"]
    assert packed.efficiency > 0.9 > 0.7 > single.efficiency
    epoch = [c for i in range(packed.per_epoch) for c in packed.members(i)]
    assert sorted(epoch) == sorted(packed.conv_ids.tolist())  # each conversation once per epoch
    assert packed.members(packed.per_epoch) != packed.members(0) or packed.members(packed.per_epoch + 1) != \
        packed.members(1)  # the next epoch is reshuffled
    row = packed[3]
    docs, pos = row["document_ids"], row["position_ids"]
    for d, c in enumerate(packed.members(3)):
        at = np.flatnonzero(docs == d)
        n = len(at)
        assert pos[at].tolist() == list(range(n))
        assert row["tokens"][at].tolist() == index.tokens[c][:n].tolist()
        assert row["loss_mask"][at][:-1].tolist() == index.mask[c][1:n].astype(bool).tolist()
        assert not row["loss_mask"][at[-1]]  # no target across a conversation boundary
        assert row["labels"][at][:-1].tolist() == index.tokens[c][1:n].tolist()
    assert pack_best_fit(np.array([5, 3, 4, 2, 6]), 8) == [[4, 3], [0, 1], [2]]
    drop = build_sft_datasets(index, "90,10,0", 40, {"train": 10}, 5, False, "drop", 1)["train"]
    cut = build_sft_datasets(index, "90,10,0", 40, {"train": 10}, 5, False, "truncate", 1)["train"]
    assert drop.dropped > 0 and cut.truncated > 0 and len(drop.conv_ids) < len(cut.conv_ids)


def test_inspect_sft_shows_the_trained_tokens(tok, tmp_path, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT, {"text": "hello"}])
    assert main(["data", "inspect-sft", str(path), "--tokenizer", str(tok), "--chat-template", "chatml", "--count", "2",
                 "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    trained = ["".join(s["text"] for s in r["segments"] if s["trained"]) for r in shown]
    assert trained[0] == "ANSWER: 5<|im_end|>\nANSWER: 8<|im_end|>\n"
    assert trained[1].endswith("llo<|im_end|>") and not trained[1].startswith("h")  # the first token is no target
    assert "".join(s["text"] for s in shown[1]["segments"]) == "hello<|im_end|>"
    assert "".join(s["text"] for s in shown[0]["segments"]).startswith("<|im_start|>system\nBe brief.")
    assert main(["data", "inspect-sft", str(path), "--tokenizer", str(tok), "--chat-template", "chatml"]) == 0
    out = capsys.readouterr().out
    assert f"{path}:1: {shown[0]['tokens']} tokens, {shown[0]['trained_tokens']} trained" in out and "ANSWER: 5" in out
    assert main(["data", "inspect-sft", str(path), "--tokenizer", str(tok)]) == 2
    assert "has no chat template" in capsys.readouterr().err
