"""``megapipe eval``: lm-eval tasks and the built-in perplexity over one checkpoint, results as lm-eval writes them.

The results dict is lm-eval's (``{"results": {task: {"metric,filter": value}}, "versions", "n-shot", "configs",
"higher_is_better", "config", ...}``); the built-in ``perplexity`` task joins it as ``{"ppl,none", "loss,none",
"tokens,none"}``. It is written to ``OUTPUT/results.json`` atomically once everything has run, so a failed or
interrupted evaluation leaves no results behind (and an older results.json stays as it was).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Optional, Sequence

from megapipe.data.paths import bin_path, idx_path
from megapipe.errors import DataError, MegapipeError
from megapipe.eval.perplexity import data_perplexity
from megapipe.eval.tasks import PERPLEXITY, quiet_lm_eval, select_tasks
from megapipe.fileio import refuse_overlap, write_text_atomic
from megapipe.models.capabilities import require

RESULTS_FILE = "results.json"
log = logging.getLogger(__name__)


def split_tasks(values: Sequence[str] | str) -> list[str]:
    """``--tasks a,b --tasks c`` -> [a, b, c]."""
    values = [values] if isinstance(values, str) else list(values)
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def parse_limit(value) -> Optional[float]:
    """--limit: an integer >= 1 (documents per task) or a fraction in (0, 1) of each task, as lm-eval reads it."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise MegapipeError(f"--limit {value!r} is not a number (documents per task, or a fraction < 1)") from None
    if not math.isfinite(number) or number <= 0 or (number >= 1 and number != int(number)):
        raise MegapipeError(f"--limit {value!r} must be an integer >= 1 (documents per task) or a fraction in (0, 1)")
    return int(number) if number >= 1 else number


def default_output(ckpt: str | Path) -> Path:
    """A run directory next to the checkpoint: ``<its parent>/eval_<its name>``."""
    p = Path(ckpt).expanduser().absolute()
    return p.parent / f"eval_{p.name}"


def _check_ckpt(ckpt: str | Path) -> None:
    p = Path(ckpt).expanduser()
    if not p.exists():
        raise MegapipeError(f"checkpoint {ckpt} does not exist (give a megapipe checkpoint, run directory or "
                            f"Hugging Face model directory)")


def _check_prefixes(data_paths: Sequence[str], perplexity: bool) -> list[str]:
    prefixes = [str(Path(p).expanduser()) for p in data_paths]
    if prefixes and not perplexity:
        raise MegapipeError(f"--data-path {data_paths[0]} is read only by the perplexity task: add perplexity to "
                            f"--tasks")
    dupes = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if dupes:
        raise MegapipeError(f"--data-path names {dupes[0]} twice")
    if perplexity and not prefixes:
        raise MegapipeError("the perplexity task needs --data-path PREFIX (a megapipe .bin/.idx pair)")
    for given, prefix in zip(data_paths, prefixes, strict=True):
        for p in (bin_path(prefix), idx_path(prefix)):
            if not p.is_file():
                raise DataError(f"--data-path {given}: {p} does not exist (give the PREFIX of a .bin/.idx pair)")
    return prefixes


def _perplexity_results(results: dict, ppl: dict[str, dict], prefixes: list[str], limit) -> None:
    for name, entry in ppl.items():
        results["results"][name] = {"alias": name, "ppl,none": entry["ppl"], "loss,none": entry["loss"],
                                    "tokens,none": entry["tokens"]}
        results["versions"][name] = 1.0
        results["n-shot"][name] = 0
        results["higher_is_better"][name] = {"ppl": False, "loss": False, "tokens": True}
        results.setdefault("n-samples", {})[name] = {"original": entry["windows"], "effective": entry["windows"]}
        results["configs"][name] = {"task": name, "output_type": "loglikelihood_rolling (megapipe built-in)",
                                    "data_path": prefixes if name == PERPLEXITY else [name.split(":", 1)[1]],
                                    "seq_length": entry["seq_length"], "windows": entry["windows"], "limit": limit}


def run_eval(ckpt: str | Path, tasks: Sequence[str] | str, data_paths: Sequence[str] = (),
             include_paths: Sequence[str] = (), limit=None, num_fewshot: Optional[int] = None, batch_size: int = 16,
             output: Optional[str | Path] = None, seq_length: Optional[int] = None, max_length: Optional[int] = None,
             dtype: str = "auto", device: Optional[str] = None, bootstrap_iters: int = 1000,
             log_samples: bool = False, allow_tokenizer_mismatch: bool = False, seed: int = 1234,
             engine=None) -> tuple[dict, Path]:
    """Evaluate ``ckpt``; returns (lm-eval's results dict, the output directory holding results.json)."""
    names = split_tasks(tasks)
    limit = parse_limit(limit)
    for value, flag, low in ((num_fewshot, "--num-fewshot", 0), (batch_size, "--batch-size", 1),
                             (bootstrap_iters, "--bootstrap-iters", 0), (seq_length, "--seq-length", 1),
                             (max_length, "--max-length", 1)):
        if value is not None and (not isinstance(value, int) or value < low):
            raise MegapipeError(f"{flag} = {value!r} must be an integer >= {low}")
    if engine is None:
        _check_ckpt(ckpt)
    prefixes = _check_prefixes(list(data_paths), PERPLEXITY in names)
    out_dir = Path(output).expanduser() if output is not None else default_output(ckpt)
    inputs = [ckpt if engine is None else None, *[f for p in prefixes for f in (bin_path(p), idx_path(p))],
              *include_paths]
    refuse_overlap([out_dir], inputs)  # e.g. the checkpoint's own run directory: eval never changes what it reads
    if out_dir.exists() and not out_dir.is_dir():
        raise MegapipeError(f"--output {out_dir} exists and is not a directory")
    selection = select_tasks(names, include_paths)  # before the model loads: a bad task fails fast

    # lazy: megapipe.eval.lm imports lm_eval at its top (slow); bad options and tasks fail before
    from megapipe.eval.lm import MegapipeLM

    lm = MegapipeLM(pretrained=None if engine is not None else str(ckpt), engine=engine, batch_size=batch_size,
                    max_length=max_length, dtype=dtype, device=device)
    require(lm.engine.model_config, "eval", str(ckpt))
    if selection.images and lm.image_markers() is None:
        raise MegapipeError(f"task {selection.images[0]} shows the model images, but {ckpt} is a text-only model (no "
                            f"vision tower): evaluate a vision-language checkpoint")
    started = time.time()
    if selection.lm_eval:
        import lm_eval

        with quiet_lm_eval():
            results = lm_eval.simple_evaluate(
                model=lm, tasks=selection.lm_eval, task_manager=selection.manager, num_fewshot=num_fewshot, limit=limit,
                bootstrap_iters=bootstrap_iters, log_samples=log_samples, random_seed=seed, numpy_random_seed=seed,
                torch_random_seed=seed, fewshot_random_seed=seed)
    else:
        results = {"results": {}, "versions": {}, "n-shot": {}, "higher_is_better": {}, "configs": {},
                   "n-samples": {}, "config": {}, "date": started}
    if selection.perplexity:
        ppl = data_perplexity(lm.engine, prefixes, seq_length, limit, batch_size,
                              check_tokenizer=not allow_tokenizer_mismatch)
        _perplexity_results(results, ppl, prefixes, limit)
    results["config"].update({"model": "megapipe", "model_args": {"pretrained": str(ckpt), "dtype": dtype},
                              "batch_size": batch_size, "limit": limit, "max_length": lm.max_length,
                              "seconds": round(time.time() - started, 3)})
    _write(out_dir, results)
    return results, out_dir


def _dumps(obj, indent: Optional[int] = 2) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(obj, indent=indent, default=handle_non_serializable, ensure_ascii=False) + "\n"


def _write(out_dir: Path, results: dict) -> None:
    """results.json (and samples_<task>.jsonl when samples were logged), each renamed into place whole."""
    samples = results.pop("samples", None) or {}
    texts = {RESULTS_FILE: _dumps(results)}
    for task, rows in samples.items():
        texts[f"samples_{task}.jsonl"] = "".join(_dumps(r, None) for r in rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in sorted(texts, key=lambda n: n == RESULTS_FILE):  # results.json last: it marks a complete run
        write_text_atomic(out_dir / name, texts[name])
    if samples:
        results["samples"] = samples


def format_tables(results: dict) -> str:
    """The tables lm-eval's CLI prints (make_table): tasks, then groups if any."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text
