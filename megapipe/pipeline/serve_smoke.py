"""A smoke test of ``megapipe serve`` on a model: start the real server on a free port, ask it one completion and
one chat completion through the official ``openai`` client, write what it answered, stop it with SIGTERM.

The pipeline runs it as the ``serve-smoke`` stage (after an export, on the exported directory or a checkpoint); it
also checks a deployment by hand. The server is started as its own command (``python -m megapipe.cli serve``)
in this process's process group, so stopping the step stops it too; it is always stopped before this returns.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from megapipe.errors import MegapipeError
from megapipe.fileio import missing_parents, remove_empty

READY = re.compile(r"ready on (http://\S+?:\d+)")
RESPONSES = "responses.json"
SAMPLE = "sample.txt"
SERVER_LOG = "server.log"


def serve_smoke(model: str, output: str, prompt: str, chat: Optional[str], max_tokens: int = 32,
                stop: Optional[list[str]] = None, serve_args: Optional[list[str]] = None,
                ready_timeout: float = 300.0, request_timeout: float = 120.0, overwrite: bool = False,
                echo=None) -> dict:
    """Run the smoke test; returns what responses.json holds. Raises MegapipeError naming what failed."""
    try:
        import openai
    except ImportError:
        raise MegapipeError("serve-smoke drives the server with the official OpenAI client, which is not installed: "
                            "pip install openai") from None
    if max_tokens < 1:
        raise MegapipeError(f"--max-tokens = {max_tokens} must be >= 1")
    if not Path(model).expanduser().exists():
        raise MegapipeError(f"{model} does not exist (give a checkpoint, a run directory or a Hugging Face model dir)")
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise MegapipeError(f"--output {out} exists: pass --overwrite to replace it")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    made = missing_parents(tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise MegapipeError(f"--output {out}: cannot create it there ({e.strerror or e})") from None
    done = False
    try:
        record = _run(openai, model, tmp, prompt, chat, max_tokens, list(stop or []), list(serve_args or []),
                      ready_timeout, request_timeout, echo)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:  # a failed run leaves nothing behind
            remove_empty(made)
    return record


def _run(openai, model, tmp: Path, prompt, chat, max_tokens, stop, serve_args, ready_timeout, request_timeout,
         echo) -> dict:
    name = "smoke"
    key = secrets.token_hex(16)  # the server is not left open to the machine's other users while it runs
    cmd = [sys.executable, "-m", "megapipe.cli", "serve", str(model), "--port", "0", "--served-model-name", name,
           *serve_args]
    env = {**os.environ, "MEGAPIPE_API_KEY": key, "PYTHONUNBUFFERED": "1"}
    log = open(tmp / SERVER_LOG, "w", encoding="utf-8", errors="replace")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.PIPE, text=True,
                            errors="replace", bufsize=1)
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stderr:
            log.write(line)
            log.flush()
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        url, last = None, ""
        deadline = time.monotonic() + ready_timeout
        while url is None:
            try:
                line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                line = ""
            if line is None:
                raise MegapipeError(f"megapipe serve exited with status {proc.wait()} before it was ready: "
                                    f"{last or 'no output'} (command: {' '.join(cmd)})")
            if line.strip():
                last = line.strip()
            m = READY.search(line)
            if m:
                url = m.group(1)
            elif time.monotonic() > deadline:
                raise MegapipeError(f"megapipe serve was not ready after {ready_timeout:.0f} s (last line: "
                                    f"{last or 'none'})")
        ready_s = time.monotonic() - started
        if echo:
            echo(f"server ready on {url} after {ready_s:.1f} s")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=request_timeout)
        extra = {"skip_special_tokens": False} if stop else None  # a stop string may be a special token
        models = [m.id for m in _ask(openai, "listing the models", client.models.list).data]
        completion = _ask(openai, "the completion", client.completions.create, model=name, prompt=prompt,
                          max_tokens=max_tokens, temperature=0.0, stop=stop or None, extra_body=extra)
        record = {"model": str(model), "url": url, "ready_seconds": round(ready_s, 2), "models": models,
                  "completion": {"prompt": prompt, "response": completion.model_dump()}}
        answers = [("the completion of", repr(prompt), prompt, completion.choices[0].text)]
        if chat:
            messages = [{"role": "user", "content": chat}]
            answer = _ask(openai, "the chat completion", client.chat.completions.create, model=name,
                          messages=messages, max_tokens=max_tokens, temperature=0.0, stop=stop or None,
                          extra_body=extra)
            rendered = _tokenize(url, key, {"model": name, "messages": messages}, request_timeout)
            answers.append(("the chat message", repr(chat), rendered, answer.choices[0].message.content or ""))
            record["chat"] = {"messages": messages, "response": answer.model_dump()}
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise MegapipeError("megapipe serve did not stop within 120 s of SIGTERM") from None
        if rc != 0:
            raise MegapipeError(f"megapipe serve exited with status {rc} on SIGTERM (its log: {SERVER_LOG})")
        record["shutdown"] = {"signal": "SIGTERM", "exit_status": rc}
        greedy = engine_greedy(model, [a[2] for a in answers], max_tokens, stop, serve_args)
        for (what, shown, _, got), want in zip(answers, greedy, strict=True):
            if got != want:
                raise MegapipeError(f"the server answered {what} {shown} with {got!r}, but the engine's greedy "
                                    f"output for it is {want!r}")
        record["engine_greedy"] = greedy
        record["seconds"] = round(time.monotonic() - started, 2)
        (tmp / RESPONSES).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        (tmp / SAMPLE).write_text(_sample(record), encoding="utf-8")
        return record
    except BaseException:
        log.flush()
        tail = (tmp / SERVER_LOG).read_text(encoding="utf-8", errors="replace").splitlines()[-20:]
        if tail:  # the step's log keeps what the server said (the output directory is removed)
            print("\n".join(["--- megapipe serve's log (last lines) ---", *tail, "---"]), file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        log.close()


def engine_greedy(model, prompts: list, max_tokens: int, stop: list[str], serve_args: list[str]) -> list[str]:
    """What the engine itself decodes greedily for each prompt (text, or the token ids of a rendered chat), loaded
    as the server loaded it (its --dtype / --device): the answers the server must give, empty ones included."""
    from megapipe.inference.engine import LLMEngine
    from megapipe.inference.sampling import SamplingParams

    def arg(flag: str, default):
        return serve_args[serve_args.index(flag) + 1] if flag in serve_args[:-1] else default

    engine = LLMEngine.from_pretrained(model, device=arg("--device", None), dtype=arg("--dtype", "auto"),
                                       max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop, skip_special_tokens=not stop)
    return [out.outputs[0].text for out in engine.generate(prompts, params)]


def _tokenize(url: str, key: str, body: dict, timeout: float) -> list[int]:
    """The server's own rendering of a chat into token ids (its /tokenize route, as vLLM's)."""
    import httpx

    try:
        reply = httpx.post(f"{url}/tokenize", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)
        reply.raise_for_status()
        return reply.json()["tokens"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise MegapipeError(f"the server's /tokenize of the chat message failed: {e}") from None


def _ask(openai, what: str, call, **kw):
    try:
        return call(**kw)
    except openai.APIStatusError as e:
        raise MegapipeError(f"the server refused {what}: HTTP {e.status_code}: {_message(e)}") from None
    except openai.APIError as e:
        raise MegapipeError(f"{what} failed: {e}") from None


def _message(e) -> str:
    body = getattr(e, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else None
    return str(err["message"]) if isinstance(err, dict) and "message" in err else str(getattr(e, "message", e))


def _sample(record: dict) -> str:
    c = record["completion"]
    lines = ["# completion", c["prompt"] + c["response"]["choices"][0]["text"], ""]
    if "chat" in record:
        lines += ["# chat", f"user: {record['chat']['messages'][0]['content']}",
                  f"assistant: {record['chat']['response']['choices'][0]['message']['content']}", ""]
    return "\n".join(lines)
