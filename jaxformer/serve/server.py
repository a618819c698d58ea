"""``jaxformer serve``: build the engine, its worker and the app, and run uvicorn until SIGTERM / SIGINT.

Shutdown: the first signal stops the server accepting (the listening socket closes, a request that still
gets in is answered 503) and lets what runs finish for up to ``shutdown_timeout`` seconds; then what is left
is cancelled (its pages freed; a stream ends with ``finish_reason: "abort"`` and ``[DONE]``, a gathered
answer returns what it had), the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from jaxformer.decode.engine import Engine
from jaxformer.decode.sampling import SamplingParams
from jaxformer.serve.options import ServeOptions

DEFAULT_MAX_CONTEXT = 2048  # a model's own context (SmolLM2: 8192) makes a default page pool of gigabytes


def build_engine(graphdef, state, config, *, max_batch: int = 8, num_pages: int | None = None, page_size: int = 16,
                 max_context: int | None = None, chunk_size: int = 16, feature_major: bool | None = None) -> Engine:
    """The engine a server runs: ``max_context`` defaults to the model's context, at most 2048 tokens;
    ``num_pages`` to ``max_batch`` sequences of ``max_context``; prefill chunks of 16 tokens (a step holding a
    chunk runs every row at the chunk's width, so a request joining a decoding batch costs it little:
    experiments/results/serve_cpu.md); ``feature_major``: :class:`EngineOptions`'s (None: on for the CPU)."""
    context = min(config.max_seq_len, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
    return Engine(graphdef, state, config, num_pages=num_pages, page_size=page_size, max_batch=max_batch,
                  max_context=context, chunk_size=chunk_size, feature_major=feature_major)


def warm_up(engine: Engine, *, precompile: bool = False) -> str:
    """Compile before the first client waits: every step shape the engine can run (``precompile``:
    :meth:`Engine.compile_all`, then no request ever waits for a compilation), or only the commonest (a short
    prefill and a decode step of one sequence; other shapes compile when a batch first needs them). Says what."""
    t0 = time.perf_counter()
    if precompile:
        n = engine.compile_all()
        return f"compiled {n} step shapes in {time.perf_counter() - t0:.0f} s"
    rid = engine.submit([0] * min(8, engine.max_context - 1), SamplingParams(max_new_tokens=2), request_id="warmup")
    engine.run()
    engine.results.pop(rid)
    return f"compiled the batch-1 steps in {time.perf_counter() - t0:.0f} s (others on first use; --precompile)"


def serve(graphdef, state, config, tokenizer, options: ServeOptions = ServeOptions()) -> int:
    """Serve the model over HTTP until a signal stops it (see the module docstring); the exit code."""
    import uvicorn

    from jaxformer.serve.app import Service, create_app
    from jaxformer.serve.metrics import Metrics
    from jaxformer.serve.worker import EngineWorker

    o = options
    engine = build_engine(graphdef, state, config, max_batch=o.max_batch, num_pages=o.num_pages,
                          page_size=o.page_size, max_context=o.max_context, chunk_size=o.chunk_size)
    compiled = warm_up(engine, precompile=o.precompile)
    metrics = Metrics()
    worker = EngineWorker(engine, max_queue=o.max_queue, metrics=metrics)
    service = Service(worker, tokenizer, name=o.name, metrics=metrics)
    m = engine.manager
    print(f"jaxformer serve: {o.name!r} on http://{o.host}:{o.port} (max_context {engine.max_context}, max_batch "
          f"{o.max_batch}, max_queue {o.max_queue}, {m.num_pages} KV pages of {m.page_size} tokens"
          + (", chat template" if service.chat is not None else ", no chat template") + f"); {compiled}",
          file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if worker.accepting:
                worker.accepting = False  # a request already on a connection is answered 503 from now on
                timer = threading.Timer(o.shutdown_timeout, worker.cancel_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    # uvicorn's own deadline is a backstop: by then every request was cancelled and has answered
    server = Server(uvicorn.Config(create_app(service), host=o.host, port=o.port, log_level=o.log_level,
                                   timeout_graceful_shutdown=o.shutdown_timeout + 10, lifespan="on", access_log=False))
    # uvicorn re-raises the signal it shut down on once it has; with this handler that ends in a clean exit 0
    previous = signal.signal(signal.SIGTERM, lambda *_: logging.getLogger("jaxformer.serve").info("stopped"))
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.stop()
    return 0 if worker.error is None else 1
