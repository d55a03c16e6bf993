"""The engine behind an asyncio streaming API (what the server uses): in a background thread of this process
(:class:`AsyncEngine`), or in a process of its own (megapipe.inference.core_client.EngineCoreClient, serve's default).

Only the engine's own thread touches the engine: new requests, aborts and utility calls (LoRA adapters) reach it
through a queue between steps, outputs go back to each request's ``asyncio.Queue`` on the caller's event loop, and
what the event loop reads of it (stats for /metrics, the queue length) is a snapshot the engine thread publishes
after each step. What a request is checked against (the tokenizer, the context length, the vocabulary) is fixed when
the engine is built and read by both sides. torch releases the GIL in its kernels, so the event loop keeps serving
HTTP while a step runs. Leaving the stream early (client gone, task cancelled) aborts the request, which frees its KV
blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Callable, Optional, Sequence, Union

from megapipe.errors import MegapipeError
from megapipe.inference.engine import LLMEngine, RequestOutput
from megapipe.inference.images import PromptImages
from megapipe.inference.sampling import SamplingParams
from megapipe.inference.scheduler import now

log = logging.getLogger("megapipe.engine")


class EngineDead(MegapipeError):
    """The engine stopped on an internal error (or its process died); requests cannot be served."""


class QueueFull(MegapipeError):
    """More requests wait than the bounded queue admits."""


class ShuttingDown(MegapipeError):
    """The server is stopping and its drain time ran out before the request finished."""


class StreamingEngine:
    """What the server calls, whichever side of a process boundary the engine is on. A subclass sets the facts
    (tokenizer, max_model_len, vocab_size, model_config, config, loras) and implements ``_submit``, ``abort``,
    ``utility``, ``alive`` and ``shutdown``."""

    def __init__(self, max_queue: Optional[int], on_output: Optional[Callable[[RequestOutput], None]]):
        self.max_queue, self.on_output = max_queue, on_output
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.pending = 0  # requests submitted that the engine has not taken yet
        self.error: Optional[BaseException] = None
        self.closing: Optional[BaseException] = None  # set by end_all: what every request gets from then on
        self._snapshot: dict = {}  # the engine's stats after its latest step (published by the engine's side)
        self.rejected = 0  # requests refused for a full queue (vllm:admission_rejections)

    # the facts every request is checked against
    tokenizer = max_model_len = vocab_size = model_config = config = None
    loras: dict[str, str] = {}  # the LoRA adapters registered when the engine started: name -> path
    cache_info: dict[str, str] = {}  # vLLM's cache_config_info labels (LLMEngine.cache_info)

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def encode(self, prompt: Union[str, Sequence[int]]) -> tuple[Optional[str], list[int]]:
        raise NotImplementedError

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        raise NotImplementedError

    def prompt_images(self, prompt_ids: Sequence[int], pixel_values, image_grid_thw) -> PromptImages:
        """A prompt's images checked against the model (ParamError), here on the caller's side: the engine, or its
        core process, takes them as they are."""
        return PromptImages(self.model_config, prompt_ids, pixel_values, image_grid_thw)

    def num_waiting(self) -> int:
        return self._snapshot.get("waiting", 0) + self.pending

    def stats(self) -> dict:
        return {**self._snapshot, "waiting": self.num_waiting(), "admission_rejections": self.rejected}

    async def generate(self, prompt: Union[str, Sequence[int]], params: SamplingParams,
                       request_id: Optional[str] = None, lora: Optional[str] = None,
                       images=None) -> AsyncIterator[RequestOutput]:
        """Outputs as the request progresses (each holds everything so far); the last one has finished=True.
        ``lora``: the registered LoRA adapter to run it with (megapipe.inference.lora); ``images``: the prompt's
        (``prompt_images``).

        Parameter errors (ParamError) are raised here, before anything is queued.
        """
        self._check_running()
        text, ids = self.encode(prompt)
        params = self.check_request(ids, params)
        self.check_admission()
        rid = request_id or f"req-{next(self._ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[rid] = (asyncio.get_running_loop(), stream)
            self.pending += 1
        self._submit(rid, text, ids, params, now(), lora, images)
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def check_admission(self, count: int = 1) -> None:
        """EngineDead when the engine stopped, QueueFull when ``count`` more requests would overflow the queue: what
        a server checks before it starts a streamed response (whose status is sent before the first output)."""
        self._check_running()
        if self.max_queue is not None and self.num_waiting() + count > self.max_queue:
            self.rejected += 1
            raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later")

    def _check_running(self) -> None:
        """The error every request gets now: the server's ending (end_all), or EngineDead when the engine stopped."""
        if self.closing is not None:
            raise self.closing
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error}")

    def _submit(self, rid: str, text: Optional[str], ids: list[int], params: SamplingParams, arrival: float,
                lora: Optional[str], images) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def utility(self, method: str, *args):
        """``LLMEngine.<method>(*args)`` run by the engine's side between steps (add_lora, remove_lora, ...); its
        result, or its exception raised here."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def _deliver(self, rid: str, item) -> None:
        """Hand an output (or an exception) to the stream of ``rid``, from any thread."""
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass

    def end_all(self, error: BaseException) -> int:
        """End every request in flight with ``error`` (each is aborted as its stream closes) and refuse new ones with
        it: what a server does when its drain time runs out. The number of requests ended."""
        self.closing = error
        return self._fail_all(error)

    def _fail_all(self, error: BaseException) -> int:
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, error)
        return len(rids)


class AsyncEngine(StreamingEngine):
    """The engine in a background thread of this process."""

    def __init__(self, engine: LLMEngine, max_queue: Optional[int] = None,
                 on_output: Optional[Callable[[RequestOutput], None]] = None):
        super().__init__(max_queue, on_output)
        self.engine = engine
        self.tokenizer, self.max_model_len, self.vocab_size = engine.tokenizer, engine.max_model_len, engine.vocab_size
        self.model_config, self.config, self.loras = engine.model_config, engine.config, engine.lora_adapters()
        self._snapshot, self.cache_info = engine.stats(), engine.cache_info()
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="megapipe-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------------- caller side

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def encode(self, prompt):
        return self.engine.encode(prompt)

    def check_request(self, prompt_ids, params):
        return self.engine.check_request(prompt_ids, params)

    @property
    def grammars(self):
        return self.engine.grammars

    def _submit(self, rid, text, ids, params, arrival, lora, images) -> None:
        self._inbox.put(("add", rid, ids, text, params, arrival, lora, images))
        self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], object]):
        """``fn(engine)`` run by the engine thread between steps; its result, or its exception raised here."""
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error}")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, done))
        self._wake.set()
        return await done

    async def utility(self, method: str, *args):
        return await self.call(lambda engine: getattr(engine, method)(*args))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ----------------------------------------------------------------------------------------------- engine thread

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "call":
                _, fn, done = msg
                try:
                    result, error = fn(self.engine), None
                except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
                    result, error = None, e
                loop = done.get_loop()
                try:
                    loop.call_soon_threadsafe(_settle, done, result, error)
                except RuntimeError:  # the loop is closed (server shutting down)
                    pass
            elif msg[0] == "add":
                _, rid, ids, text, params, arrival, lora, images = msg
                with self._lock:
                    self.pending -= 1
                    gone = rid not in self._streams
                if gone:
                    continue  # cancelled before the engine saw it
                try:
                    req = self.engine.add_request(rid, ids, params, arrival, lora=lora, images=images)
                    req.prompt = text
                except MegapipeError as e:
                    self._deliver(rid, e)
            else:
                out = self.engine.abort(msg[1])
                if out is not None and self.on_output is not None:
                    self.on_output(out)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                self._snapshot = self.engine.stats()  # the requests just taken count as waiting, no longer pending
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outs = self.engine.step()
                self._snapshot = self.engine.stats()  # before the outputs: a finished request's counts are in it
                for out in outs:
                    if self.on_output is not None:
                        self.on_output(out)
                    self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - a bug: fail every request loudly, keep the server answering
            log.exception("the engine thread failed")
            self.error = e
            self._fail_all(EngineDead(f"the engine stopped on an internal error: {e}"))


def _settle(done: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
