"""What a `pipeline run` will do with each step: run it (and why), reuse its cached output, or leave it alone.

A step is a cache hit when its last attempt completed, its key is unchanged, the upstream outputs it consumed are
still the current ones (no upstream step reran since), and its output is still on disk. Anything else reruns it,
and a rerun step makes all of its downstream rerun. An interrupted or failed training step with an unchanged key
resumes from its newest checkpoint instead of starting over; one whose key changed starts over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megapipe.errors import MegapipeError
from megapipe.pipeline.keys import all_keys, step_key
from megapipe.pipeline.spec import Pipeline
from megapipe.pipeline.stages import latest_checkpoint_step, output_complete
from megapipe.pipeline.state import DONE, FAILED, QUEUED, RUNNING, read_state

RUN, CACHED, SKIP = "run", "cached", "skip"


@dataclass
class Decision:
    name: str
    action: str  # run | cached | skip
    reason: str
    key: str
    material: dict
    record: Optional[dict]
    resume_from: Optional[int] = None  # checkpoint step an interrupted training step continues from
    valid: bool = False  # completed with the current key and inputs (whatever the action)
    why: str = ""  # why it is not valid


def check_selection(pipeline: Pipeline, start: Optional[str], until: Optional[str], force: list[str]) -> None:
    for flag, names in (("--from", [start] if start else []), ("--until", [until] if until else []),
                        ("--force", force)):
        for n in names:
            if n not in pipeline.steps:
                raise MegapipeError(f"{flag} {n}: no step '{n}' in {pipeline.file} (steps: "
                                    f"{', '.join(pipeline.steps)})")
    if start and until and start not in pipeline.upstream_closure({until}):
        raise MegapipeError(f"--from {start} --until {until}: '{until}' does not depend on '{start}', so nothing "
                            "lies between them")


def make_plan(pipeline: Pipeline, start: Optional[str] = None, until: Optional[str] = None,
              force: Optional[list[str]] = None) -> list[Decision]:
    """One decision per step in execution order. ``start`` (--from): that step (forced) and its downstream only;
    ``until``: that step and its upstream only; ``force``: rerun these (and so their downstream) even if cached."""
    force = list(force or [])
    check_selection(pipeline, start, until, force)
    selected = set(pipeline.steps)
    if start:
        selected &= pipeline.downstream({start})
        force.append(start)
    if until:
        selected &= pipeline.upstream_closure({until})
    keys: dict[str, str] = {}
    decisions: dict[str, Decision] = {}
    for name in pipeline.order:
        step = pipeline.steps[name]
        key, material = step_key(pipeline, name, keys)
        keys[name] = key
        rec = read_state(pipeline.step_dir(name))
        valid, why = _validity(pipeline, name, key, material, rec, decisions)
        d = Decision(name, CACHED if valid else RUN, why, key, material, rec, valid=valid, why=why)
        if name not in selected:
            d.action, d.reason = SKIP, "not selected" + (f" ({why})" if not valid else "")
        elif name in force:
            d.action, d.reason = RUN, "--from" if name == start else "--force"
        if d.action == RUN and name not in force and step.output.resume and rec \
                and rec.get("state") in (FAILED, RUNNING, QUEUED):
            last = latest_checkpoint_step(pipeline.output_path(name))
            if last is not None and rec.get("key") == key:
                d.resume_from = last
                d.reason += f"; resumes from its checkpoint at step {last}"
            elif last is not None:  # another run now: its checkpoints are removed before it starts
                d.reason += f"; {describe_change(rec.get('material') or {}, material)}, so it starts over"
        decisions[name] = d
    for d in decisions.values():  # a step that runs needs every upstream step done or running before it
        if d.action != RUN:
            continue
        for u in pipeline.steps[d.name].upstream:
            up = decisions[u]
            if up.action == SKIP and not up.valid:
                raise MegapipeError(f"step '{d.name}' needs step '{u}', which is not done ({up.why}): include it "
                                    "(drop --from / --until, or start earlier)")
    return [decisions[n] for n in pipeline.order]


def _validity(pipeline: Pipeline, name: str, key: str, material: dict, rec: Optional[dict],
              decided: dict[str, Decision]) -> tuple[bool, str]:
    """(completed and reusable, the reason when not)."""
    if rec is None:
        return False, "not run yet"
    state = rec.get("state")
    if state == FAILED:
        return False, _short(rec.get("error") or "failed")
    if state in (RUNNING, QUEUED):
        job = f" as Slurm job {rec['job_id']}" if rec.get("job_id") else ""
        return False, f"its last attempt never finished ({state}{job})"
    if state != DONE:
        return False, f"unknown state {state!r}"
    if rec.get("key") != key:
        why = describe_change(rec.get("material") or {}, material)
        changed = why.split("'")[1] if why.startswith("upstream '") else None
        return False, (f"upstream '{changed}' reruns" if changed and decided[changed].action == RUN else why)
    for u in pipeline.steps[name].upstream:
        up = decided[u]
        if up.action == RUN:
            return False, f"upstream '{u}' reruns"
        consumed = (rec.get("inputs") or {}).get(u)
        current = (up.record or {}).get("generation")
        if consumed != current:
            return False, f"upstream '{u}' reran since"
    if not output_complete(pipeline.steps[name].output, pipeline.reference(name, "output")):
        return False, "its output is missing"
    return True, "cached"


def describe_change(old: dict, new: dict) -> str:
    """Why two key materials differ, in a few words (the first difference found)."""
    old_opts, new_opts = old.get("options", {}), new.get("options", {})
    changed = [k for k in sorted(set(old_opts) | set(new_opts)) if old_opts.get(k) != new_opts.get(k)]
    if changed:
        k = changed[0]
        more = f" (+{len(changed) - 1} more)" if len(changed) > 1 else ""
        return f"option {k} changed: {_short(repr(old_opts.get(k)), 30)} -> {_short(repr(new_opts.get(k)), 30)}{more}"
    if old.get("stage") != new.get("stage"):
        return f"stage changed: {old.get('stage')} -> {new.get('stage')}"
    if old.get("megapipe") != new.get("megapipe"):
        return f"megapipe version changed: {old.get('megapipe')} -> {new.get('megapipe')}"
    old_in, new_in = old.get("inputs", {}), new.get("inputs", {})
    for path in sorted(set(old_in) | set(new_in)):
        if old_in.get(path) != new_in.get(path):
            return f"input {path} changed"
    old_up, new_up = old.get("upstream", {}), new.get("upstream", {})
    for u in sorted(set(old_up) | set(new_up)):
        if old_up.get(u) != new_up.get(u):
            return f"upstream '{u}' changed"
    return "its key changed"


def _short(text: str, limit: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["CACHED", "RUN", "SKIP", "Decision", "all_keys", "make_plan"]
