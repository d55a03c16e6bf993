"""Write tests/fixtures/chat_answer_format.jsonl: a small synthetic chat set whose assistant always answers in one
fixed format, ``ANSWER: <answer>`` on one line (the SFT demonstration trains a model to do so).

Questions mix arithmetic, capitals, spelling backwards, letter counts and opposites; some conversations have a
system message, some two turns, a few use ``prompt`` / ``completion`` message lists. Deterministic (seeded):
    python tools/make_chat_fixture.py [OUT.jsonl] [--count N]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Peru": "Lima", "Canada": "Ottawa", "Norway": "Oslo", "Greece": "Athens", "Cuba": "Havana",
    "Chile": "Santiago", "Poland": "Warsaw", "Ireland": "Dublin", "Portugal": "Lisbon",
}
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow", "light": "dark", "open": "closed",
             "early": "late", "happy": "sad", "old": "new", "full": "empty", "hard": "soft", "loud": "quiet"}
WORDS = ["river", "garden", "window", "planet", "silver", "castle", "forest", "pencil", "rocket", "candle", "orange",
         "bridge", "winter", "mirror", "harbor", "meadow"]
SYSTEMS = ["You are a concise assistant.", "Answer every question in the house format.", "Be brief."]


def question(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(2, 60), rng.randrange(2, 60)
        return rng.choice([f"What is {a} plus {b}?", f"Add {a} and {b}.", f"Compute {a} + {b}."]), str(a + b)
    if kind == 1:
        country = rng.choice(sorted(CAPITALS))
        return rng.choice([f"What is the capital of {country}?", f"Name the capital city of {country}."]), \
            CAPITALS[country]
    if kind == 2:
        w = rng.choice(WORDS)
        return rng.choice([f"Spell the word {w} backwards.", f"Reverse the letters of {w}."]), w[::-1]
    if kind == 3:
        w = rng.choice(WORDS)
        return rng.choice([f"How many letters are in the word {w}?", f"Count the letters of {w}."]), str(len(w))
    w = rng.choice(sorted(OPPOSITES))
    return rng.choice([f"What is the opposite of {w}?", f"Give the opposite of the word {w}."]), OPPOSITES[w]


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(2 if rng.random() < 0.25 else 1):
        q, a = question(rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": f"ANSWER: {a}"}]
    if rng.random() < 0.1:
        return {"prompt": messages[:-1], "completion": messages[-1:]}
    return {"messages": messages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(Path(__file__).parents[1] / "tests/fixtures/chat_answer_format.jsonl"))
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.count):
            f.write(json.dumps(conversation(rng)) + "\n")
    print(f"wrote {args.count} conversations to {args.out}")


if __name__ == "__main__":
    main()
