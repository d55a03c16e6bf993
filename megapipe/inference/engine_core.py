"""The engine core in a process of its own (``megapipe serve``'s default), and the typed messages that join it to
its front end (megapipe.inference.core_client).

The core runs schedule -> execute -> update and nothing else; the front end keeps the tokenizer, checks and
tokenises requests, detokenises the core's token ids, applies stop strings and formats logprobs (as vLLM v1 splits
them). Front end to core: :class:`AddRequest`, :class:`Abort`, :class:`UtilityCall` (LoRA adapters), :class:`Shutdown`;
core to front end: :class:`Ready` once, then one :class:`EngineCoreOutputs` per step (each request's new token ids,
logprobs and finish reasons, and the engine's stats after the step), :class:`UtilityResult` and, on a bug,
:class:`Fatal`.

Transport: the dataclasses pickled over one Unix socket pair (``multiprocessing.Pipe``: a socketpair with
length-prefixed frames, standard library only). Not shared memory: a step's outputs are a few token ids per request,
so copying them costs nothing next to the step, while the socket gives blocking waits without spinning, and
end-of-file on it is how each side learns the other died (SIGKILL included), which a shared-memory ring would need a
heartbeat for. Plain ``pickle`` (not torch.multiprocessing's shared-memory handles): the tensors that travel (an
image's pixels, an adapter's weights) are rare and small, and then owe nothing to the sender's memory.
The core is started with the ``spawn`` context: forking a process that has run torch (OpenMP pools, CUDA) is unsafe.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Optional

from megapipe.errors import MegapipeError
from megapipe.inference.engine import EngineConfig, LLMEngine, RequestOutput
from megapipe.inference.images import PromptImages
from megapipe.inference.sampling import ParamError, SamplingParams

log = logging.getLogger("megapipe.engine")
UTILITIES = frozenset({"add_lora", "load_lora", "remove_lora", "lora_adapters"})  # what UtilityCall may call


# --------------------------------------------------------------------------------------------- front end -> core


@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # checked and resolved by the front end (max_tokens set)
    arrival: float  # time.monotonic() when the front end received it (one clock for both processes)
    lora: Optional[str] = None
    images: Optional[PromptImages] = None  # decoded and checked by the front end


@dataclass
class Abort:
    request_id: str
    index: Optional[int] = None  # only this sample of it (a stop string ended it at the front end); None: all


@dataclass
class UtilityCall:
    call_id: int
    method: str  # one of UTILITIES, an LLMEngine method
    args: tuple = ()


@dataclass
class Shutdown:
    pass


# --------------------------------------------------------------------------------------------- core -> front end


@dataclass
class Failure:
    """An exception as data: exceptions whose __init__ takes other arguments than their message do not unpickle."""

    message: str
    param: Optional[str] = None  # a ParamError's
    user: bool = True  # a MegapipeError (the request's or the config's mistake), not a bug

    @classmethod
    def of(cls, e: BaseException) -> "Failure":
        return cls(str(e), getattr(e, "param", None), isinstance(e, MegapipeError))

    def exception(self) -> Exception:
        if self.param is not None:
            return ParamError(self.param, self.message)
        return MegapipeError(self.message) if self.user else RuntimeError(self.message)


@dataclass
class Ready:
    """What the front end checks requests against, and says at startup."""

    tokenizer: object
    model_config: object
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int
    loras: dict[str, str]
    kv_cache_line: str
    cache_info: dict  # vLLM's cache_config_info labels
    stats: dict  # the engine's stats before its first step: /metrics has every series from the start


@dataclass
class SampleOutput:
    index: int
    new_token_ids: list[int]
    new_logprobs: Optional[list]
    finish_reason: Optional[str] = None  # sent once; "stop" here is a token's (EOS, stop_token_ids, a grammar's end)
    stop_reason: Optional[int] = None


@dataclass
class EngineCoreOutput:
    request_id: str
    samples: list[SampleOutput] = field(default_factory=list)  # those with new tokens or a finish
    new_prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # the RequestOutput's (core_client.CORE_METRICS: timings, counts)
    finished: bool = False
    error: Optional[Failure] = None  # the request was refused (LLMEngine.add_request raised)


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: dict  # LLMEngine.stats() after the step
    num_added: int  # AddRequests taken so far (the front end counts those still in transit as waiting)


@dataclass
class UtilityResult:
    call_id: int
    result: object = None
    error: Optional[Failure] = None


@dataclass
class Fatal:
    message: str


def send(conn, msg) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


# --------------------------------------------------------------------------------------------- the core


@dataclass
class CoreSpec:
    """How the core builds its engine (picklable: it crosses to the spawned process)."""

    model: str
    config: EngineConfig
    device: Optional[str] = None
    dtype: Optional[str] = None  # None / "auto": as stored
    loras: dict[str, str] = field(default_factory=dict)  # served adapters, name -> path
    threads: Optional[int] = None  # torch CPU threads

    def build(self) -> LLMEngine:
        import torch

        from megapipe.checkpoint.load import load_model
        from megapipe.dtypes import resolve_device, resolve_dtype

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        loaded = load_model(self.model, resolve_device(self.device), resolve_dtype(self.dtype))
        engine = LLMEngine(loaded.model, loaded.tokenizer, self.config, loaded.eos_ids)
        for name, path in self.loras.items():
            try:
                engine.load_lora(name, path)
            except MegapipeError as e:
                raise MegapipeError(f"--lora-modules {name}={path}: {e}") from None
        return engine


def run_core(conn, spec: CoreSpec) -> None:
    """The spawned process: build the engine, say Ready (or why not), serve messages until Shutdown or until the
    front end is gone."""
    # the front end drains and then stops it: a Ctrl-C or SIGTERM sent to the whole process group must not kill
    # the core under requests still in flight
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    try:
        engine = spec.build()
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which raises it
        if not isinstance(e, MegapipeError):
            log.exception("the engine core failed to start")
        send(conn, Failure.of(e))
        sys.exit(1)
    send(conn, Ready(engine.tokenizer, engine.model_config, engine.eos_token_ids, engine.max_model_len,
                     engine.vocab_size, engine.lora_adapters(), engine.kv_cache_line(), engine.cache_info(),
                     engine.stats()))
    EngineCore(engine, conn).run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing left to save: the interpreter's teardown of torch would only delay the server's exit


class EngineCore:
    def __init__(self, engine: LLMEngine, conn):
        self.engine, self.conn = engine, conn
        engine.detokenize = False  # the front end's job
        self.inbox: queue.Queue = queue.Queue()
        self.sent: dict[str, list[int]] = {}  # per request: tokens sent per sample (-1: finished), prompt logprobs
        self.num_added = 0
        self.compiling: list[tuple[AddRequest, object]] = []  # requests whose grammar the worker thread compiles
        # reads (and unpickles) the next messages while a step runs
        threading.Thread(target=self._read, name="megapipe-core-input", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                self.inbox.put(recv(self.conn))
        except (EOFError, OSError):
            self.inbox.put(Shutdown())  # the front end is gone

    def run(self) -> None:
        outputs: list[EngineCoreOutput] = []
        try:
            while True:
                idle = not self.engine.has_unfinished()
                news = 0
                try:  # idle: sleep until a message comes (or, while a grammar compiles, look again shortly)
                    msg = self.inbox.get(block=idle, timeout=0.005 if self.compiling else None)
                    while True:
                        if isinstance(msg, Shutdown):
                            return
                        self._handle(msg, outputs)
                        news += 1
                        msg = self.inbox.get_nowait()
                except queue.Empty:
                    pass
                for item in [c for c in self.compiling if c[1].done()]:
                    self.compiling.remove(item)
                    self._add(item[0], outputs)
                    news += 1
                if self.engine.has_unfinished():
                    outputs += filter(None, map(self._delta, self.engine.step()))
                    news += 1
                if news:  # the outputs, and the stats as they stand now
                    send(self.conn, EngineCoreOutputs(outputs, self.engine.stats(), self.num_added))
                outputs = []
        except (BrokenPipeError, ConnectionResetError):
            return  # the front end is gone
        except BaseException as e:  # noqa: BLE001 - a bug: the front end fails its requests with this sentence
            log.exception("the engine core failed")
            try:
                send(self.conn, Fatal(f"the engine stopped on an internal error: {e!r}"))
            finally:
                sys.exit(1)

    def _handle(self, msg, outputs: list) -> None:
        if isinstance(msg, AddRequest):
            self.num_added += 1
            if msg.params.structured is not None:  # the front end only parsed it
                compiled = self.engine.grammars.submit(msg.params.structured)
                if not compiled.done():  # the steps go on meanwhile
                    self.compiling.append((msg, compiled))
                    return
            self._add(msg, outputs)
        elif isinstance(msg, Abort):
            self.compiling = [c for c in self.compiling if c[0].request_id != msg.request_id]
            out = self.engine.abort(msg.request_id, msg.index)
            if out is not None:
                outputs.append(self._delta(out))
        elif isinstance(msg, UtilityCall):
            try:
                if msg.method not in UTILITIES:
                    raise MegapipeError(f"{msg.method!r} is not an engine utility ({', '.join(sorted(UTILITIES))})")
                reply = UtilityResult(msg.call_id, getattr(self.engine, msg.method)(*msg.args))
            except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
                reply = UtilityResult(msg.call_id, error=Failure.of(e))
            send(self.conn, reply)
        else:
            raise TypeError(f"the engine core got an unknown message {type(msg).__name__}")

    def _add(self, msg: AddRequest, outputs: list) -> None:
        try:
            req = self.engine.add_request(msg.request_id, msg.prompt_ids, msg.params, msg.arrival, images=msg.images,
                                          lora=msg.lora)
        except MegapipeError as e:
            outputs.append(EngineCoreOutput(msg.request_id, finished=True, error=Failure.of(e)))
            return
        self.sent[msg.request_id] = [0] * len(req.seqs) + [0]

    def _delta(self, out: RequestOutput) -> Optional[EngineCoreOutput]:
        """What ``out`` holds beyond what was sent of its request (None: nothing)."""
        sent = self.sent.get(out.request_id)
        if sent is None:
            return None
        samples = []
        for c in out.outputs:
            k = sent[c.index]
            if k < 0:
                continue
            new = c.token_ids[k:]
            if new or c.finish_reason is not None:
                lps = c.logprobs[k:] if c.logprobs is not None else None
                samples.append(SampleOutput(c.index, new, lps, c.finish_reason,
                                            c.stop_reason if c.finish_reason == "stop" else None))
            sent[c.index] = -1 if c.finish_reason is not None else len(c.token_ids)
        prompt_lps = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) > sent[-1]:
            prompt_lps = out.prompt_logprobs[sent[-1]:]
            sent[-1] = len(out.prompt_logprobs)
        if out.finished:
            del self.sent[out.request_id]
        elif not samples and prompt_lps is None:
            return None
        return EngineCoreOutput(out.request_id, samples, prompt_lps, out.num_cached_tokens, out.metrics,
                                out.finished)
