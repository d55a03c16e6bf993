"""Every architecture the HF bridge knows through every stage, as a new user would take it: a small random
transformers model -> `import hf` -> `generate` (the engine's default path and its torch path, both token for token
transformers' `generate`) -> `serve` (a completion and a chat completion through the openai client, equal to the
engine) -> `posttrain sft` with LoRA (finite loss; the adapters exported and loaded by peft give our logits; the run's
adapters and their peft export served per request on the base give the merged model's tokens) ->
`posttrain rl` -> `posttrain dpo` and `posttrain rm` (the reward model's export scored by transformers'
...ForSequenceClassification) -> `posttrain quantize --quant fp8` -> `export trt` (unified and legacy) -> `posttrain prune` (the
FFN narrowed) -> `eval` perplexity ->
`export hf` (the source tensors back, bit for bit).

The capability table (megapipe/models/capabilities.py) decides: what an architecture declares must pass here, and
what it does not declare must be refused by the stage in one sentence naming the architecture, with nothing
written. One process, tiny shapes; the multi-process layouts are in tests/parallel/test_dist_layouts.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megapipe.cli import main
from megapipe.config import ModelConfig, from_dict
from megapipe.models.capabilities import LABELS, capabilities
from tests.eval.test_eval import direct_perplexity
from tests.helpers.hf_tiny import ARCHS, hf_greedy, make_hf_dir

FIXTURES = Path(__file__).parent / "fixtures"
CHAT = FIXTURES / "chat_answer_format.jsonl"
EXCERPT = FIXTURES / "shakespeare_excerpt.jsonl"
PROMPTS = [[5, 17, 9, 33, 2, 71, 8, 19], [44, 3, 120]]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def cli(*args) -> int:
    return main([str(a) for a in args])


def refused(capsys, *args) -> str:
    """Run a command that must be refused: non-zero exit, one sentence on stderr, no traceback."""
    capsys.readouterr()
    assert cli(*args) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    """(arch, work dir, HF dir, the transformers model, megapipe checkpoint, its ModelConfig, its capabilities)."""
    name = request.param
    work = tmp_path_factory.mktemp(f"matrix_{name}")
    hf_dir, hf_model = make_hf_dir(work / "hf", name)
    ckpt = work / "ckpt"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    manifest = json.loads((ckpt / "megapipe.json").read_text())
    cfg = from_dict(ModelConfig, manifest["model"], "model.")
    assert cfg.arch == name
    return dict(name=name, work=work, hf=hf_dir, hf_model=hf_model, ckpt=ckpt, cfg=cfg, caps=capabilities(cfg))


@pytest.fixture(scope="module")
def corpus(arch):
    """The Shakespeare excerpt as a .bin/.idx prefix in this architecture's tokenizer."""
    prefix = arch["work"] / "data" / "excerpt"
    assert cli("preprocess", "--input", EXCERPT, "--output-prefix", prefix, "--tokenizer", arch["hf"],
               "--append-eod", "--quiet") == 0
    return f"{prefix}_text_document"


def test_generate_default_and_torch_path_equal_transformers(arch, capsys, one_thread):
    from megapipe.inference import LLMEngine, SamplingParams

    want = [hf_greedy(arch["hf_model"], p, 10) for p in PROMPTS]
    params = SamplingParams(max_tokens=10, **GREEDY)
    default = LLMEngine.from_pretrained(arch["ckpt"], device="cpu")
    torch_path = LLMEngine.from_pretrained(arch["ckpt"], device="cpu", pack_weights=False, cpu_kernels=False)
    for engine in (default, torch_path):
        assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)] == want
    capsys.readouterr()
    assert cli("generate", arch["ckpt"], "--prompt", "To be, or", "--max-new-tokens", "6", "--json") == 0
    [row] = json.loads(capsys.readouterr().out)
    text = default.generate(["To be, or"], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text
    assert row["completion"] == text


def test_ngram_speculation_keeps_greedy_output(arch, one_thread):
    """Prompt-lookup drafts (on a prompt that repeats itself, so some are proposed) leave the greedy tokens as they
    are; an architecture that does not declare it is refused in one sentence."""
    from megapipe.errors import ConfigError
    from megapipe.inference import LLMEngine, SamplingParams

    spec = dict(speculative_tokens=3, speculative_method="ngram", prompt_lookup_min=1)
    if "ngram_speculative" not in arch["caps"].engine:
        with pytest.raises(ConfigError, match="--speculative-method ngram verifies drafts"):
            LLMEngine.from_pretrained(arch["ckpt"], device="cpu", **spec)
        return
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = LLMEngine.from_pretrained(arch["ckpt"], device="cpu")
    # the model's own continuation in the prompt: its next tokens are likely seen before
    prompts = [PROMPTS[0] + plain.generate([PROMPTS[0]], params)[0].outputs[0].token_ids, PROMPTS[1]]
    want = plain.generate(prompts, params)
    engine = LLMEngine.from_pretrained(arch["ckpt"], device="cpu", **spec)
    got = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_serve_completion_and_chat_equal_the_engine(arch, one_thread):
    from megapipe.data.chat_template import load_chat_template
    from megapipe.inference import LLMEngine, SamplingParams
    from tests.inference.test_server import NAME, LiveServer

    engine = LLMEngine.from_pretrained(arch["ckpt"], device="cpu")
    server = LiveServer(arch["ckpt"])
    try:
        client = server.client()
        got = client.completions.create(model=NAME, prompt="A stitch in", max_tokens=6, temperature=0)
        want = engine.generate(["A stitch in"], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
        assert got.choices[0].text == want.text
        messages = [{"role": "user", "content": "Hello world!"}]
        chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
        prompt = load_chat_template(arch["ckpt"] / "tokenizer").render(messages, add_generation_prompt=True)
        want = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
        assert chat.choices[0].message.content == want.text
    finally:
        server.stop()


def test_sft_with_lora_and_peft_parity(arch, capsys, one_thread):
    from megapipe.checkpoint.hf.peft import peft_targets

    caps, run = arch["caps"], arch["work"] / "sft"
    args = ["posttrain", "sft", "--load", arch["ckpt"], "--data", CHAT, "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
            "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1", "--save", run, "--lora-rank", "4",
            "--data-cache-path", arch["work"] / "sft_cache",
            "--lora-alpha", "8", "--quiet"]
    if "sft" not in caps.stages:
        assert LABELS[arch["name"]] in refused(capsys, *args)
        return
    if not caps.lora:  # full fine-tuning only: LoRA is refused, the run without it trains
        assert LABELS[arch["name"]] in refused(capsys, *args[:-1], "--save", arch["work"] / "sft_bad")
        full = [a for a in args if a not in ("--lora-rank", "4", "--lora-alpha", "8")]
        assert cli(*full) == 0 and not (arch["work"] / "sft_bad").exists()
        return
    if any(t not in caps.lora for t in ("gate", "up")):  # what the table does not declare is named and refused
        missing = next(t for t in ("gate", "up") if t not in caps.lora)
        err = refused(capsys, *args[:-1], "--lora-targets", f"q,{missing}", "--save", arch["work"] / "sft_bad")
        assert missing in err and not (arch["work"] / "sft_bad").exists()
    targets = ",".join(peft_targets(arch["cfg"]))  # all a peft adapter directory can hold (not GPT-2's fused qkv)
    assert cli(*args, "--lora-targets", targets) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records if r["kind"] == "train")

    from peft import PeftModel

    from megapipe.inference import LLMEngine
    from tests.helpers.hf_tiny import hf_auto_class

    step = run / "step_00000002"
    base_hf, adapter = arch["work"] / "sft_base_hf", arch["work"] / "sft_adapter"
    assert cli("export", "hf", arch["ckpt"], base_hf, "--dtype", "fp32", "--quiet") == 0
    assert cli("export", "hf", step, adapter, "--lora-adapter-only", "--quiet") == 0
    tokens = torch.tensor([PROMPTS[0]])
    merged = LLMEngine.from_pretrained(step, device="cpu")  # the adapters folded into the weights
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(hf_auto_class(base_hf).from_pretrained(base_hf), adapter).eval()
        want = peft_model(tokens).logits
        got = merged.runner.model(tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # the run's adapters and their peft export served on the base model, per request, give the merged model's tokens
    from megapipe.errors import ConfigError
    from megapipe.inference import SamplingParams

    if "multi_lora" not in caps.engine:
        with pytest.raises(ConfigError, match="serving LoRA adapters"):
            LLMEngine.from_pretrained(arch["ckpt"], device="cpu", max_loras=2)
        return
    served = LLMEngine.from_pretrained(arch["ckpt"], device="cpu", max_loras=2)
    served.load_lora("run", step)
    served.load_lora("peft", adapter)
    params = SamplingParams(max_tokens=8, **GREEDY)
    want = [o.outputs[0].token_ids for o in merged.generate(PROMPTS, params)]
    for name in ("run", "peft"):
        for i, prompt in enumerate(PROMPTS):
            served.add_request(f"{name}{i}", prompt, params, lora=name)
    done = {}
    while served.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in served.step() if o.finished})
    assert [done[f"{name}{i}"] for name in ("run", "peft") for i in range(len(PROMPTS))] == want * 2


def test_rl_two_steps(arch, capsys, one_thread):
    run = arch["work"] / "rl"
    args = ["posttrain", "rl", "--load", arch["ckpt"], "--save", run, "--task", "arithmetic",
            "--prompts-per-step", "2", "--group-size", "2", "--max-completion-tokens", "4",
            "--max-prompt-tokens", "48", "--micro-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
            "--log-interval", "1", "--precision", "fp32", "--quiet"]
    if "rl" not in arch["caps"].stages:
        assert LABELS[arch["name"]] in refused(capsys, *args)
        return
    assert cli(*args) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]


@pytest.fixture(scope="module")
def fp8(arch, corpus):
    """The fp8 checkpoint (None where quantization is not declared)."""
    if "fp8" not in arch["caps"].quant:
        return None
    out = arch["work"] / "fp8"
    assert cli("posttrain", "quantize", arch["ckpt"], "--quant", "fp8", "--calib-data", corpus,
               "--calib-samples", "4", "--calib-seq-len", "32", "--eval-iters", "1", "--output", out,
               "--quiet") == 0
    return out


def test_quantize_fp8(arch, corpus, fp8, capsys, one_thread):
    if fp8 is None:
        out = arch["work"] / "fp8_refused"
        err = refused(capsys, "posttrain", "quantize", arch["ckpt"], "--quant", "fp8", "--calib-data", corpus,
                      "--output", out)
        assert LABELS[arch["name"]] in err and not out.exists()
        return
    manifest = json.loads((fp8 / "megapipe.json").read_text())
    assert manifest["quantization"]["format"] == "fp8"
    capsys.readouterr()
    assert cli("generate", fp8, "--prompt", "To be", "--max-new-tokens", "3", "--json") == 0


def trt_limit(cfg, fmt: str) -> str:
    """What a TensorRT-LLM checkpoint of ``fmt`` cannot hold of this config ('' when nothing): unified, a GPT-OSS
    SwiGLU limit other than the one TensorRT-LLM's GPT-OSS model fixes (the tiny model's 1.5); legacy, a sliding
    window, or dense layers among MoE ones (TensorRT-LLM's MoE models route every layer)."""
    if fmt == "unified":
        return "moe_swiglu_limit" if cfg.arch == "gpt_oss" and cfg.moe_swiglu_limit != 7.0 else ""
    if cfg.sliding_window is not None:
        return "sliding_window"
    if cfg.is_moe and len(cfg.moe_layers) < cfg.num_layers:
        return "the legacy TensorRT-LLM MoE models route every layer"
    return ""


@pytest.mark.parametrize("fmt", ["unified", "legacy"])
def test_export_trt(arch, fp8, fmt, capsys):
    caps, cfg = arch["caps"], arch["cfg"]
    out = arch["work"] / f"trt_{fmt}"
    if fmt not in caps.trt:
        assert LABELS[arch["name"]] in refused(capsys, "export", "trt", arch["ckpt"], out, "--format", fmt)
        assert not out.exists()
        return
    if trt_limit(cfg, fmt):  # config limits, not the architecture's
        assert trt_limit(cfg, fmt) in refused(capsys, "export", "trt", arch["ckpt"], out, "--format", fmt)
        return
    assert cli("export", "trt", arch["ckpt"], out, "--format", fmt, "--quiet") == 0
    assert (out / "config.json").is_file()
    if fmt == "unified":  # unquantized, the unified checkpoint is the Hugging Face layout (in bf16)
        assert_same_tensors(arch["hf"], out, cast=True)
    if fp8 is not None and not (fmt == "unified" and arch["name"] == "gpt2"):
        qout = arch["work"] / f"trt_{fmt}_fp8"
        assert cli("export", "trt", fp8, qout, "--format", fmt, "--quiet") == 0
        assert (qout / "config.json").is_file()


def test_prune(arch, corpus, capsys, one_thread):
    out = arch["work"] / "pruned"
    args = ["posttrain", "prune", arch["ckpt"], "--output", out, "--calib-data", corpus, "--calib-samples", "4",
            "--valid-samples", "2", "--seq-length", "32", "--micro-batch-size", "2", "--ffn", "64"]
    if "prune" not in arch["caps"].stages:
        assert LABELS[arch["name"]] in refused(capsys, *args) and not out.exists()
        return
    assert cli(*args, "--quiet") == 0
    manifest = json.loads((out / "megapipe.json").read_text())
    assert from_dict(ModelConfig, manifest["model"], "model.").intermediate_size == 64


def test_eval_perplexity(arch, corpus, capsys, one_thread):
    out = arch["work"] / "eval"
    assert cli("eval", arch["ckpt"], "--tasks", "perplexity", "--data-path", corpus, "--limit", "2",
               "--seq-length", "32", "--output", out) == 0
    ppl = json.loads((out / "results.json").read_text())["results"]["perplexity"]
    loss, tokens = direct_perplexity(arch["hf"], corpus, 32, 2)  # transformers' own model on the same windows
    assert ppl["tokens,none"] == tokens and ppl["loss,none"] == pytest.approx(loss, rel=1e-4)


def test_export_hf_round_trip(arch):
    out = arch["work"] / "hf_again"
    assert cli("export", "hf", arch["ckpt"], out, "--dtype", "fp32", "--quiet") == 0
    assert_same_tensors(arch["hf"], out)


def assert_same_tensors(source_dir: Path, out_dir: Path, cast: bool = False) -> None:
    """The tensors of ``out_dir`` are those of ``source_dir``, names and values (``cast``: in out_dir's dtypes)."""
    from safetensors import safe_open

    def tensors(directory: Path) -> dict:
        found = {}
        for f in sorted(directory.glob("*.safetensors")):
            with safe_open(f, "pt") as s:
                found.update({k: s.get_tensor(k) for k in s.keys()})
        return found

    source, again = tensors(source_dir), tensors(out_dir)
    assert source.keys() == again.keys()
    for name, t in source.items():
        assert torch.equal(t.to(again[name].dtype) if cast else t, again[name]), name


def test_dpo_and_a_reward_model_exported_as_a_sequence_classifier(arch, capsys, one_thread):
    """`posttrain dpo` (ln 2 at the first step: the policy is its reference) and `posttrain rm`, whose export
    transformers loads as ...ForSequenceClassification and scores as megapipe's RewardModel does (1e-5)."""
    from tests.posttrain.test_dpo import write_pairs

    caps, work = arch["caps"], arch["work"]
    pairs = write_pairs(work / "pairs.jsonl")
    common = ["--load", arch["ckpt"], "--data", pairs, "--seq-length", "128", "--micro-batch-size", "2",
              "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--lr-warmup-iters", "0",
              "--eval-iters", "0", "--log-interval", "1", "--data-cache-path", work / "pref_cache", "--quiet"]
    for stage in ("dpo", "rm"):
        run = work / stage
        args = ["posttrain", stage, *common, "--save", run]
        if stage not in caps.stages:
            assert LABELS[arch["name"]] in refused(capsys, *args) and not run.exists()
            continue
        assert cli(*args) == 0
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in records if r["kind"] == "train"]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        if stage == "dpo":
            assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    if "rm" not in caps.stages or "export_hf" not in caps.stages:
        return
    from transformers import AutoModelForSequenceClassification

    from megapipe.posttrain.reward_model import RewardModel

    rm_ckpt, out = work / "rm" / "step_00000002", work / "rm_hf"
    assert cli("export", "hf", rm_ckpt, out, "--dtype", "fp32", "--quiet") == 0
    rm = RewardModel.load(rm_ckpt)
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(hf).__name__.endswith("ForSequenceClassification")
    ids = torch.full((len(PROMPTS), max(map(len, PROMPTS))), rm.pad_id)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = torch.tensor(p)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=(ids != rm.pad_id).long()).logits[:, 0].float()
    torch.testing.assert_close(torch.tensor(rm.score_ids(PROMPTS)), want, atol=1e-5, rtol=1e-5)
