"""Write the local lm-eval tasks' data shipped in megapipe/eval/tasks/ from the Python standard library's own text.

    python tools/make_eval_tasks.py [--output megapipe/eval/tasks]

- megapipe_mc.jsonl (multiple choice): which built-in function / standard-library module a docstring's first line
  describes, the right name among four (three distractors drawn from the same pool);
- megapipe_gen.jsonl (generation): finish a line of The Zen of Python, and name the built-in a docstring describes;
- megapipe_text.jsonl (rolling log-likelihood): whole module docstrings, for word / byte perplexity;
- megapipe_shapes.jsonl (generation from an image, for vision-language models): rendered shapes and colours
  (megapipe.data.shapes, PNG ``data:`` URLs), answered "<colour> <shape>".

Deterministic: a fixed seed and sorted names, so one Python version always writes the same bytes (the files record
which version wrote them; the test re-runs this tool and compares bytes on that version).
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import json
import random
import re
import sys
from pathlib import Path

SEED = 1234
MODULES = sorted("""
    abc argparse ast asyncio base64 bisect bz2 calendar cmath codecs collections colorsys configparser contextlib
    copy csv dataclasses datetime decimal difflib enum fnmatch fractions functools getopt gettext glob gzip hashlib
    heapq hmac html imaplib inspect io ipaddress itertools json keyword linecache locale logging lzma math
    mimetypes operator optparse os pathlib pickle platform pprint queue quopri random re reprlib sched secrets
    selectors shelve shlex shutil signal smtplib socket sqlite3 statistics string struct subprocess tarfile
    tempfile textwrap threading timeit token tokenize traceback types typing unicodedata unittest uuid warnings
    wave weakref zipfile zlib
""".split())
TEXT_MODULES = ["argparse", "bisect", "csv", "difflib", "heapq", "json", "pickle", "shlex", "string", "textwrap",
                "timeit", "zipfile"]


def first_sentence(doc: str | None) -> str | None:
    """The docstring's first line when it reads as a plain sentence (not a signature, not blank)."""
    line = (doc or "").strip().split("\n")[0].strip()
    if not line or not line[0].isupper() or not line.endswith(".") or "(" in line.split(" ")[0] or "->" in line:
        return None
    return line


def mentions(line: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", line, re.I) is not None


def builtin_items() -> list[tuple[str, str]]:
    out = []
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or not name[0].islower() or not callable(obj) or isinstance(obj, type):
            continue
        line = first_sentence(obj.__doc__)
        if line and not mentions(line, name):
            out.append((name, line))
    return out


def module_items() -> list[tuple[str, str]]:
    out = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        line = first_sentence(mod.__doc__)
        if line and not mentions(line, name) and len(line) <= 160:
            out.append((name, line))
    return out


def multiple_choice(rng: random.Random) -> list[dict]:
    rows = []
    for what, items in (("built-in function", builtin_items()), ("standard-library module", module_items())):
        names = [n for n, _ in items]
        for name, line in items:
            choices = rng.sample([n for n in names if n != name], 3) + [name]
            rng.shuffle(choices)
            rows.append({"question": f'Which Python {what} has the docstring "{line}"?', "choices": choices,
                         "label": choices.index(name)})
    return rows


def zen_lines() -> list[str]:
    import codecs

    source = Path(importlib.util.find_spec("this").origin).read_text(encoding="utf-8")
    encoded = re.search(r's = """(.*?)"""', source, re.S).group(1)
    lines = codecs.decode(encoded, "rot13").strip().split("\n")
    return [line.strip() for line in lines[2:] if len(line.split()) >= 4]  # after the title and the blank line


def generation(rng: random.Random) -> list[dict]:
    rows = []
    for line in zen_lines():
        words = line.split()
        cut = len(words) // 2
        rows.append({"question": f"Complete the line of The Zen of Python.\nStart: {' '.join(words[:cut])}\nEnd:",
                     "answer": " ".join(words[cut:])})
    for name, line in builtin_items():
        rows.append({"question": f'The Python built-in function whose docstring is "{line}" is named:',
                     "answer": name})
    rng.shuffle(rows)
    return rows


def texts() -> list[dict]:
    rows = []
    for name in TEXT_MODULES:
        doc = (importlib.import_module(name).__doc__ or "").strip()
        if doc:
            rows.append({"title": name, "text": doc[:3000]})
    return rows


def shapes() -> list[dict]:
    from megapipe.data.shapes import QUESTION, png_data_url, shape_set

    return [{"image": png_data_url(image), "question": QUESTION, "answer": f"{colour} {shape}"}
            for image, colour, shape in shape_set(48, seed=2, balanced=True)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    body = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / "megapipe" / "eval" / "tasks"))
    out = Path(parser.parse_args(argv).output)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    files = {"megapipe_mc.jsonl": multiple_choice(rng), "megapipe_gen.jsonl": generation(rng),
             "megapipe_text.jsonl": texts(), "megapipe_shapes.jsonl": shapes()}
    for name, rows in files.items():
        write_jsonl(out / name, rows)
        print(f"{out / name}: {len(rows)} rows")
    (out / "SOURCE").write_text(f"written by tools/make_eval_tasks.py on Python {sys.version_info[0]}."
                                f"{sys.version_info[1]}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
