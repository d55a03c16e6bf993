"""DeepSeek-V4 training step: megapipe's model vs transformers' ``DeepseekV4ForCausalLM`` at the ``deepseek-v4-tiny``
preset's shape (h128, sliding / CSA / HCA / CSA layers, 4 hyper-connection streams, 8 experts top-2), fp32.

Both sides hold the same weights (transformers' random model, saved and imported through megapipe's bridge), take
the same batch, and run forward, cross-entropy, backward, gradient clipping and the same AdamW (torch's fused
kernel). The first losses agree (printed). The two models take turns for --rounds rounds; the summary gives the
medians and the range of the per-round ratios. Nothing here asserts a speed; use --threads 1 on a busy machine.

    .venv/bin/python tools/bench_deepseek_v4.py --rounds 3
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
from bench_steps import speed_ratio, summarize, time_steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def save_tiny(vocab: int, directory: str):
    """transformers' random DeepseekV4ForCausalLM at the deepseek-v4-tiny preset's shape, saved in ``directory`` with a
    tokenizer for the bridge -> (megapipe's ModelConfig, transformers' model)."""
    import transformers

    from megapipe.checkpoint.hf import adapter_for_arch
    from megapipe.config import ModelConfig, from_dict
    from megapipe.data.tokenizer import train_tokenizer

    cfg = from_dict(ModelConfig, {"preset": "deepseek-v4-tiny", "vocab_size": vocab})
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**adapter_for_arch(cfg.arch).hf_config(cfg)))
    hf.save_pretrained(directory)
    train_tokenizer(["a tokenizer for the bridge: the benchmark feeds token ids"] * 4, vocab_size=300,
                    output=directory)
    return cfg, hf


def models(a, directory: str):
    """(megapipe's model, transformers' model) with the same weights."""
    from megapipe.checkpoint.hf.bridge import load_hf_model

    _, hf = save_tiny(a.vocab, directory)
    return load_hf_model(directory).model.train(), hf.train()


def stepper(forward, model, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True)

    def step() -> float:
        loss = F.cross_entropy(forward(batch["tokens"]).flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    with tempfile.TemporaryDirectory() as directory:
        ours, theirs = models(a, directory)
    steps = {"megapipe": stepper(ours, ours, batch),
             "hf": stepper(lambda t: theirs(input_ids=t, use_cache=False).logits, theirs, batch)}
    results: dict = {name: [] for name in steps}
    for _ in range(a.rounds):
        for name, step in steps.items():
            results[name].append(time_steps(step, a.warmup, a.steps))
    first = {name: runs[0]["first_loss"] for name, runs in results.items()}
    print(f"deepseek-v4-tiny shape, vocab {a.vocab}, batch {a.batch} x {a.seq}, fp32, {a.threads} thread(s); "
          f"first losses {first}")
    summary = {name: summarize(runs) for name, runs in results.items()}
    for name, s in summary.items():
        print(f"{name:>9}: step {s['step'] * 1e3:.0f} ms (CPU {s['cpu'] * 1e3:.0f} ms), peak RSS {s['peak']:.0f} MB")
    print("megapipe vs transformers:", speed_ratio(summary["megapipe"], summary["hf"], "same process: one peak RSS"))


if __name__ == "__main__":
    main()
