"""OpenAI's and vLLM's request fields past the basics, through a live server: n > 1 streams, logprobs' shapes and
offsets, continuous usage, stop strings kept, prompt logprobs, assistant prefill and echo, template variables, the
request id, and errors named after the field the request used."""

from __future__ import annotations

import httpx
import pytest

from megapipe.data.chat_template import ChatTemplate, ChatTemplateError
from megapipe.inference import SamplingParams
from tests.helpers.hf_tiny import CHAT_TEMPLATE
from tests.inference.test_server import KEY, NAME

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters_dir(hf_llama, tmp_path_factory):
    """A peft LoRA directory for the tiny Llama (tests/inference/test_multi_lora.py makes it)."""
    from tests.inference.test_multi_lora import make_adapters

    return make_adapters(hf_llama, tmp_path_factory.mktemp("loras"))[0]["peft"]


@pytest.fixture(scope="module")
def reference(hf_llama):
    from megapipe.inference import LLMEngine

    return LLMEngine.from_pretrained(hf_llama[0], device="cpu")


def events(live, route: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response, [DONE] checked and dropped."""
    import json

    with httpx.stream("POST", live.url + route, json=body | {"stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_each_streamed_choice_finishes_once_and_nothing_follows(live, route):
    body = {"model": NAME, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 1, "stop": [" t", "e"]}
    body |= {"prompt": "The quick brown"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    seen: dict[int, list] = {}
    for e in events(live, route, body):
        for c in e["choices"]:
            assert c["index"] not in seen or seen[c["index"]][-1] is None, ("after its finish", c)
            seen.setdefault(c["index"], []).append(c["finish_reason"])
    assert sorted(seen) == [0, 1, 2]
    assert all(sum(f is not None for f in reasons) == 1 and reasons[-1] in ("stop", "length")
               for reasons in seen.values()), seen


def test_completion_top_logprobs_hold_the_token_itself(live):
    for k in (0, 1, 3):
        r = httpx.post(live.url + "/v1/completions", headers=AUTH, json={
            "model": NAME, "prompt": "The quick brown", "max_tokens": 10, "temperature": 1.5, "seed": 3,
            "logprobs": k, "echo": True}).json()
        lp = r["choices"][0]["logprobs"]
        assert lp["top_logprobs"][0] is None
        for tops, token, value in zip(lp["top_logprobs"][1:], lp["tokens"][1:], lp["token_logprobs"][1:],
                                      strict=True):
            assert tops[token] == value and len(tops) <= k + 1
            assert k > 0 or len(tops) == 1


def test_text_offsets_stream_as_whole_and_point_into_the_text(live):
    body = {"model": NAME, "prompt": "The quick brown", "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    for extra in ({"echo": True}, {"stop": ["zzzzzz"]}):
        whole = httpx.post(live.url + "/v1/completions", json=body | extra, headers=AUTH).json()["choices"][0]
        streamed = [o for e in events(live, "/v1/completions", body | extra) for c in e["choices"]
                    if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert streamed == whole["logprobs"]["text_offset"]
    # tokens that hold part of a character start where the character does
    text = "こんにちは héllo wörld"
    scored = httpx.post(live.url + "/v1/completions", headers=AUTH, json={
        "model": NAME, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0}).json()["choices"][0]
    lp = scored["logprobs"]
    assert scored["text"] == text and any("\ufffd" in t for t in lp["tokens"])
    for start, token in zip(lp["text_offset"], lp["tokens"], strict=True):
        assert text[start:].startswith(token) if "\ufffd" not in token else ord(text[start]) > 127


def test_continuous_usage_stats_count_every_chunk(live):
    for route, body in (("/v1/completions", {"prompt": "The quick brown"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        got = events(live, route, body | {
            "model": NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert all("usage" in e for e in got)
        done = [e["usage"]["completion_tokens"] for e in got]
        assert done == sorted(done) and done[-1] == 6 and got[-1]["choices"] == []
        if route == "/v1/chat/completions":
            assert got[0]["choices"][0]["delta"]["role"] == "assistant" and done[0] == 0  # the role chunk: none yet
        assert {e["usage"]["prompt_tokens"] for e in got} == {got[-1]["usage"]["prompt_tokens"]}


def test_include_stop_str_in_output_keeps_the_stop_string(live, reference):
    want = reference.generate(["The quick brown"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    text = want[0].outputs[0].text
    stop = text[5:8]
    body = {"model": NAME, "prompt": "The quick brown", "max_tokens": 16, "temperature": 0, "stop": [stop]}
    cut = httpx.post(live.url + "/v1/completions", json=body, headers=AUTH).json()["choices"][0]["text"]
    kept = httpx.post(live.url + "/v1/completions", json=body | {"include_stop_str_in_output": True},
                      headers=AUTH).json()["choices"][0]
    assert cut == text[:text.find(stop)] and kept["text"] == cut + stop and kept["finish_reason"] == "stop"
    chunks = [c["text"] for e in events(live, "/v1/completions", body | {"include_stop_str_in_output": True})
              for c in e["choices"]]
    assert "".join(chunks) == kept["text"] and chunks[0] == "}"  # kept: no text held back (the first token's at once)
    # a stop token id: kept in the output with its text (vLLM's), its id the stop_reason
    ids = want[0].outputs[0].token_ids
    body = {"model": NAME, "prompt": "The quick brown", "max_tokens": 16, "temperature": 0, "stop_token_ids": [ids[4]],
            "return_token_ids": True}
    plain = httpx.post(live.url + "/v1/completions", json=body, headers=AUTH).json()
    kept = httpx.post(live.url + "/v1/completions", json=body | {"include_stop_str_in_output": True},
                      headers=AUTH).json()
    assert plain["choices"][0]["token_ids"] == ids[:4] and kept["choices"][0]["token_ids"] == ids[:5]
    assert kept["choices"][0]["text"] == reference.tokenizer.decode(ids[:5])
    assert plain["choices"][0]["stop_reason"] == kept["choices"][0]["stop_reason"] == ids[4]
    assert plain["usage"]["completion_tokens"] == kept["usage"]["completion_tokens"] == 5
    streamed = events(live, "/v1/completions", body | {"include_stop_str_in_output": True})
    assert "".join(c["text"] for e in streamed for c in e["choices"]) == kept["choices"][0]["text"]


def test_prompt_logprobs_in_vllms_shape(live, reference):
    ids = reference.tokenizer.encode("The quick brown fox")
    ref = reference.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    r = httpx.post(live.url + "/v1/completions", headers=AUTH, json={
        "model": NAME, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}).json()
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for token, entry, (lp, alts, rank) in zip(ids[1:], got[1:], ref.prompt_logprobs[1:], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(lp, abs=1e-5) and entry[str(token)]["rank"] == rank
        assert [entry[str(t)]["rank"] for t, _ in alts] == [1, 2]
        assert entry[str(token)]["decoded_token"] == reference.tokenizer.decode([token])
    chat = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    refused = httpx.post(live.url + "/v1/completions", headers=AUTH, json={
        "model": NAME, "prompt": "hi", "stream": True, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_assistant_prefill_continues_the_last_message_and_echo_repeats_it(live, reference):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    rendered = "user: Name a color.\nassistant: The color is"
    tokens = httpx.post(live.url + "/tokenize", headers=AUTH, json={k: body[k] for k in (
        "messages", "add_generation_prompt", "continue_final_message")}).json()["tokens"]
    assert reference.tokenizer.decode(tokens) == rendered
    want = reference.generate([rendered], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    r = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=body).json()
    assert r["choices"][0]["message"]["content"] == want.outputs[0].text
    echoed = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=body | {"echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "The color is" + want.outputs[0].text
    streamed = "".join(c["delta"].get("content") or "" for e in events(
        live, "/v1/chat/completions", body | {"echo": True}) for c in e["choices"])
    assert streamed == "The color is" + want.outputs[0].text
    both = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=body | {"add_generation_prompt": True})
    assert both.status_code == 400 and "exclude each other" in both.json()["error"]["message"]


def test_text_parts_are_lines_and_template_variables_are_checked(live):
    parts = [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]
    tokens = httpx.post(live.url + "/tokenize", headers=AUTH, json={
        "messages": [{"role": "user", "content": parts}]}).json()["tokens"]
    assert live.engine.tokenizer.decode(tokens) == "user: Name a \ncolor.\nassistant:"
    r = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "chat_template_kwargs may not set 'messages'" in r.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template():
    template = ChatTemplate("{% if flag %}FLAG {% endif %}" + CHAT_TEMPLATE, "test")
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages, variables={"flag": True}) == "FLAG user: hi\n"
    assert template.render(messages) == "user: hi\n"
    with pytest.raises(ChatTemplateError, match="may not set 'add_generation_prompt'"):
        template.render(messages, variables={"add_generation_prompt": True})


def test_the_request_id_comes_from_the_header_or_the_body(live):
    r = httpx.post(live.url + "/v1/completions", headers=AUTH | {"X-Request-Id": "my-req-1"},
                   json={"model": NAME, "prompt": "hi", "max_tokens": 2})
    assert r.json()["id"] == "cmpl-my-req-1" and r.headers["x-request-id"] == "my-req-1"
    r = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "abc"})
    assert r.json()["id"] == "chatcmpl-abc" and r.headers["x-request-id"] == "abc"
    streamed = events(live, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, "request_id": "s1"})
    assert {e["id"] for e in streamed} == {"cmpl-s1"}


def test_a_request_without_a_model_runs_on_the_base_model(live):
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(live.url + route, headers=AUTH, json=body | {"max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == NAME, r.text


def test_without_a_generation_prompt_the_reply_has_the_last_messages_role(live):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "add_generation_prompt": False}
    r = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=body).json()
    assert r["choices"][0]["message"]["role"] == "user"
    assert events(live, "/v1/chat/completions", body)[0]["choices"][0]["delta"]["role"] == "user"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(live, reference):
    ids = reference.tokenizer.encode("The quick brown fox jumps over")
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = reference.generate([ids[-3:]], greedy)[0].outputs[0].token_ids
    body = {"model": NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "truncate_prompt_tokens": 3}
    for prompt in ("The quick brown fox jumps over", ids):
        r = httpx.post(live.url + "/v1/completions", headers=AUTH, json=body | {"prompt": prompt}).json()
        assert (r["choices"][0]["prompt_token_ids"], r["choices"][0]["token_ids"]) == (ids[-3:], want)
        assert r["usage"]["prompt_tokens"] == 3
    whole = httpx.post(live.url + "/v1/completions", headers=AUTH, json=body | {"prompt": ids,
                                                                                "truncate_prompt_tokens": -1}).json()
    assert whole["choices"][0]["prompt_token_ids"] == ids
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
            "return_token_ids": True}
    full = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=chat).json()["prompt_token_ids"]
    cut = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=chat | {"truncate_prompt_tokens": 4}).json()
    assert cut["prompt_token_ids"] == full[-4:]
    for bad in (0, -2, 129):
        r = httpx.post(live.url + "/v1/completions", headers=AUTH, json=body | {"prompt": ids,
                                                                                "truncate_prompt_tokens": bad})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "truncate_prompt_tokens" and "within [1, 128]" in err["message"]


def test_tokens_as_ids_in_logprobs_and_token_strings_from_tokenize(live, reference):
    body = {"model": NAME, "prompt": "The quick brown", "max_tokens": 5, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = httpx.post(live.url + "/v1/completions", headers=AUTH, json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"])
    streamed = [t for e in events(live, "/v1/completions", body) for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=chat).json()["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    plain = httpx.post(live.url + "/v1/completions", headers=AUTH, json=body | {"return_tokens_as_token_ids": False})
    assert plain.json()["choices"][0]["logprobs"]["tokens"][0] == reference.tokenizer.decode(
        [plain.json()["choices"][0]["token_ids"][0]])
    r = httpx.post(live.url + "/tokenize", headers=AUTH, json={"prompt": "The quick", "return_token_strs": True}).json()
    assert r["token_strs"] == [reference.tokenizer.id_to_token(t) for t in r["tokens"]]
    assert "".join(r["token_strs"]).replace("\u0120", " ") == "The quick"


def test_errors_name_the_field_the_request_used(live):
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"max_completion_tokens": 0}, "max_completion_tokens"),
                         ({"max_tokens": 0}, "max_tokens")):
        err = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=chat | extra).json()["error"]
        assert err["param"] == param and err["message"].startswith(param), err


def test_logit_bias_allowed_ids_and_bad_words_reach_the_sampler(live, reference):
    """OpenAI's logit_bias (string keys, clamped to [-100, 100]) and vLLM's allowed_token_ids and bad_words give the
    engine's outputs for the same parameters; their mistakes are 400s naming the field."""
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    free = reference.generate(["The quick brown"], SamplingParams(**greedy))[0].outputs[0].token_ids
    tok = reference.tokenizer
    word = next(tok.decode([t]) for t in free if tok.encode(tok.decode([t]).lstrip()) == [t])  # one of its tokens
    for fields, params in (
            ({"logit_bias": {str(free[2]): 1000}}, {"logit_bias": {free[2]: 100.0}}),
            ({"logit_bias": {str(free[0]): -100, str(free[1]): 7.5}}, {"logit_bias": {free[0]: -100.0, free[1]: 7.5}}),
            ({"allowed_token_ids": free[3:7]}, {"allowed_token_ids": free[3:7]}),
            ({"bad_words": ["ab", word]}, {"bad_words": ["ab", word]})):
        want = reference.generate(["The quick brown"], SamplingParams(**greedy, **params))[0].outputs[0].token_ids
        assert want != free, fields
        r = httpx.post(live.url + "/v1/completions", headers=AUTH, json={
            "model": NAME, "prompt": "The quick brown", "return_token_ids": True, **greedy, **fields})
        assert r.json()["choices"][0]["token_ids"] == want, fields
    for fields, param, message in (
            ({"logit_bias": {"x1": 1}}, "logit_bias", "logit_bias key 'x1' is not a token id"),
            ({"logit_bias": {"999999": 1}}, "logit_bias", "logit_bias holds token 999999"),
            ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids is empty"),
            ({"bad_words": [""]}, "bad_words", "bad_words must be a list of non-empty strings"),
            ({"stop": ""}, "stop", "stop = [''] holds an empty string")):
        r = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json={
            "model": NAME, "messages": [{"role": "user", "content": "hi"}], **fields})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and message in err["message"], err


def test_return_token_ids_gives_the_prompts_and_each_choices_ids(live, reference):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=2, ignore_eos=True)
    prompt_ids = reference.tokenizer.encode("The quick brown")
    want = [c.token_ids for c in reference.generate([prompt_ids], params)[0].outputs]
    body = {"model": NAME, "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 2, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(live.url + "/v1/completions", headers=AUTH, json=body | {"prompt": "The quick brown"}).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in whole["choices"]] == [(prompt_ids, w) for w in want]
    got: dict[int, list] = {}
    for e in events(live, "/v1/completions", body | {"prompt": "The quick brown"}):
        for c in e["choices"]:
            if c["index"] not in got:
                assert c["prompt_token_ids"] == prompt_ids
            got.setdefault(c["index"], []).extend(c["token_ids"])
    assert [got[0], got[1]] == want
    chat = body | {"messages": [{"role": "user", "content": "hi"}]}
    chat_ids = httpx.post(live.url + "/tokenize", headers=AUTH, json={
        "model": NAME, "messages": chat["messages"]}).json()["tokens"]
    whole = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=chat).json()
    want = [c.token_ids for c in reference.generate([chat_ids], params)[0].outputs]
    assert whole["prompt_token_ids"] == chat_ids and [c["token_ids"] for c in whole["choices"]] == want
    streamed = events(live, "/v1/chat/completions", chat)
    assert streamed[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in e for e in streamed[1:])
    got = {0: [], 1: []}
    for e in streamed:
        for c in e["choices"]:
            got[c["index"]].extend(c.get("token_ids", []))
    assert [got[0], got[1]] == want
    plain = httpx.post(live.url + "/v1/completions", headers=AUTH, json=body | {"prompt": "a", "return_token_ids": False})
    assert "token_ids" not in plain.json()["choices"][0]


def test_a_completion_prompt_gets_the_tokenizers_bos_as_in_vllm(hf_llama, reference, tmp_path):
    """A tokenizer whose post-processor puts a BOS before a text (Llama, Gemma, Mistral): a completion's text prompt
    runs with it (add_special_tokens, true by default), echo shows the text alone; a chat prompt gets none on top of
    the template's unless asked; /tokenize adds it to a prompt, not to messages."""
    import json
    import shutil

    from tests.inference.test_server import LiveServer

    model = tmp_path / "bos"
    shutil.copytree(hf_llama[0], model)
    data = json.loads((model / "tokenizer.json").read_text())
    data["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(data))
    server = LiveServer(model)
    try:
        ids = reference.tokenizer.encode("The quick brown")
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        body = {"model": NAME, "prompt": "The quick brown", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "echo": True}
        for extra, prompt_ids in (({}, [0] + ids), ({"add_special_tokens": False}, ids)):
            r = httpx.post(server.url + "/v1/completions", headers=AUTH, json=body | extra).json()
            want = reference.generate([prompt_ids], greedy)[0].outputs[0]
            choice = r["choices"][0]
            assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt_ids, want.token_ids), extra
            assert choice["text"] == "The quick brown" + want.text and r["usage"]["prompt_tokens"] == len(prompt_ids)
        messages = [{"role": "user", "content": "hi"}]
        chat_ids = httpx.post(server.url + "/tokenize", headers=AUTH, json={"messages": messages}).json()["tokens"]
        assert chat_ids[0] != 0
        for extra, prompt_ids in (({}, chat_ids), ({"add_special_tokens": True}, [0] + chat_ids)):
            r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
                "model": NAME, "messages": messages, "max_tokens": 2, "return_token_ids": True, **extra}).json()
            assert r["prompt_token_ids"] == prompt_ids, extra
        tokenized = httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": "The quick brown"}).json()
        assert tokenized["tokens"] == [0] + ids
        # truncate_prompt_tokens counts the BOS and keeps it, as a Hugging Face tokenizer truncating left does
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, json=body | {"truncate_prompt_tokens": 3}).json()
        assert r["choices"][0]["prompt_token_ids"] == [0] + ids[-2:]
    finally:
        server.stop()


def test_token_bytes_rebuild_text_split_inside_characters(hf_llama):
    from megapipe.data.tokenizer import load_tokenizer

    tok = load_tokenizer(hf_llama[0])
    text = "こんにちは héllo wörld"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens hold part of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.fixture(scope="module")
def configured(hf_llama):
    """A server given the model's sampling defaults, its own chat template and a CORS origin."""
    from tests.inference.test_server import LiveServer

    server = LiveServer(hf_llama[0], server_config={
        "sampling_defaults": {"temperature": 0.0, "max_tokens": 5},
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
        "allowed_origins": ["http://ui.example"]})
    yield server
    server.stop()


def test_generation_config_defaults_fill_what_a_request_leaves_out(configured, reference):
    want = reference.generate(["<user>hi"], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    r = httpx.post(configured.url + "/v1/chat/completions", headers=AUTH, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["choices"][0]["message"]["content"] == want.text and r["usage"]["completion_tokens"] <= 5
    tokens = httpx.post(configured.url + "/tokenize", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert reference.tokenizer.decode(tokens) == "<user>hi"  # --chat-template given as the template itself
    sampled = {"model": NAME, "prompt": "The quick", "max_tokens": 12, "temperature": 1.0, "seed": 2, "n": 3}
    texts = {c["text"] for c in httpx.post(configured.url + "/v1/completions", headers=AUTH,
                                            json=sampled).json()["choices"]}
    assert len(texts) > 1  # a request's own temperature wins over the default


def test_cors_preflight_answers_the_allowed_origin_without_the_key(configured):
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(configured.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = httpx.options(configured.url + "/v1/chat/completions", headers=preflight | {"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(configured.url + "/v1/completions", headers={"Origin": "http://ui.example"},
                   json={"model": NAME, "prompt": "hi"})
    assert r.status_code == 401  # the key still guards the routes


def test_serve_reads_the_generation_config_and_refuses_bad_flags(hf_llama, tmp_path, capsys):
    import json
    import shutil

    from megapipe.cli import main
    from stages.serve import _sampling_defaults

    model = tmp_path / "model"
    shutil.copytree(hf_llama[0], model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "do_sample": True,
                                                              "temperature": 0.6, "top_p": 0.9,
                                                              "max_new_tokens": 64}))
    assert _sampling_defaults("auto", str(model)) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert _sampling_defaults("vllm", str(model)) == {}
    assert _sampling_defaults(str(model), str(hf_llama[0]))["temperature"] == 0.6
    bad_json, hot = tmp_path / "bad_json", tmp_path / "hot"
    for where, text in ((bad_json, "{temperature: 1"), (hot, json.dumps({"temperature": "hot"}))):
        where.mkdir()
        (where / "generation_config.json").write_text(text)
    for args, message in (
            (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
            (["--generation-config", str(tmp_path / "none")], "is not auto, vllm or a directory holding a "
                                                             "generation_config.json"),
            (["--chat-template", "nonesuch"], "--chat-template 'nonesuch' is neither a known template nor a file"),
            (["--chat-template", "{% for m in messages %}"], "--chat-template"),
            (["--chat-template", "{{ messages | nosuchfilter }}"],
             "--chat-template:1: the chat template is not valid Jinja (No filter named 'nosuchfilter'.)"),
            (["--generation-config", str(bad_json)], f"{bad_json / 'generation_config.json'} is not valid JSON"),
            (["--generation-config", str(hot)], f"{hot / 'generation_config.json'}: temperature = 'hot' is not a "
                                                f"number"),
            (["--allowed-origins", "[1]"], "is not a JSON list of strings"),
            (["--reasoning-parser", "x"], "--reasoning-parser 'x' is not one of deepseek_r1, qwen3"),
            (["--prompt-lookup-min", "1"], "--prompt-lookup-min 1 applies to --speculative-method ngram only (here: "
                                           "no speculation)")):
        assert main(["serve", str(model), "--port", "0", *args]) != 0, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)


def test_vllm_gets_the_template_generation_config_and_origins(tmp_path):
    from megapipe.inference.vllm_engine import vllm_command

    cmd = vllm_command(tmp_path / "python", tmp_path, host="127.0.0.1", port=1, api_key=None, served_model_name="m",
                       max_num_seqs=8, max_model_len=None, dtype="auto", chat_template="{{ x }}",
                       generation_config="vllm", allowed_origins=["*"], reasoning_parser="qwen3")
    joined = " ".join(cmd)
    assert "--chat-template {{ x }}" in joined and "--generation-config vllm" in joined
    assert '--allowed-origins ["*"]' in joined and "--reasoning-parser qwen3" in joined


def test_serve_hands_vllm_the_adapters_speculation_and_sizes(hf_llama, adapters_dir, tmp_path):
    """serve --engine vllm passes the flags vLLM has (LoRA adapters, n-gram speculation, --num-blocks, the log level,
    the threads' cores), names those it has not, and refuses an adapter vLLM cannot read. The vLLM environment's
    interpreter is a stand-in that answers the import probe and records its command line."""
    import json
    import os
    import subprocess
    import sys

    record = tmp_path / "argv.json"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then printf stand-in; exit 0; fi\n'
                      f'{sys.executable} -c "import json, os, sys; json.dump([sys.argv[1:], '
                      f'os.environ.get(\'VLLM_CPU_OMP_THREADS_BIND\')], open(\'{record}\', \'w\'))" "$@"\n')
    python.chmod(0o755)

    def served(*flags):
        out = subprocess.run([sys.executable, "-m", "megapipe.cli", "serve", str(hf_llama[0]), "--engine", "vllm",
                              "--vllm-python", str(python), "--port", "0", *flags], capture_output=True, text=True,
                             timeout=120, env={k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"})
        return out, (json.loads(record.read_text()) if out.returncode == 0 else None)

    out, (argv, cores) = served("--lora-modules", f"a={adapters_dir}", "--max-lora-rank", "8", "--speculative-method",
                                "ngram", "--num-speculative-tokens", "3", "--num-blocks", "500", "--log-level", "info",
                                "--threads", "2", "--max-queue", "9", "--no-engine-process")
    assert out.returncode == 0, out.stderr
    joined = " ".join(argv)
    assert f"--enable-lora --max-lora-rank 8 --max-loras 1 --lora-modules a={adapters_dir}" in joined
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert "--num-gpu-blocks-override 500" in joined and "--uvicorn-log-level info" in joined and cores == "0-1"
    assert "--max-queue, --no-engine-process do not apply to vLLM's server" in out.stderr
    out, _ = served("--lora-modules", f"b={tmp_path}")
    assert out.returncode != 0 and "--engine vllm serves peft adapter directories only" in out.stderr


def test_reasoning_parsers_split_think_tags_and_stream_by_appending():
    from megapipe.inference.reasoning import reasoning_parser_for

    r1, qwen3 = reasoning_parser_for("deepseek_r1"), reasoning_parser_for("qwen3")
    assert r1.split("Let me see.</think>\n\nIt is 4.", True) == ("Let me see.", "\n\nIt is 4.")
    assert r1.split("<think>Hmm.</think>Yes.", True) == ("Hmm.", "Yes.")
    assert r1.split("Still thinking", True) == ("Still thinking", "")  # cut short while thinking
    assert qwen3.split("It is 4.", True) == (None, "It is 4.")  # thinking off: no tags, all content
    assert qwen3.split("<think>\nHmm.\n</think>\n\nYes.", True) == ("\nHmm.\n", "\n\nYes.")
    text = "<think>Two and two.</think>Four."
    for parser in (r1, qwen3):
        sent = ["", ""]
        for end in range(1, len(text) + 1):
            got = [x or "" for x in parser.split(text[:end], end == len(text))]
            assert all(g.startswith(s) and "<" not in g for g, s in zip(got, sent, strict=True)), (text[:end], got)
            sent = got
        assert sent == ["Two and two.", "Four."]
    with pytest.raises(Exception, match="--reasoning-parser 'x' is not one of deepseek_r1, qwen3"):
        reasoning_parser_for("x")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_reasoning_parser_fills_reasoning_content(hf_llama, name):
    """The tiny model never closes a <think>: deepseek_r1 counts its whole reply as reasoning, qwen3 (no <think>
    opened) as content; streamed as whole, and a grammar's output is never reasoning."""
    from tests.inference.test_server import LiveServer

    live = LiveServer(hf_llama[0], server_config={"reasoning_parser": name})
    try:
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        message = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=body).json()["choices"][0][
            "message"]
        text = message.get("reasoning_content") if name == "deepseek_r1" else message["content"]
        assert text and (message["content"] is None if name == "deepseek_r1" else "reasoning_content" not in message)
        streamed = {"content": "", "reasoning_content": ""}
        for e in events(live, "/v1/chat/completions", body):
            for c in e["choices"]:
                for key in streamed:
                    streamed[key] += c["delta"].get(key) or ""
        assert streamed == {"content": message["content"] or "", "reasoning_content": message.get(
            "reasoning_content") or ""}
        forced = httpx.post(live.url + "/v1/chat/completions", headers=AUTH, json=body | {
            "guided_choice": ["yes", "no"]}).json()["choices"][0]["message"]
        assert forced["content"] in ("yes", "no") and "reasoning_content" not in forced
    finally:
        live.stop()
