"""DeepSeek-V4 in megapipe's engine (its compressed cache, megapipe.inference.compressed_cache) at the
``deepseek-v4-tiny`` preset's shape, fp32, one run:

    PYTHONPATH=. .venv/bin/python tools/bench_v4_engine.py [--batch-sizes 1 8] [--threads 1]

- decode: greedy generation of ``--new-tokens`` after random ``--prompt-len``-token prompts, the engine against
  transformers' ``generate`` on the same weights (transformers' random model, imported through the bridge), the two
  taking turns for ``--reps`` repetitions (bench_generate.py's runners): output tokens/s by wall and by CPU time, and
  whether the two produced the same tokens;
- KV bytes per token of context: one sequence prefilled to each of ``--contexts`` tokens, what it holds in the
  engine (``sequence_kv_bytes``: its blocks of the window's keys, its blocks of compressed entries; the compressors'
  carry apart) against ``plan``'s ``compressed_kv_values`` (in values, so the dtype does not matter), after the
  engine's startup line (``kv_cache_line``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
from bench_deepseek_v4 import save_tiny
from bench_generate import HFGenerate, Megapipe, prompts_for


def decode(directory: str, a) -> None:
    runners = [Megapipe(directory, torch.float32, max(a.batch_sizes), a.prompt_len + a.new_tokens + 16),
               HFGenerate(directory, torch.float32, 0, 0)]
    vocab = runners[0].engine.vocab_size
    for r in runners:
        r.run(prompts_for(1, -1, a.prompt_len, vocab), 4)  # warm-up
    for batch in a.batch_sizes:
        times = {r.name: [] for r in runners}
        same = True
        for rep in range(a.reps):
            prompts = prompts_for(batch, rep, a.prompt_len, vocab)
            ids = {}
            for r in runners:
                wall, cpu, ids[r.name] = r.run(prompts, a.new_tokens)
                times[r.name].append((wall, cpu))
            same &= ids["megapipe"] == ids["hf"]
        tokens = batch * a.new_tokens
        line = {name: (tokens / statistics.median(w for w, _ in t), tokens / statistics.median(c for _, c in t))
                for name, t in times.items()}
        print(f"batch {batch}: megapipe {line['megapipe'][0]:.1f} tok/s ({line['megapipe'][1]:.1f} per CPU s), "
              f"transformers {line['hf'][0]:.1f} tok/s ({line['hf'][1]:.1f} per CPU s): "
              f"{line['megapipe'][0] / line['hf'][0]:.2f}x by wall, {line['megapipe'][1] / line['hf'][1]:.2f}x by "
              f"CPU time; same greedy tokens: {same}")


def kv_bytes(directory: str, a) -> None:
    from megapipe.checkpoint.load import load_model
    from megapipe.inference import EngineConfig, LLMEngine, SamplingParams
    from megapipe.inference.compressed_cache import sequence_kv_bytes
    from megapipe.models.transformer import compressed_kv_values

    loaded = load_model(directory, "cpu", torch.float32)
    cfg = loaded.model.cfg
    engine = LLMEngine(loaded.model, None, EngineConfig(max_num_seqs=1, max_model_len=max(a.contexts) + 2,
                                                        prefix_caching=False), [])
    size = torch.empty(0, dtype=torch.float32).element_size()
    print(engine.kv_cache_line())
    for n in a.contexts:
        engine.add_request(str(n), torch.randint(100, cfg.vocab_size - 100, (n - 1,)).tolist(),
                           SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        seq = engine.requests[str(n)].seqs[0]
        while seq.num_computed < n - 1:  # the prompt, in chunks of max_num_batched_tokens
            engine.step()
        engine.step()  # the blocks behind the window given back; n tokens computed
        held = sequence_kv_bytes(engine, seq)
        measured = (held["window"] + held["entries"]) / size / seq.num_computed
        planned = compressed_kv_values(cfg, seq.num_computed) / seq.num_computed
        print(f"{seq.num_computed:>6} tokens: engine {measured:.2f} values/token (+ carry {held['carry'] / size:.0f} "
              f"values/sequence), plan {planned:.2f} values/token ({measured / planned:.3f}x); bf16 "
              f"{measured * 2:.1f} vs {planned * 2:.1f} bytes/token")
        engine.abort(str(n))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4094])
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"deepseek-v4-tiny shape, vocab {a.vocab}, fp32, {a.threads} thread(s), load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as directory:
        save_tiny(a.vocab, directory)
        kv_bytes(directory, a)
        decode(directory, a)


if __name__ == "__main__":
    main()
