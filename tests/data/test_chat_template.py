"""One chat-template renderer: the same conversations rendered through every path that renders them (SFT's records,
``data inspect-sft``, the server's chat rendering and /tokenize, RL's prompts) give the same text and the same token
ids, and those are what transformers' ``apply_chat_template`` gives (the oracle), on megapipe's built-in templates and
on SmolLM2's own. The template selection (named templates, with or without a ``default``) is the same for SFT and
serve. Eval renders no conversations (lm-eval's tasks are plain text), so it has no path here."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from megapipe.cli import main
from megapipe.config import RLConfig
from megapipe.data.chat_template import BUILTIN_TEMPLATES, load_chat_template, split_harmony
from megapipe.data.sft import ChatEncoder, parse_record
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import DataError
from megapipe.inference.protocol import ChatMessage
from megapipe.inference.server import OpenAIServer, ServerConfig
from megapipe.training.recipes.rl import RLRecipe
from megapipe.training.recipes.sft import SFTRecipe
from tests.helpers.sft import train_chat_tokenizer

SMOLLM2 = Path(os.environ.get("MEGAPIPE_SMOLLM2_DIR", Path.home() / ".cache/megapipe/smollm2"))
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
# Each ends with the assistant's turn: rendered whole (what SFT trains on), and without it, generation prompt added
# (what serve and RL send the model).
CONVERSATIONS = {
    "system, multi-turn": ([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "ANSWER: 5"},
        {"role": "user", "content": "And 4 plus 4?"}, {"role": "assistant", "content": "ANSWER: 8"}], None),
    "one turn, no system": ([
        {"role": "user", "content": "Name the capital of Peru."}, {"role": "assistant", "content": "Lima"}], None),
    "tools": ([
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "add 2 and 3", "name": None},  # None-valued keys are dropped, as HF does
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"}, {"role": "assistant", "content": "ANSWER: 5"}], TOOLS),
}


@pytest.fixture(scope="module")
def bare_tok(tmp_path_factory) -> Path:
    """The tests' chat tokenizer (ChatML's tokens) with Llama 3's and harmony's tokens added, and no template of its
    own."""
    from tokenizers import Tokenizer

    out = train_chat_tokenizer(tmp_path_factory.mktemp("bare"))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(LLAMA3_SPECIALS + HARMONY_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|begin_of_text|>"}))
    return out


def sft_checkpoint_tokenizer(tok: Path, choice, out: Path) -> Path:
    """The tokenizer an SFT run with --chat-template ``choice`` writes into its checkpoints (what serve loads): ``tok``
    itself, or a copy with the template, kept at ``out``."""
    recipe = SFTRecipe(quiet=True)
    tokenizer = SimpleNamespace(path=tok)
    recipe.encoder(SimpleNamespace(sft=SimpleNamespace(chat_template=choice, train_on_prompt=False)), tokenizer)
    written = Path(recipe.tokenizer_files(SimpleNamespace(tokenizer=tokenizer)))
    return tok if written == tok else Path(shutil.copytree(written, out))


def server(tok_dir: Path, **config) -> OpenAIServer:
    """The real server class on a stand-in engine (rendering and /tokenize need only the engine's tokenizer)."""
    engine = SimpleNamespace(tokenizer=load_tokenizer(tok_dir), max_model_len=1 << 20, loras={}, model_config=None,
                             stats=dict, on_output=None, cache_info={})
    return OpenAIServer(engine, ServerConfig("m", **config))


def server_render(srv: OpenAIServer, messages, generation_prompt: bool) -> tuple[str, list[int]]:
    from fastapi.testclient import TestClient

    text = srv._render([ChatMessage(**m) for m in messages], generation_prompt)
    r = TestClient(srv.app).post("/tokenize", json={"messages": messages, "add_generation_prompt": generation_prompt})
    assert r.status_code == 200, r.text
    return text, r.json()["tokens"]


def rl_render(tok_dir: Path, messages, choice=None) -> tuple[str, list[int]]:
    rl = RLConfig(task="arithmetic", chat_template=choice)
    _, _, renderer = RLRecipe(rl).parts(SimpleNamespace(rl=rl), load_tokenizer(tok_dir), 0)
    return renderer.render(messages), renderer.encode(messages, "x:1")


def inspect_sft(tok_dir: Path, record: dict, choice, tmp_path: Path, capsys) -> tuple[str, int]:
    path = tmp_path / "record.jsonl"
    path.write_text(json.dumps(record) + "\n")
    args = ["data", "inspect-sft", str(path), "--tokenizer", str(tok_dir), "--json"]
    assert main(args + (["--chat-template", choice] if choice else [])) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    return "".join(s["text"] for s in shown["segments"]), shown["tokens"]


def oracle(tok_dir: Path, choice, messages, tools, generation_prompt: bool) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    kw = dict(tools=tools, add_generation_prompt=generation_prompt,
              chat_template=BUILTIN_TEMPLATES.get(choice, choice))
    ids = hf.apply_chat_template(messages, tokenize=True, **kw)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return hf.apply_chat_template(messages, tokenize=False, **kw), list(ids)


def check_every_path(bare_tok: Path, choice, served_tok: Path, tmp_path: Path, capsys) -> None:
    """``bare_tok`` rendered with --chat-template ``choice`` by SFT and inspect-sft; ``served_tok`` (the tokenizer
    SFT's checkpoints carry) by serve and RL, which take the tokenizer's own template."""
    encoder = ChatEncoder(bare_tok, choice)
    srv = server(served_tok)
    for name, (messages, tools) in CONVERSATIONS.items():
        # the whole conversation, as SFT trains on it
        want_text, want_ids = oracle(bare_tok, choice, messages, tools, False)
        text, ids, _, _ = encoder.encode_detailed(parse_record({"messages": messages, "tools": tools}, "x:1"))
        assert (text, ids.tolist()) == (want_text, want_ids), name
        assert inspect_sft(bare_tok, {"messages": messages, "tools": tools}, choice, tmp_path, capsys) == \
            (want_text, len(want_ids)), name
        # up to the last answer, with the generation prompt, as it is sent to the model
        prompt = messages[:-1]
        want_text, want_ids = oracle(bare_tok, choice, prompt, tools, True)
        text = encoder.render(prompt, tools, add_generation_prompt=True)
        assert (text, encoder.hf(text, add_special_tokens=False)["input_ids"]) == (want_text, want_ids), name
        if tools is None:  # the server refuses tools, and RL prompts carry none
            assert server_render(srv, prompt, True) == (want_text, want_ids), name
            assert rl_render(served_tok, prompt) == (want_text, want_ids), name
            whole = oracle(bare_tok, choice, messages, None, False)
            assert server_render(srv, messages, False) == whole, name


@pytest.mark.parametrize("choice", ["chatml", "llama3", "harmony"])
def test_builtin_templates_render_alike_through_every_path(bare_tok, choice, tmp_path, capsys):
    check_every_path(bare_tok, choice, sft_checkpoint_tokenizer(bare_tok, choice, tmp_path / "ckpt-tok"), tmp_path,
                     capsys)
    # RL can name the template too, as SFT does
    prompt = CONVERSATIONS["system, multi-turn"][0][:-1]
    assert rl_render(bare_tok, prompt, choice) == oracle(bare_tok, choice, prompt, None, True)


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(),
                    reason=f"SmolLM2 not prepared at {SMOLLM2} (tools/prepare_smollm2.py)")
def test_smollm2_own_template_renders_alike_through_every_path(tmp_path, capsys):
    check_every_path(SMOLLM2, None, SMOLLM2, tmp_path, capsys)


def test_text_content_parts_render_as_their_lines(bare_tok, tmp_path):
    """vLLM's rule for templates that read a string: a message's text parts joined by newlines, in SFT and serve."""
    served = sft_checkpoint_tokenizer(bare_tok, "chatml", tmp_path / "ckpt-tok")
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 plus 3?"}]},
             {"role": "assistant", "content": "ANSWER: 5"}]
    joined = [{"role": "user", "content": "What is \n2 plus 3?"}, {"role": "assistant", "content": "ANSWER: 5"}]
    want = oracle(bare_tok, "chatml", joined, None, False)
    text, ids, _, _ = ChatEncoder(bare_tok, "chatml").encode_detailed(parse_record({"messages": parts}, "x:1"))
    assert (text, ids.tolist()) == want == server_render(server(served), parts, False)


def write_named(tok_dir: Path, out: Path, names: list[str]) -> Path:
    """``tok_dir`` with named templates in tokenizer_config.json, each ``NAME: content`` per message."""
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tok_dir / f).read_bytes())
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": n, "template": "{% for m in messages %}" + n + ": {{ m['content'] }}\n"
                                "{% endfor %}{% if add_generation_prompt %}" + n + ":{% endif %}"} for n in names]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_named_templates_without_a_default_are_refused_alike_by_sft_serve_and_transformers(bare_tok, tmp_path):
    from transformers import AutoTokenizer

    tok = write_named(bare_tok, tmp_path / "named", ["answer", "tool_use"])
    messages = CONVERSATIONS["one turn, no system"][0]
    sentence = f"tokenizer {tok} has several chat templates and none named 'default' (answer, tool_use)"
    with pytest.raises(DataError, match=sentence.replace("(", r"\(").replace(")", r"\)")):
        ChatEncoder(tok)
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        AutoTokenizer.from_pretrained(str(tok)).apply_chat_template(messages, tokenize=False)
    from fastapi.testclient import TestClient

    r = TestClient(server(tok).app).post("/tokenize", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(sentence)
    assert TestClient(server(tok).app).post("/tokenize", json={"prompt": "hi"}).status_code == 200  # completions work

    # named on the command line: SFT trains with it, its checkpoint's tokenizer carries it, serve renders with it
    encoder = ChatEncoder(tok, "answer")
    assert encoder.template_name == "tokenizer:answer"
    served = sft_checkpoint_tokenizer(tok, "answer", tmp_path / "ckpt-tok")
    want = AutoTokenizer.from_pretrained(str(tok)).apply_chat_template(messages[:1], chat_template="answer",
                                                                        add_generation_prompt=True, tokenize=False)
    assert want == "answer: Name the capital of Peru.\nanswer:"
    assert encoder.render(messages[:1], add_generation_prompt=True) == want
    assert server_render(server(served), messages[:1], True)[0] == want
    assert rl_render(tok, messages[:1], "answer")[0] == want


def test_a_default_or_a_single_template_is_chosen_alike(bare_tok, tmp_path):
    messages = CONVERSATIONS["one turn, no system"][0]
    with_default = write_named(bare_tok, tmp_path / "default", ["tool_use", "default"])
    single = write_named(bare_tok, tmp_path / "single", ["answer"])
    for tok, name in ((with_default, "default"), (single, "answer")):
        want = f"{name}: Name the capital of Peru.\n{name}: Lima\n"
        assert ChatEncoder(tok).render(messages) == want == server_render(server(tok), messages, False)[0]
        assert ChatEncoder(tok).template_name == "tokenizer" and sft_checkpoint_tokenizer(tok, None, tmp_path / "x") == tok
    # chat_template.jinja replaces tokenizer_config.json's templates, as transformers reads them
    (with_default / "chat_template.jinja").write_text("{% for m in messages %}jinja: {{ m['content'] }}\n{% endfor %}")
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(with_default)).apply_chat_template(messages, tokenize=False)
    assert want == "jinja: Name the capital of Peru.\njinja: Lima\n" == load_chat_template(with_default).render(messages)


def test_a_refusing_template_is_a_400_in_serve_and_a_data_error_in_sft(bare_tok, tmp_path):
    from fastapi.testclient import TestClient

    tok = tmp_path / "refusing"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((bare_tok / "tokenizer.json").read_bytes())
    (tok / "chat_template.jinja").write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user "
                                             "first') }}{% endif %}{% for m in messages %}{{ m['content'] }}"
                                             "{% endfor %}")
    messages = [{"role": "assistant", "content": "hi"}]
    sentence = "the chat template tokenizer refused the conversation: user first"
    r = TestClient(server(tok).app).post("/tokenize", json={"messages": messages})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (400, sentence, "messages")
    with pytest.raises(DataError, match=f"x:1: {sentence}"):
        ChatEncoder(tok).encode(parse_record({"messages": messages}, "x:1"))


HARMONY_SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge "
                  "cutoff: 2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel "
                  "must be included for every message.")


def test_harmony_renders_the_published_format_and_trains_the_current_turn_only(bare_tok, tmp_path):
    """GPT-OSS's conversations: the system message, the developer's instructions, an earlier turn as history (its
    reasoning dropped, <|end|>), the current turn's reasoning on the analysis channel and its answer on the final one
    ending in <|return|>; SFT trains exactly that last answer, and serve sends the prompt SFT's text continues."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "thinking": "Add them.", "content": "ANSWER: 5"},
                {"role": "user", "content": "And 4 plus 4?"},
                {"role": "assistant", "reasoning_content": "Four and four.", "content": "ANSWER: 8"}]
    prompt = (HARMONY_SYSTEM + "<|end|><|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
              "<|start|>user<|message|>What is 2 plus 3?<|end|>"
              "<|start|>assistant<|channel|>final<|message|>ANSWER: 5<|end|>"
              "<|start|>user<|message|>And 4 plus 4?<|end|><|start|>assistant")
    answer = ("<|channel|>analysis<|message|>Four and four.<|end|>"
              "<|start|>assistant<|channel|>final<|message|>ANSWER: 8<|return|>")
    encoder = ChatEncoder(bare_tok, "harmony")
    text, ids, _, trained = encoder.encode_detailed(parse_record({"messages": messages}, "x:1"))
    assert text == prompt + answer
    vocab = encoder.vocab
    assert encoder.hf.decode(ids[trained].tolist()) == answer
    assert ids[trained][0] == vocab["<|channel|>"] and ids[-1] == vocab["<|return|>"]
    assert (ids == vocab["<|return|>"]).sum() == 1 and (ids == vocab["<|start|>"]).sum() == 7
    served = sft_checkpoint_tokenizer(bare_tok, "harmony", tmp_path / "ckpt-tok")
    plain = [{k: v for k, v in m.items() if k in ("role", "content")} for m in messages]
    want_ids = encoder.hf(prompt, add_special_tokens=False)["input_ids"]
    assert server_render(server(served), plain[:-1], True) == (prompt, want_ids) == \
        (encoder.render(messages[:-1], add_generation_prompt=True), ids[:len(want_ids)].tolist())


def test_harmony_tool_calls_go_to_the_commentary_channel(bare_tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Gets the weather.",
              "parameters": {"type": "object", "required": ["city"], "properties": {
                  "city": {"type": "string", "description": "The city."},
                  "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                  "days": {"type": "array", "items": {"type": "integer"}}}}}},
             {"type": "function", "function": {"name": "now"}}]
    messages = [{"role": "user", "content": "Weather in Lima?"},
                {"role": "assistant", "thinking": "Ask the tool.", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]},
                {"role": "tool", "content": '{"sunny": true}'},
                {"role": "assistant", "thinking": "Sunny.", "content": "It is sunny."}]
    call = ("<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Lima"}<|call|>')
    want = (HARMONY_SYSTEM + "\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
            "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
            "// Gets the weather.\ntype get_weather = (_: {\n// The city.\ncity: string,\n"
            'unit?: "c" | "f", // default: c,\ndays?: number[],\n}) => any;\n\n'
            "type now = () => any;\n\n} // namespace functions<|end|>"
            "<|start|>user<|message|>Weather in Lima?<|end|>" + call +
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true}<|end|>'
            "<|start|>assistant<|channel|>analysis<|message|>Sunny.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>")
    encoder = ChatEncoder(bare_tok, "harmony")
    text, ids, _, trained = encoder.encode_detailed(parse_record({"messages": messages, "tools": tools}, "x:1"))
    assert text == want
    # the call and the answer are trained (the current turn), the tool's result is not
    assert encoder.hf.decode(ids[trained].tolist()) == call.removeprefix("<|start|>assistant") + \
        "<|channel|>analysis<|message|>Sunny.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    with pytest.raises(DataError, match="refused the conversation: a tool message follows no tool call"):
        encoder.encode(parse_record({"messages": [messages[0], messages[2], messages[3]]}, "x:1"))


def test_harmony_replies_split_into_answer_and_reasoning(bare_tok, tmp_path):
    """What the model writes after <|start|>assistant: the final channel is the content, the analysis channel the
    reasoning, tool calls (commentary) neither; every prefix of the reply splits into prefixes of the whole reply's
    parts (streaming deltas); the server on the tokenizer SFT wrote splits the text its engine detokenizes with the
    special tokens kept, and leaves other templates' replies whole."""
    from megapipe.inference.detokenize import Detokenizer

    reply = ("<|channel|>analysis<|message|>Four and four.<|end|><|start|>assistant to=functions.add<|channel|>"
             'commentary json<|message|>{"a": 4}<|call|>'
             "<|start|>assistant<|channel|>final<|message|>ANSWER: 8<|return|>")
    assert split_harmony(reply) == ("ANSWER: 8", "Four and four.")
    assert split_harmony("<|channel|>final<|message|>Hi") == ("Hi", None)  # cut short, no reasoning
    assert split_harmony("") == ("", None)
    srv = server(sft_checkpoint_tokenizer(bare_tok, "harmony", tmp_path / "ckpt-tok"))
    tok = srv.tokenizer
    detok = Detokenizer(tok, [], frozenset())  # skip_special_tokens off, as the server asks for harmony
    ids = tok.encode(reply)
    seen = {"content": "", "reasoning_content": ""}
    for i, t in enumerate(ids):
        detok.add(t, final=i == len(ids) - 1)
        for key, value in srv._reply(detok.text).items():
            assert value.startswith(seen[key])
            seen[key] = value
    assert detok.text == reply and seen == {"content": "ANSWER: 8", "reasoning_content": "Four and four."}
    assert server(sft_checkpoint_tokenizer(bare_tok, "chatml", tmp_path / "chatml-tok"))._reply(reply) == \
        {"content": reply}
    # RL samples harmony completions with their markers and scores their final channel
    rl = RLConfig(task="arithmetic", chat_template="harmony")
    _, _, renderer = RLRecipe(rl).parts(SimpleNamespace(rl=rl), load_tokenizer(bare_tok), 0)
    assert renderer.channels and renderer.answer(reply) == "ANSWER: 8"
    from megapipe.posttrain.rl.rollout import RolloutWorker

    assert not RolloutWorker.sampling_params(SimpleNamespace(rl=rl, renderer=renderer)).skip_special_tokens
    assert renderer.render("What is 4 plus 4?").endswith("<|start|>user<|message|>What is 4 plus 4?<|end|>"
                                                         "<|start|>assistant")


def test_a_harmony_reply_makes_reasoning_call_and_message_items(bare_tok, tmp_path):
    """/v1/responses on a harmony model (--tool-call-parser openai): the analysis channel is a reasoning item, the
    commentary call a function_call, the final channel the message; streamed a token at a time, the items come in
    the reply's own order and end as the whole reply's."""
    from megapipe.inference.detokenize import Detokenizer
    from megapipe.inference.engine import CompletionOutput, RequestOutput
    from megapipe.inference.responses import ResponseBuilder, ResponsesRequest
    from megapipe.inference.sampling import SamplingParams
    from megapipe.inference.server import _ChatTurn
    from megapipe.inference.tool_calls import ToolChoice, ToolStream

    reply = ("<|channel|>analysis<|message|>Four and four.<|end|><|start|>assistant to=functions.add<|channel|>"
             'commentary json<|message|>{"a": 4}')
    srv = server(sft_checkpoint_tokenizer(bare_tok, "harmony", tmp_path / "ckpt-tok"), tool_call_parser="openai")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    turn = _ChatTurn("", None, SamplingParams(skip_special_tokens=False), ToolChoice.parse(tools, None), True, "")
    body = ResponsesRequest.model_validate({"input": "What is 4 plus 4?", "tools": [{"type": "function",
                                                                                     "name": "add"}]})
    ids = srv.tokenizer.encode(reply)
    build, detok, events = ResponseBuilder(body, "m", "resp_h"), Detokenizer(srv.tokenizer, [], frozenset()), []
    calls = ToolStream(srv._calls_parser(turn.tools))
    for i, t in enumerate(ids):
        detok.add(t, final=i == len(ids) - 1)
        done = "stop" if i == len(ids) - 1 else None
        out = RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(0, detok.text, ids[:i + 1], None, done)],
                            done is not None, 0, i + 1)
        events += srv._response_events(build, out, turn, calls)
    whole = events[-1]["response"]
    assert [(o["type"], o["status"]) for o in whole["output"]] == [("reasoning", "completed"),
                                                                    ("function_call", "completed")]
    assert whole["output"][0]["content"][0]["text"] == "Four and four."
    assert (whole["output"][1]["name"], whole["output"][1]["arguments"]) == ("add", '{"a": 4}')
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"a": 4}' and "<|" not in "".join(e.get("delta", "") for e in events)

