"""jaxformer.serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine.

:func:`jaxformer.serve.server.serve` is ``jaxformer serve``; :mod:`~jaxformer.serve.worker` runs the engine
in its own thread behind a bounded queue; :mod:`~jaxformer.serve.app` holds the routes;
:mod:`~jaxformer.serve.protocol` checks requests and builds OpenAI's response bodies;
:mod:`~jaxformer.serve.text` turns tokens into streamed text (whole UTF-8 characters, stop strings);
:mod:`~jaxformer.serve.metrics` the Prometheus metrics. Needs the ``serve`` extra
(``pip install 'jaxformer[serve]'``); nothing else in jaxformer imports this package but the command line.
"""
