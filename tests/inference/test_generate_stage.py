"""``megapipe generate`` end to end on a checkpoint saved through megapipe.checkpoint.save_checkpoint."""

from __future__ import annotations

import json

import pytest

from megapipe.cli import main
from megapipe.config import ModelConfig
from megapipe.inference import generate
from megapipe.models import build_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from megapipe.checkpoint import save_checkpoint
    from megapipe.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gen")
    tok = train_tokenizer(["The quick brown fox jumps over the lazy dog."] * 20, vocab_size=280, output=root / "tok")
    cfg = ModelConfig(vocab_size=280, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, init_std=0.3, tie_embeddings=True)
    model = build_model(cfg, seed=0)
    save_checkpoint(root / "run", 5, model, manifest={"model": cfg, "stage": "pretrain"}, tokenizer=root / "tok")
    return root / "run", model, tok


def test_generate_stage_prints_the_library_completions(run_dir, capsys):
    run, model, tok = run_dir
    prompts = ["The quick", "A lazy dog"]
    expected = generate(model, tok, prompts, 6, temperature=0.8, top_k=20, seed=4)
    args = ["generate", str(run), "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "6",
            "--temperature", "0.8", "--top-k", "20", "--seed", "4", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == [{"prompt": p, "completion": c} for p, c in zip(prompts, expected, strict=True)]
    assert main(["generate", str(run), "--prompt", "The quick", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == "The quick" + generate(model, tok, ["The quick"], 6)[0] + "\n"


def test_generate_stage_bad_input_is_one_error_line(run_dir, tmp_path, capsys):
    run, _, _ = run_dir
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) != 0
    assert main(["generate", str(run), "--prompt", "x", "--top-p", "1.5"]) != 0
    err = capsys.readouterr().err
    assert "--top-p = 1.5 must be within (0, 1]" in err and "Traceback" not in err
    assert main(["generate", str(run), "--prompt", "x", "--stop", "."] + ["--stop", ""]) != 0
    assert "--stop = ['.', ''] holds an empty string" in capsys.readouterr().err


def test_generate_stage_on_a_hugging_face_directory(hf_llama, capsys):
    from megapipe.inference import LLMEngine, SamplingParams

    path, _ = hf_llama
    want = LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16").generate(
        ["The quick"], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].text
    assert main(["generate", str(path), "--prompt", "The quick", "--max-new-tokens", "5", "--dtype", "bfloat16",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"prompt": "The quick", "completion": want}]
    assert main(["generate", str(path), "--prompt", "x", "--dtype", "int3"]) != 0
    assert "--dtype 'int3' is not one of" in capsys.readouterr().err
    assert main(["generate", str(path), "--prompt", "x", "--bf16", "--dtype", "float16"]) != 0
    assert "--bf16 and --dtype float16 ask for two dtypes: give one" in capsys.readouterr().err


def test_generate_stage_speculative_tokens(run_dir, tmp_path, capsys):
    """--speculative-tokens drafts with the model's MTP modules: the greedy text is the one without drafts; a model
    without them is refused by the capability table."""
    from megapipe.checkpoint import save_checkpoint

    run, _, tok = run_dir
    assert main(["generate", str(run), "--prompt", "x", "--speculative-tokens", "2"]) != 0
    assert "generate of Llama models does not support engine speculative" in capsys.readouterr().err
    cfg = ModelConfig(vocab_size=280, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, init_std=0.3, tie_embeddings=True, mtp_num_layers=1)
    save_checkpoint(tmp_path / "mtp", 1, build_model(cfg, seed=0), manifest={"model": cfg, "stage": "pretrain"},
                    tokenizer=run.parent / "tok")
    texts = []
    for k in ("0", "3"):
        assert main(["generate", str(tmp_path / "mtp"), "--prompt", "The quick", "--prompt", "A lazy dog",
                     "--max-new-tokens", "12", "--speculative-tokens", k, "--json"]) == 0
        texts.append(json.loads(capsys.readouterr().out))
    assert texts[0] == texts[1]


def test_generate_stage_ngram_speculation(run_dir, capsys):
    """--speculative-method ngram drafts from the prompt for a model without MTP modules: the same greedy text; a bad
    method or lookup range, or a lookup bound without ngram, is refused before the model loads."""
    run, _, _ = run_dir
    prompt = ["--prompt", "the cat sat on the mat. the cat sat on the", "--max-new-tokens", "16", "--json"]
    texts = []
    for extra in ([], ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1"]):
        assert main(["generate", str(run), *prompt, *extra]) == 0
        texts.append(json.loads(capsys.readouterr().out))
    assert texts[0] == texts[1]
    assert main(["generate", str(run), "--prompt", "x", "--speculative-method", "eagle", "--speculative-tokens", "2"]) != 0
    assert "--speculative-method = 'eagle' is not one of" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", "x", "--speculative-method", "ngram", "--speculative-tokens", "2",
                 "--prompt-lookup-min", "5", "--prompt-lookup-max", "3"]) != 0
    assert "--prompt-lookup-min = 5 exceeds --prompt-lookup-max = 3" in capsys.readouterr().err
    # a lookup bound that would do nothing: without speculation, or with the MTP drafter
    for extra, here in (([], "no speculation"), (["--speculative-tokens", "2"], "mtp")):
        assert main(["generate", str(run), "--prompt", "x", "--prompt-lookup-max", "6", *extra]) != 0
        assert f"--prompt-lookup-max 6 applies to --speculative-method ngram only (here: {here})" in \
            capsys.readouterr().err


def test_prompt_lookup_help_says_the_engines_defaults():
    from megapipe.inference.engine import EngineConfig
    from stages.common import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN

    assert PROMPT_LOOKUP_MAX.help.endswith(f"[default: {EngineConfig().prompt_lookup_max}].")
    assert PROMPT_LOOKUP_MIN.help.endswith(f"[default: {EngineConfig().prompt_lookup_min}].")
