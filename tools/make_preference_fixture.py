"""A small preference set written here (no download): arithmetic questions whose preferred answer is terse in a
fixed format (``ANSWER: <n>``) and whose dispreferred answer is the same number hedged in a sentence; both correct,
so a model learns the style, not the sums. Conversations in TRL's shape (``chosen`` / ``rejected`` message lists
sharing the user turn).

    .venv/bin/python tools/make_preference_fixture.py pipelines/data/preference.jsonl --count 80 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HEDGES = ("Hmm, let me think. I believe it could be {n}, but I am not completely sure.",
          "Well, that is a tricky one! Maybe {n}? Please double-check it yourself.",
          "I think the answer is probably {n}, although I might be wrong about that.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--count", type=int, default=80)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as f:
        for _ in range(args.count):
            a, b = rng.randint(2, 60), rng.randint(2, 60)
            user = {"role": "user", "content": f"What is {a} plus {b}?"}
            chosen = {"role": "assistant", "content": f"ANSWER: {a + b}"}
            rejected = {"role": "assistant", "content": rng.choice(HEDGES).format(n=a + b)}
            f.write(json.dumps({"chosen": [user, chosen], "rejected": [user, rejected]}) + "\n")
    print(f"{args.output}: {args.count} pairs")


if __name__ == "__main__":
    main()
