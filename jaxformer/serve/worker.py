"""The engine's own thread: one :class:`jaxformer.decode.Engine`, fed by a bounded queue, stepping while any
request runs.

HTTP handlers (on the event loop) :meth:`EngineWorker.submit` a :class:`Job` (one request's choices) and
read its :class:`Update` objects from an ``asyncio.Queue``; the worker thread owns the engine and is the
only one that touches it. Each turn of its loop it moves submitted jobs into the engine (so a request that
arrives at any time joins the running batch at the next step: continuous batching), applies
cancellations (their pages go back to the pool before the step), runs one :meth:`Engine.step`, and sends
every choice the tokens it gained, and its ``Result`` once it is done.

A choice that asked for log-probabilities gets them, when it finishes, from one forward pass over its
prompt and generated tokens (:func:`jaxformer.decode.scoring.token_logprobs`), run on this thread between
steps. A choice with ``params=None`` (``max_tokens: 0`` with ``echo``) is only scored.

Backpressure: at most ``max_queue`` choices may wait (submitted, not yet running in the engine); a job that
would pass that is refused at once with :class:`QueueFull`, so the queue never grows without bound.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from jaxformer.decode.engine import Engine, Result
from jaxformer.decode.sampling import SamplingParams
from jaxformer.decode.scoring import TokenLogprobs, token_logprobs

log = logging.getLogger("jaxformer.serve")


class QueueFull(RuntimeError):
    """The waiting queue has no room for the job's choices."""


class ShuttingDown(RuntimeError):
    """The server stopped accepting requests (SIGTERM)."""


@dataclasses.dataclass
class Update:
    """What a choice gained since the last update: ``tokens``; when it is done, its engine ``result``
    (and ``logprobs`` if it asked for them, over ``prompt + result.tokens``)."""

    tokens: list[int]
    result: Result | None = None
    logprobs: TokenLogprobs | None = None


@dataclasses.dataclass
class Choice:
    """One sequence to generate: ``prompt`` ids, ``params`` (None: score the prompt only), ``top``: the
    log-probabilities to compute when it ends (None: none; an int: that many top tokens per position)."""

    prompt: list[int]
    params: SamplingParams | None
    top: int | None = None
    rid: int = -1
    sent: int = 0
    submitted: float = 0.0
    first_token: float | None = None
    ended: bool = False  # cancelled because its text is complete (a stop string): still scored and counted done


@dataclasses.dataclass
class Job:
    """One HTTP request's choices and where their updates go: ``send(index, update)``, called on the worker
    thread (it must hand the update over thread-safely, e.g. ``loop.call_soon_threadsafe``)."""

    choices: list[Choice]
    send: Callable[[int, Update], None]


class EngineWorker:
    """The engine loop in its own thread (see the module docstring). ``metrics``: a
    :class:`jaxformer.serve.metrics.Metrics` (or None)."""

    def __init__(self, engine: Engine, *, max_queue: int, metrics=None):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # choices in the inbox (submitted, not yet in the engine)
        self._engine_waiting = 0  # len(engine.waiting) after the last step
        self._cancel: set[int] = set()
        self._ended: set[int] = set()  # of those, the ones a stop string ended (see cancel)
        self._cancel_all = False
        self._active: dict[int, tuple[Job, int, Choice]] = {}  # engine request id -> (job, index, choice)
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.accepting = True
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxformer-engine", daemon=True)

    # -- the HTTP side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, job: Job) -> list[int]:
        """Queue a job; its choices' request ids. QueueFull / ShuttingDown at once when it cannot be taken."""
        with self._lock:
            if not self.accepting or not self.alive:
                raise ShuttingDown("the server is shutting down" if not self.accepting else
                                   f"the engine thread stopped: {self.error!r}")
            n, waiting = len(job.choices), self._queued + self._engine_waiting
            if waiting + n > self.max_queue:
                raise QueueFull(f"the waiting queue is full ({waiting} of max_queue={self.max_queue} "
                                f"requests waiting; this one has {n}); retry later")
            self._queued += n
            now = time.perf_counter()
            for c in job.choices:
                c.rid, c.submitted = next(self._ids), now
            self._inbox.put(job)
        self._wake.set()
        return [c.rid for c in job.choices]

    def cancel(self, rids, *, ended: bool = False) -> None:
        """Cancel these choices: their pages are freed before the engine's next step. ``ended``: their text is
        complete (a stop string ended them), so they still get their log-probabilities and count as finished,
        not cancelled; else a client went away. Unknown or finished ids are ignored."""
        with self._lock:
            self._cancel.update(rids)
            if ended:
                self._ended.update(rids)
            else:  # a client gone after its stop string: nobody reads the answer, nothing to score
                self._ended.difference_update(rids)
        self._wake.set()

    def cancel_all(self) -> None:
        """Cancel every choice queued or running now (the shutdown grace period is over)."""
        with self._lock:
            self._cancel_all = True
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything still queued or running and end the thread."""
        self.accepting = False
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- the engine thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_jobs()
                self._apply_cancels()
                if self.engine.done:
                    self._publish()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.engine.step()
                self._publish()
        except BaseException as e:  # a bug in a step: fail every request rather than hang them
            log.exception("the engine thread failed")
            self.error = e
            self.accepting = False
        finally:
            self._fail_all("cancelled" if self.error is None else f"engine failure: {self.error!r}")

    def _drain_inbox(self):
        """The jobs queued so far, taken off the inbox one by one."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _take_jobs(self) -> None:
        for job in self._drain_inbox():
            for i, c in enumerate(job.choices):
                if c.params is None:  # score only
                    self._finish(job, i, c, Result(c.rid, c.prompt, [], "length", stopped_by="max_new_tokens"))
                    continue
                self._active[c.rid] = (job, i, c)
                self.engine.submit(c.prompt, c.params, request_id=c.rid)
            with self._lock:  # moved from the inbox to the engine's queue: still waiting, counted once
                self._queued -= len(job.choices)
                self._engine_waiting = len(self.engine.waiting)

    def _apply_cancels(self) -> None:
        with self._lock:
            rids, self._cancel = self._cancel, set()
            ended, self._ended = self._ended, set()
            if self._cancel_all:
                rids, self._cancel_all = set(self._active), False
        for rid in rids:
            if rid in self._active and self.engine.cancel(rid):
                if rid in ended:
                    self._active[rid][2].ended = True
                elif self.metrics is not None:
                    self.metrics.cancelled.inc()

    def _publish(self) -> None:
        """Send each active choice its new tokens; finish those with a result; refresh the gauges."""
        progress = self.engine.in_progress()
        results = self.engine.results
        now = time.perf_counter()
        for rid, (job, i, c) in list(self._active.items()):
            result = results.pop(rid, None)
            tokens = result.tokens if result is not None else progress.get(rid, [])
            new = tokens[c.sent:]
            if new and c.first_token is None:
                c.first_token = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - c.submitted)
            c.sent = len(tokens)
            if result is not None:
                del self._active[rid]
                self._finish(job, i, c, result, new)
            elif new:
                job.send(i, Update(new))
        with self._lock:
            self._engine_waiting = len(self.engine.waiting)
            waiting = self._queued + self._engine_waiting
        if self.metrics is not None:
            self.metrics.refresh(self.engine, waiting)

    def _finish(self, job: Job, i: int, c: Choice, result: Result, new: list[int] = ()) -> None:
        scores = None
        if c.ended and result.finish_reason == "cancelled":  # a stop string's end is a complete answer
            result = dataclasses.replace(result, finish_reason="stop", stopped_by="stop_string")
        if c.top is not None and result.finish_reason not in ("error", "cancelled"):  # nobody reads a cancelled one
            try:
                scores = token_logprobs(self.engine.graphdef, self.engine.state, c.prompt + result.tokens,
                                        top=c.top, max_len=self.engine.config.max_seq_len)
            except Exception as e:  # this choice fails, the engine runs on
                log.exception("scoring request %s failed", c.rid)
                result = dataclasses.replace(result, finish_reason="error", error=f"log-probabilities failed: {e}")
        if self.metrics is not None:
            self.metrics.finished(c, result, time.perf_counter())
        job.send(i, Update(list(new), result, scores))

    def _fail_all(self, why: str) -> None:
        """The thread is ending: every choice still active gets a result now (cancelled or failed)."""
        for rid, (job, i, c) in list(self._active.items()):
            self.engine.cancel(rid)  # its Result: the tokens so far, "cancelled"
            result = self.engine.results.pop(rid, None) or Result(rid, c.prompt, [], "cancelled",
                                                                  stopped_by="cancelled")
            if why != "cancelled":
                result = dataclasses.replace(result, finish_reason="error", error=why, stopped_by="error")
            self._finish(job, i, c, result, result.tokens[c.sent:])
        self._active.clear()
        for job in self._drain_inbox():
            for i, c in enumerate(job.choices):
                job.send(i, Update([], Result(c.rid, c.prompt, [], "cancelled", stopped_by="cancelled")))
