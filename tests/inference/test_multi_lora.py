"""Many LoRA adapters on one base in one batch (megapipe/inference/lora.py): a peft adapter directory (made by peft)
and a megapipe LoRA checkpoint, served together with the base model, each row giving what the merged model gives
(fp32: the same greedy tokens, logprobs within 1e-5 relative); the peft directory read as peft merges it; LRU residency;
refusals; the server's /v1/models, per-request ``model``, 404, and the load / unload routes."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from megapipe.checkpoint.hf.peft import read_adapters
from megapipe.checkpoint.load import load_model
from megapipe.errors import ConfigError, MegapipeError
from megapipe.inference import LLMEngine, SamplingParams, kernels
from megapipe.inference.engine import EngineConfig
from megapipe.inference.sampling import ParamError

PROMPTS = [[5, 17, 9, 33, 2, 71, 8, 19], [44, 3, 120], [7, 7, 8, 9, 200, 31, 64, 64, 12, 5, 77, 3, 90, 14, 2, 6, 8]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def adapters(hf_llama, tmp_path_factory):
    return make_adapters(hf_llama, tmp_path_factory.mktemp("loras"))


def make_adapters(hf_llama, root):
    """{"peft": a peft directory (rank 4 on every projection, made by peft itself), "run": a megapipe LoRA checkpoint
    (rank 8 on q, v, down)} under ``root``, and peft's merged transformers model of the first."""
    import peft

    from megapipe.checkpoint import write_checkpoint
    from megapipe.models.lora import LoRASpec, apply_lora, lora_layers

    hf_dir, hf_model = hf_llama
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with_peft = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with_peft.save_pretrained(root / "peft")
    merged_hf = with_peft.merge_and_unload().eval()

    loaded = load_model(hf_dir, torch.device("cpu"), torch.float32)
    spec = LoRASpec(rank=8, alpha=4.0, dropout=0.0, targets=("q", "v", "down"))
    model = apply_lora(loaded.model, spec, seed=0)
    with torch.no_grad():
        for _, m in lora_layers(model):
            m.lora_B.weight.normal_(0, 0.2)
    write_checkpoint(root / "run", model, manifest={"model": model.cfg, "stage": "sft", "lora": spec.to_manifest()})
    return {"peft": root / "peft", "run": root / "run"}, merged_hf


def merged_engine(hf_dir, path=None) -> LLMEngine:
    """An engine on the base model with the adapter at ``path`` folded into its weights (fp32)."""
    loaded = load_model(hf_dir, torch.device("cpu"), torch.float32)
    if path is not None:
        _, scale, weights = read_adapters(path, loaded.model.cfg)
        state = loaded.model.state_dict()
        with torch.no_grad():
            for name, (a, b) in weights.items():
                state[name].add_(scale * b @ a)
    return LLMEngine(loaded.model, None, EngineConfig(block_size=4, num_blocks=256), eos_token_ids=[0])


def lora_engine(hf_dir, loras: dict, dtype=torch.float32, **config) -> LLMEngine:
    loaded = load_model(hf_dir, torch.device("cpu"), dtype)
    e = LLMEngine(loaded.model, None, EngineConfig(block_size=4, num_blocks=256, **config), eos_token_ids=[0])
    for name, path in loras.items():
        e.load_lora(name, path)
    return e


def run(engine: LLMEngine, requests: list[tuple[list[int], object]]) -> list:
    """Every (prompt, adapter name or None) as one continuous batch; the outputs in order."""
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, GREEDY, lora=lora)
    done = {}
    while len(done) < len(requests):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"r{i}"] for i in range(len(requests))]


def same(got, want) -> None:
    """The same tokens; every logprob (the chosen token's and the top 3) within 1e-5 relative: fp32 round-off of
    W x + s B (A x) against (W + s B A) x."""
    assert got.token_ids == want.token_ids
    for (lg, tg), (lw, tw) in zip(got.logprobs, want.logprobs, strict=True):
        assert [i for i, _ in tg] == [i for i, _ in tw]
        for a, b in [(lg, lw)] + [(a, b) for (_, a), (_, b) in zip(tg, tw, strict=True)]:
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (a, b)


def test_peft_directory_reads_as_peft_merges_it(hf_llama, adapters):
    paths, merged_hf = adapters
    engine = merged_engine(hf_llama[0], paths["peft"])
    with torch.no_grad():
        want = merged_hf(torch.tensor([PROMPTS[0]])).logits[0]
        got = engine.runner.model(torch.tensor([PROMPTS[0]]))[0]
    assert (got - want).abs().max() < 1e-4
    rank, scale, weights = read_adapters(paths["peft"], engine.model_config)
    assert (rank, scale, len(weights)) == (4, 2.0, 7 * engine.model_config.num_layers)


@pytest.mark.parametrize("pack,cpu_kernels", [(None, None), (True, False), (False, False)],
                         ids=["own_kernels", "onednn", "torch_path"])
def test_a_batch_mixing_base_and_two_adapters_equals_the_merged_models(hf_llama, adapters, pack, cpu_kernels):
    """Every prompt under the base and both adapters, all in one continuous batch (shared prompts: the prefix cache
    must keep each adapter's KV apart), equals each merged model on its own: on megapipe's kernels (the low-rank
    sums as extra inputs of the base matmuls), on oneDNN's packed matmuls and on plain torch modules (a matmul
    more for the sums)."""
    paths, _ = adapters
    hf_dir = hf_llama[0]
    want = {None: merged_engine(hf_dir).generate(PROMPTS, GREEDY)}
    for name in ("peft", "run"):
        want[name] = merged_engine(hf_dir, paths[name]).generate(PROMPTS, GREEDY)
    engine = lora_engine(hf_dir, paths, max_loras=2, pack_weights=pack, cpu_kernels=cpu_kernels)
    on_own = pack is None and kernels.f32_linear_built()
    assert all(layer.own == on_own for layer in engine.adapters.layers.values())
    requests = [(p, name) for p in PROMPTS for name in (None, "peft", "run")]
    got = run(engine, requests)
    for (prompt, name), out in zip(requests, got, strict=True):
        same(out, want[name][PROMPTS.index(prompt)].outputs[0])
    assert want["peft"][0].outputs[0].token_ids != want[None][0].outputs[0].token_ids  # the adapters do something
    assert engine.blocks.usage() == 0.0
    # a prompt's blocks cached under the base are found again by the base only, under an adapter by that adapter
    engine.blocks.reset_prefix_cache()
    same(run(engine, [(PROMPTS[2], None)])[0], want[None][2].outputs[0])
    hits = engine.blocks.hit_tokens
    same(run(engine, [(PROMPTS[2], "run")])[0], want["run"][2].outputs[0])
    assert engine.blocks.hit_tokens == hits
    same(run(engine, [(PROMPTS[2], "run")])[0], want["run"][2].outputs[0])
    assert engine.blocks.hit_tokens > hits


@pytest.mark.parametrize("dtype,max_rank", [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 9)])
def test_direct_kernel_calls_with_adapters_give_the_modules_values_bit_for_bit(hf_llama, adapters, dtype, max_rank,
                                                                                monkeypatch):
    """A batch mixing the base and two adapters through DecoderLayer.direct (the low-rank sums as the kernels' extra
    inputs over each row's band) gives the modules' path's tokens and logprobs to the bit; an odd max rank makes
    q/k/v's band of 3 x 9 one column wider (bf16 reads inputs in pairs: its bands start at even columns)."""
    from megapipe.inference import runner as runner_module

    built = kernels.f32_linear_built() if dtype == torch.float32 else kernels.bf16_linear_built()
    if not built:
        pytest.skip("megapipe's linear kernel for this dtype is not built on this CPU")
    paths, _ = adapters
    engine = lora_engine(hf_llama[0], paths, dtype=dtype, max_loras=2, max_lora_rank=max_rank, bf16_linear="own")
    assert engine.runner.direct_rows == kernels.OWN_ALWAYS
    calls, real = [], runner_module.DecoderLayer.direct
    monkeypatch.setattr(runner_module.DecoderLayer, "direct", lambda self, *a: calls.append(1) or real(self, *a))
    requests = [(p, name) for p in PROMPTS for name in (None, "peft", "run")]
    pick = lambda outs: [(o.token_ids, o.logprobs) for o in outs]  # noqa: E731
    direct = pick(run(engine, requests))
    assert calls
    qkv = next(layer for layer in engine.adapters.layers.values() if len(layer.names) == 3)  # a fused q/k/v
    assert qkv.band == -(-3 * max_rank // 2) * 2 and qkv.width >= 2 * qkv.band
    calls.clear()
    engine.runner.direct_rows = 0
    engine.blocks.reset_prefix_cache()
    assert pick(run(engine, requests)) == direct and not calls
    assert direct[1][0] != direct[0][0]  # the adapters do something


def test_an_adapter_without_weights_in_a_layer_takes_no_band_there(hf_llama, adapters):
    """"run" adapts q, v and down only: in the o and gate/up layers its rows get no band (the kernels skip them), and
    a step whose rows are all "run" or the base adds nothing there; the outputs stay the merged models'."""
    paths, _ = adapters
    engine = lora_engine(hf_llama[0], paths, max_loras=2)
    slots = engine.adapters
    got = run(engine, [(PROMPTS[0], "peft"), (PROMPTS[0], "run"), (PROMPTS[1], None)])
    for out, name, i in zip(got, ("peft", "run", None), (0, 0, 1), strict=True):
        same(out, merged_engine(hf_llama[0], paths[name] if name else None).generate(PROMPTS, GREEDY)[i].outputs[0])
    peft, adapted = slots.resident["peft"], slots.layers
    wo, qkv = adapted["layers.0.attention.wo.weight"], adapted["layers.0.attention.wq.weight"]
    assert wo.holding == {peft} and qkv.holding == {peft, slots.resident["run"]}
    slots.set_rows([0, slots.resident["run"], peft, slots.resident["run"]])
    assert slots.bands(wo.band, wo.holding).start.tolist() == [-1, -1, (peft - 1) * wo.band, -1]
    run_start = (slots.resident["run"] - 1) * qkv.band
    assert slots.bands(qkv.band, qkv.holding).start.tolist() == [-1, run_start, (peft - 1) * qkv.band, run_start]
    slots.set_rows([slots.resident["run"], 0])
    assert wo.low(torch.zeros(2, wo.in_features)) == (None, None)
    assert qkv.low(torch.zeros(2, qkv.in_features))[0] is not None


def test_ngram_speculation_with_adapters_keeps_each_adapters_greedy_tokens(hf_llama, adapters):
    """n-gram drafts verified under each row's adapter (verification rows beside decodes in adapter order): the
    same greedy tokens as without speculation, with drafts verified (repetitive prompts give the lookup matches)."""
    paths, _ = adapters
    repetitive = [p * 3 for p in PROMPTS]
    requests = [(p, name) for p in repetitive for name in (None, "peft", "run")]
    plain = run(lora_engine(hf_llama[0], paths, max_loras=2), requests)
    engine = lora_engine(hf_llama[0], paths, max_loras=2, speculative_tokens=3, speculative_method="ngram")
    drafted = run(engine, requests)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert sum(engine.speculator.drafted) > 0


def test_lru_residency(hf_llama, adapters):
    """One slot for two adapters: each is loaded when its request is admitted, over the other when that one no longer
    runs; the outputs stay those of the merged models."""
    paths, _ = adapters
    engine = lora_engine(hf_llama[0], paths, max_loras=1)
    slots = engine.adapters
    want = {name: merged_engine(hf_llama[0], paths[name]).generate(PROMPTS[:2], GREEDY) for name in paths}
    got = run(engine, [(PROMPTS[0], "peft"), (PROMPTS[0], "run"), (PROMPTS[1], "peft"), (PROMPTS[1], "run")])
    for out, (i, name) in zip(got, [(0, "peft"), (0, "run"), (1, "peft"), (1, "run")], strict=True):
        same(out, want[name][i].outputs[0])
    assert slots.num_loads == 2 and len(slots.resident) == 1  # the second "peft" went ahead of "run": one load each
    # the least recently used adapter no running sequence holds is the one replaced
    engine = lora_engine(hf_llama[0], {"a": paths["peft"], "b": paths["run"], "c": paths["peft"]}, max_loras=2)
    slots = engine.adapters
    assert slots.acquire("a", set()) and slots.acquire("b", set()) and slots.acquire("a", set())
    assert not slots.acquire("c", {"a", "b"})
    assert slots.acquire("c", {"a"}) and list(slots.resident) == ["a", "c"]


def test_refusals(hf_llama, adapters, tmp_path):
    paths, _ = adapters
    engine = lora_engine(hf_llama[0], {"peft": paths["peft"]}, max_loras=1, max_lora_rank=4)
    with pytest.raises(ParamError, match="no LoRA adapter 'nope' is loaded"):
        engine.add_request("x", PROMPTS[0], GREEDY, lora="nope")
    with pytest.raises(MegapipeError, match="has rank 8, more than --max-lora-rank 4"):
        engine.load_lora("big", paths["run"])
    with pytest.raises(MegapipeError, match="does not exist"):
        engine.load_lora("gone", tmp_path / "nothing")
    with pytest.raises(ParamError, match="already loaded"):
        engine.load_lora("peft", paths["peft"])
    engine.add_request("busy", PROMPTS[0], GREEDY, lora="peft")
    with pytest.raises(ParamError, match="serves 1 request"):
        engine.remove_lora("peft")
    engine.abort("busy")
    engine.remove_lora("peft")
    assert engine.lora_adapters() == {}
    with pytest.raises(ConfigError, match="this engine serves no LoRA adapters"):
        lora_engine(hf_llama[0], {"peft": paths["peft"]})
    with pytest.raises(ConfigError, match="--max-loras = -1 must be an integer >= 0"):
        lora_engine(hf_llama[0], {}, max_loras=-1)


def test_broken_adapters_are_one_sentence_naming_the_file(hf_llama, adapters, tmp_path):
    """A damaged peft directory (config not JSON, no rank, truncated weights) or a path that is no adapter: a
    MegapipeError naming the file and what is wrong, from read_adapters, from the server's load route (a 400, not
    a 500), and from serve --lora-modules (naming the flag)."""
    import json
    import shutil

    from megapipe.inference.engine_core import CoreSpec
    from tests.inference.test_server import KEY, LiveServer

    peft_dir = adapters[0]["peft"]
    bad = {}
    for name in ("badcfg", "norank", "trunc"):
        shutil.copytree(peft_dir, tmp_path / name)
        bad[name] = tmp_path / name
    (bad["badcfg"] / "adapter_config.json").write_text("{r: 4")
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    (bad["norank"] / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "r"}))
    weights = bad["trunc"] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    bad |= {"file": tmp_path / "file", "empty": tmp_path / "empty", "base": hf_llama[0]}
    messages = {"badcfg": "adapter_config.json cannot be read as JSON",
                "norank": "adapter_config.json: r = None must be the adapter's rank",
                "trunc": "adapter_model.safetensors cannot be read as safetensors",
                "file": "is not a LoRA adapter: neither a peft adapter directory",
                "empty": "is not a LoRA adapter: neither a peft adapter directory",
                "base": "is not a LoRA adapter: neither a peft adapter directory"}
    model_cfg = load_model(hf_llama[0], torch.device("cpu"), torch.float32).model.cfg
    for name, path in bad.items():
        with pytest.raises(MegapipeError) as e:
            read_adapters(path, model_cfg)
        assert messages[name] in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    server = LiveServer(hf_llama[0], max_loras=1, max_lora_rank=8)
    try:
        for name, path in bad.items():
            r = httpx.post(server.url + "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {KEY}"},
                           json={"lora_name": name, "lora_path": str(path)})
            assert r.status_code == 400 and messages[name] in r.json()["error"]["message"], (name, r.text)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
    with pytest.raises(MegapipeError, match=r"^--lora-modules t=\S+trunc: \S+ cannot be read as safetensors"):
        CoreSpec(str(hf_llama[0]), EngineConfig(max_loras=1, max_lora_rank=8), loras={"t": str(bad["trunc"])}).build()


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine_thread", "engine_process"])
def test_server_routes(hf_llama, adapters, tmp_path, engine_process):
    from tests.inference.test_server import KEY, NAME, LiveServer

    paths, _ = adapters
    live = LiveServer(hf_llama[0], max_loras=2, engine_process=engine_process)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        post = lambda route, body: httpx.post(live.url + route, json=body, headers=auth, timeout=60)  # noqa: E731
        r = post("/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(paths["run"])})
        assert r.status_code == 200, r.text
        assert httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}).status_code \
            == 401  # behind the API key
        r = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "missing")})
        assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
        models = httpx.get(live.url + "/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(NAME, None), ("ad", NAME)]
        want = merged_engine(hf_llama[0], paths["run"]).generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
        base = merged_engine(hf_llama[0]).generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
        for model, tokens in (("ad", want), (NAME, base)):
            body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            r = post("/v1/completions", body)
            assert r.status_code == 200 and r.json()["model"] == model
            assert r.json()["choices"][0]["text"] == live.engine.tokenizer.decode(tokens)
            stream = httpx.post(live.url + "/v1/completions", json={**body, "stream": True}, headers=auth, timeout=60)
            assert stream.status_code == 200 and f'"model": "{model}"' in stream.text
        r = post("/v1/completions", {"model": "other", "prompt": "x"})
        assert r.status_code == 404 and "`other` does not exist" in r.json()["error"]["message"]
        metrics = httpx.get(live.url + "/metrics", headers=auth).text
        info = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} '
        assert info in metrics
        import time

        assert abs(float(metrics.split(info)[1].split()[0]) - time.time()) < 60  # the wall-clock time, as vLLM's
        # vLLM's load_inplace: new weights under the same name
        r = post("/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(paths["peft"])})
        assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
        assert post("/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(paths["peft"]),
                                              "load_inplace": True}).status_code == 200
        peft = merged_engine(hf_llama[0], paths["peft"]).generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
        r = post("/v1/completions", {"model": "ad", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
                                     "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == live.engine.tokenizer.decode(peft)
        assert post("/v1/unload_lora_adapter", {"lora_name": "ad"}).status_code == 200
        assert post("/v1/unload_lora_adapter", {"lora_name": "ad"}).status_code == 404
        assert [m["id"] for m in httpx.get(live.url + "/v1/models", headers=auth).json()["data"]] == [NAME]
        assert post("/v1/completions", {"model": "ad", "prompt": "x"}).status_code == 404
        if engine_process:  # a dead core is the server's failure (503), not the request's
            import os
            import signal

            post("/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(paths["run"])})
            os.kill(live.async_engine.process.pid, signal.SIGKILL)
            live.async_engine.process.join(10)
            for route, body in (("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(paths["run"])}),
                                ("/v1/unload_lora_adapter", {"lora_name": "ad"})):
                r = post(route, body)
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", (route, r.text)
    finally:
        live.stop()


def test_a_request_whose_adapter_has_no_slot_does_not_hold_back_the_others(hf_llama, adapters):
    """One slot: a request for the other adapter waits for it, and the base and same-adapter requests behind it start
    at once (vLLM's scheduler passes it over too); every output is still its merged model's."""
    paths, _ = adapters
    engine = lora_engine(hf_llama[0], paths, max_loras=1)
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("holds", PROMPTS[0], long, lora="peft")
    engine.step()
    for rid, lora in (("blocked", "run"), ("base", None), ("same", "peft")):
        engine.add_request(rid, PROMPTS[1], GREEDY, lora=lora)
    engine.step()
    running = {s.request.request_id for s in engine.scheduler.running}
    assert running == {"holds", "base", "same"} and [s.request.request_id for s in engine.scheduler.waiting] == [
        "blocked"]
    assert engine.stats()["waiting_lora_adapters"] == ["run"]
    assert (engine.stats()["waiting"], engine.stats()["waiting_deferred"]) == (1, 1)  # vLLM's reason "deferred"
    engine.add_request("gone", PROMPTS[1], GREEDY, lora="run")
    engine.step()
    assert (engine.stats()["waiting"], engine.stats()["waiting_deferred"]) == (2, 2)
    engine.abort("gone")  # no longer waiting: no longer deferred, before any step
    assert (engine.stats()["waiting"], engine.stats()["waiting_deferred"]) == (1, 1)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    for rid, name in (("blocked", "run"), ("same", "peft")):
        same(done[rid], merged_engine(hf_llama[0], paths[name]).generate([PROMPTS[1]], GREEDY)[0].outputs[0])
    same(done["base"], merged_engine(hf_llama[0]).generate([PROMPTS[1]], GREEDY)[0].outputs[0])


def test_rslora_and_bin_adapters_read_as_peft_merges_them(hf_llama, tmp_path):
    import peft

    hf_dir, hf_model = hf_llama
    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                             target_modules=["q_proj", "v_proj", "down_proj"])
    with_peft = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with_peft.save_pretrained(tmp_path / "rs", safe_serialization=False)
    assert (tmp_path / "rs" / "adapter_model.bin").is_file()
    merged = with_peft.merge_and_unload().eval()
    engine = merged_engine(hf_dir, tmp_path / "rs")
    with torch.no_grad():
        want = merged(torch.tensor([PROMPTS[0]])).logits[0]
        got = engine.runner.model(torch.tensor([PROMPTS[0]]))[0]
    assert (got - want).abs().max() < 1e-4
    assert read_adapters(tmp_path / "rs", engine.model_config)[1] == pytest.approx(8 / 4 ** 0.5)


def test_lora_modules_take_vllms_json_form(tmp_path):
    from stages.serve import _lora_modules

    assert _lora_modules([f"a={tmp_path}", '{"name": "b", "path": "%s", "base_model_name": "m"}' % tmp_path]) == {
        "a": str(tmp_path), "b": str(tmp_path)}
    with pytest.raises(MegapipeError, match='needs "name" and "path" strings'):
        _lora_modules(['{"name": "b"}'])


def test_bf16_kernel_path_equals_the_plain_matmuls():
    """On megapipe's bf16 kernel (where it builds) the adapted layer (its low-rank sums as extra inputs of the base
    matmul) gives what bf16 matmuls give (round-off)."""
    from megapipe.inference.lora import AdaptedInput, AdapterSlots, Part
    from megapipe.inference.runner import PackedLinear

    if not kernels.bf16_linear_built():
        pytest.skip("megapipe's bf16 kernel does not build here")
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    slots = AdapterSlots(base, max_loras=2, max_rank=4)
    linear = PackedLinear(base.weight, own=True)
    layer = AdaptedInput([Part(linear, ["w.weight"], [48])], slots)
    assert layer.own and linear.wide.shape == (3, 32 + 16, 16, 2)  # 2 slots x rank 4, padded to 32 extra inputs
    weights = {"w.weight": (torch.randn(4, 64).bfloat16(), torch.randn(48, 4).bfloat16())}
    slots.registered["x"] = slots_adapter = type("A", (), {"rank": 4, "weights": weights})()
    layer.put(2, slots_adapter)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    slots.set_rows([0, 2, 2, 0, 2])
    with torch.inference_mode():
        got, swished = linear(x).float(), linear(x, "swish").float()
    a, b = weights["w.weight"]
    want = (x @ base.weight.T).float()
    want[[1, 2, 4]] += ((x[[1, 2, 4]] @ a.T) @ b.T).float()
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)
    torch.testing.assert_close(swished, torch.nn.functional.silu(want), atol=0.1, rtol=0.02)  # SiLU after the sum
