"""The front end's side of an engine core process (megapipe.inference.engine_core): the calls of
:class:`~megapipe.inference.async_engine.AsyncEngine`, with the model in another process.

Here: the tokenizer, checking and tokenising requests, and turning the core's new token ids into text
(:class:`RequestState`: incremental detokenisation, stop strings, the stream's held-back text, exactly as the engine
does it in-process). A request that a stop string ends here is aborted in the core, and so is a sample of an
``n > 1`` request that one ends while its siblings go on (its blocks freed at once). A thread reads the core's
messages, so the event loop never waits on the socket; when the core dies (end-of-file on the socket: a crash,
SIGKILL, the OOM killer) every request in flight gets :class:`EngineDead`, ``alive`` turns False (/health answers
503) and new requests are refused with the reason.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import signal
import threading
from typing import Optional

from megapipe.errors import MegapipeError
from megapipe.inference.async_engine import EngineDead, StreamingEngine, _settle
from megapipe.inference.detokenize import Detokenizer, special_ids
from megapipe.inference.engine import CompletionOutput, LLMEngine, RequestOutput
from megapipe.inference.engine_core import (
    Abort,
    AddRequest,
    CoreSpec,
    EngineCoreOutput,
    EngineCoreOutputs,
    Failure,
    Fatal,
    SampleOutput,
    Shutdown,
    UtilityCall,
    UtilityResult,
    recv,
    run_core,
    send,
)
from megapipe.inference.sampling import SamplingParams
from megapipe.inference.structured import Grammars

log = logging.getLogger("megapipe.engine")


class _Sample:
    def __init__(self, index: int, detok: Optional[Detokenizer]):
        self.index, self.detok = index, detok
        self.ids: list[int] = []
        self.logprobs: list = []
        self.generated = 0  # tokens generated, a stop token included (OpenAI's completion_tokens)
        self.finish_reason: Optional[str] = None
        self.stop_reason = None

    def update(self, s: SampleOutput, params: SamplingParams) -> bool:
        """Take the core's new tokens one at a time, as LLMEngine._append would with a tokenizer: text, then stop
        strings (from min_tokens on); a token that ends the sample in the core (EOS, a stop token id) has no text
        unless include_stop_str_in_output kept it.
        True when a stop string ended it here and the core has not."""
        if self.finish_reason is not None:
            return False  # a stop string ended it here; the core's later tokens are not part of it
        for j, token in enumerate(s.new_token_ids):
            self.ids.append(token)
            self.generated += 1
            if s.new_logprobs is not None:
                self.logprobs.append(s.new_logprobs[j])
            if self.detok is None:
                continue
            new = self.detok.add(token)
            if len(self.ids) >= params.min_tokens:
                hit = self.detok.find_stop(new)
                if hit is not None:
                    self.detok.stop_at(hit, params.include_stop_str_in_output)
                    self.finish_reason, self.stop_reason = "stop", hit[1]
                    return s.finish_reason is None
        if s.finish_reason == "stop" and not params.include_stop_str_in_output:
            self.generated += 1  # the stop token: counted, not shown (kept, it came with the others)
        elif s.finish_reason == "length" and self.detok is not None:
            self.detok.flush()
        if s.finish_reason is not None:
            self.finish_reason, self.stop_reason = s.finish_reason, s.stop_reason
        return False


# a request's metrics that the core reports (LLMEngine's RequestOutput.metrics), as they are before it has
CORE_METRICS = {"first_scheduled_time": None, "first_token_time": None, "last_token_time": None, "num_preemptions": 0,
                "max_sample_tokens": 0}


class RequestState:
    """One request's output as the front end builds it from the core's deltas: the RequestOutput the engine would
    have given in-process."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                 arrival: float, tokenizer=None, special: frozenset = frozenset()):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        skip = special if params.skip_special_tokens else frozenset()
        keep = params.include_stop_str_in_output
        self.samples = [_Sample(i, Detokenizer(tokenizer, prompt_ids, skip, params.stop, keep)
                                if tokenizer is not None else None) for i in range(params.n)]
        self.prompt_logprobs: list = []
        self.num_cached = 0
        self.metrics = {"arrival_time": arrival, **CORE_METRICS}  # the arrival is the front end's own

    def update(self, o: EngineCoreOutput) -> list[int]:
        """Take the core's delta; returns the samples a stop string ended here that the core still decodes."""
        cut = [s.index for s in o.samples if self.samples[s.index].update(s, self.params)]
        self.prompt_logprobs += o.new_prompt_logprobs or []
        self.num_cached = o.num_cached_tokens
        self.metrics.update((k, o.metrics[k]) for k in CORE_METRICS if k in o.metrics)
        return cut

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        lps = self.params.logprobs is not None
        outs = [CompletionOutput(s.index, s.detok.stable_text(s.finish_reason is not None) if s.detok else "",
                                 list(s.ids), list(s.logprobs) if lps else None, s.finish_reason, s.stop_reason)
                for s in self.samples]
        prompt_lps = list(self.prompt_logprobs or [None]) if self.params.prompt_logprobs is not None else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, prompt_lps, outs, self.finished,
                             self.num_cached, sum(s.generated for s in self.samples), dict(self.metrics))


@contextlib.contextmanager
def signals_held(*signums: int):
    """SIGTERM / SIGINT arriving inside the block have their handlers run as it ends, not in the middle of it (the
    main thread only, where Python runs handlers). A core process being started reads its start-up message from a
    pipe the parent is still writing: a handler raising there closed the pipe under it, and the core printed an
    EOFError traceback before the parent could kill it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {n: signal.signal(n, lambda signum, frame: caught.append((signum, frame))) for n in signums}
    try:
        yield
    finally:
        for n, handler in previous.items():
            signal.signal(n, handler)
        for n, frame in caught:
            if callable(previous[n]):
                previous[n](n, frame)
            elif previous[n] == signal.SIG_DFL:
                signal.raise_signal(n)


class EngineCoreClient(StreamingEngine):
    """Start an engine core process for ``spec`` and wait until it is ready (its loading errors raised here)."""

    # a request is checked by the engine's own rules, on the facts its core reported (no model here)
    encode = LLMEngine.encode
    check_request = LLMEngine.check_request

    def __init__(self, spec: CoreSpec, max_queue: Optional[int] = None, on_output=None):
        super().__init__(max_queue, on_output)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=run_core, args=(child, spec), name="megapipe-engine-core", daemon=True)
        try:
            with signals_held(signal.SIGTERM, signal.SIGINT):
                self.process.start()
            child.close()  # only the core holds its end: its death is end-of-file here
            try:
                ready = recv(self._conn)
            except (EOFError, OSError):
                raise MegapipeError(f"the engine core process exited while loading {spec.model} "
                                    f"({self._exit_status()})") from None
        except BaseException:  # stopped while the core starts or loads (a signal, Ctrl-C): the core goes too
            if self.process.pid is not None and self.process.is_alive():
                self.process.kill()
                self.process.join(10)
            raise
        if isinstance(ready, Failure):
            self.process.join(10)
            raise ready.exception()
        self.tokenizer, self.model_config, self.eos_token_ids = ready.tokenizer, ready.model_config, ready.eos_token_ids
        self.max_model_len, self.vocab_size, self.loras = ready.max_model_len, ready.vocab_size, ready.loras
        self.kv_cache_line, self.config, self._snapshot = ready.kv_cache_line, spec.config, ready.stats
        self.cache_info = ready.cache_info
        self.special = special_ids(self.tokenizer) if self.tokenizer is not None else frozenset()
        self._grammars = None
        self._states: dict[str, RequestState] = {}  # requests in the core; updated by the reader thread only
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._submitted = 0
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="megapipe-core-output", daemon=True)
        self._reader.start()
        # before multiprocessing's own exit handler, which would SIGTERM the core (ignored there) and wait forever
        atexit.register(self.shutdown)

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping

    @property
    def grammars(self) -> Grammars:
        """Constraints parsed only, so a bad one is a 400 before the core sees it; the core compiles them."""
        if self._grammars is None:
            self._grammars = Grammars()
        return self._grammars

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                send(self._conn, msg)
        except OSError:
            pass  # the core is gone: the reader thread reports it

    def _submit(self, rid, text, ids, params, arrival, lora, images) -> None:
        with self._lock:
            self._states[rid] = RequestState(rid, text, ids, params, arrival, self.tokenizer, self.special)
            self._submitted += 1
        self._send(AddRequest(rid, ids, params, arrival, lora, images))
        if self.error is not None:  # the core died before the stream could be failed with the others
            self._deliver(rid, EngineDead(f"the engine stopped: {self.error}"))

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    async def utility(self, method: str, *args):
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error}")
        done = asyncio.get_running_loop().create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = done
        self._send(UtilityCall(call_id, method, args))
        return await done

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (after the server has drained its requests): Shutdown, then SIGKILL if it does not exit."""
        if self._conn.closed:
            return
        self._stopping = True
        self._send(Shutdown())
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self._conn.close()
        atexit.unregister(self.shutdown)

    # ----------------------------------------------------------------------------------------------- reader thread

    def _read(self) -> None:
        try:
            while True:
                msg = recv(self._conn)
                if isinstance(msg, EngineCoreOutputs):
                    self._take(msg)
                elif isinstance(msg, UtilityResult):
                    self._settle(msg.call_id, msg.result, msg.error.exception() if msg.error else None)
                elif isinstance(msg, Fatal):
                    self._die(msg.message)
                    return
        except (EOFError, OSError):
            self._die(None)

    def _take(self, msg: EngineCoreOutputs) -> None:
        with self._lock:
            self._snapshot = msg.stats  # before the outputs: a finished request's counts are in it
            self.pending = self._submitted - msg.num_added
        for o in msg.outputs:
            state = self._states.get(o.request_id)
            if state is None:
                continue  # ended here already (a stop string)
            if o.error is not None:
                with self._lock:
                    del self._states[o.request_id]
                self._deliver(o.request_id, o.error.exception())
                continue
            cut = state.update(o)
            out = state.output()
            if out.finished:
                with self._lock:
                    del self._states[o.request_id]
                if not o.finished:
                    self._send(Abort(o.request_id))  # a stop string ended it: the core need not go on
            else:
                for index in cut:  # its siblings go on
                    self._send(Abort(o.request_id, index))
            if self.on_output is not None:
                self.on_output(out)
            self._deliver(o.request_id, out)

    def _settle(self, call_id: int, result, error) -> None:
        with self._lock:
            done = self._calls.pop(call_id, None)
        if done is not None:
            try:
                done.get_loop().call_soon_threadsafe(_settle, done, result, error)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass

    def _exit_status(self) -> str:
        self.process.join(5)
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def _die(self, message: Optional[str]) -> None:
        if self._stopping and message is None:
            return  # shut down as asked
        why = message or f"the engine core process exited ({self._exit_status()})"
        log.error("%s", why)
        self.error = MegapipeError(why)
        dead = EngineDead(why)
        self._fail_all(dead)
        with self._lock:
            calls = list(self._calls)
            self._states.clear()
        for call_id in calls:
            self._settle(call_id, None, dead)
