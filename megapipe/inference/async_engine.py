"""The engine in a background thread, with an asyncio streaming API (what the server and the RL stage use).

Only the engine thread touches the engine: new requests and aborts reach it through a queue between steps, outputs
go back to each request's ``asyncio.Queue`` on the caller's event loop. torch releases the GIL in its kernels, so
the event loop keeps serving HTTP while a step runs. Leaving the stream early (client gone, task cancelled)
aborts the request, which frees its KV blocks at the next step boundary.
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
from megapipe.inference.sampling import SamplingParams
from megapipe.inference.scheduler import now

log = logging.getLogger("megapipe.engine")


class EngineDead(MegapipeError):
    """The engine thread stopped on an internal error; requests cannot be served."""


class QueueFull(MegapipeError):
    """More requests wait than the bounded queue admits."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: Optional[int] = None,
                 on_output: Optional[Callable[[RequestOutput], None]] = None):
        self.engine, self.max_queue, self.on_output = engine, max_queue, on_output
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.pending = 0  # queued in the inbox, not yet seen by the engine
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="megapipe-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------------- caller side

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def num_waiting(self) -> int:
        return self.engine.num_waiting() + self.pending

    async def generate(self, prompt: Union[str, Sequence[int]], params: SamplingParams,
                       request_id: Optional[str] = None, lora: Optional[str] = None,
                       images=None) -> AsyncIterator[RequestOutput]:
        """Outputs as the request progresses (each holds everything so far); the last one has finished=True.
        ``lora``: the registered LoRA adapter to run it with (megapipe.inference.lora); ``images``: as
        LLMEngine.add_request takes them.

        Parameter errors (ParamError) are raised here, before anything is queued.
        """
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error}")
        text, ids = self.engine.encode(prompt)
        params = self.engine.check_request(ids, params)
        if self.max_queue is not None and self.num_waiting() >= self.max_queue:
            raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[rid] = (loop, stream)
            self.pending += 1
        self._inbox.put(("add", rid, ids, text, params, now(), lora, images))
        self._wake.set()
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

    async def call(self, fn: Callable[[LLMEngine], object]):
        """``fn(engine)`` run by the engine thread between steps (loading an adapter, ...); its result, or its
        exception raised here."""
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error}")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, done))
        self._wake.set()
        return await done

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def stats(self) -> dict:
        s = self.engine.stats()
        s["waiting"] += self.pending
        return s

    # ----------------------------------------------------------------------------------------------- engine thread

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass

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
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    if self.on_output is not None:
                        self.on_output(out)
                    self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - a bug: fail every request loudly, keep the server answering
            log.exception("the engine thread failed")
            self.error = e
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, EngineDead(f"the engine stopped on an internal error: {e}"))


def _settle(done: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
