"""What ``jaxformer serve`` can be told: :class:`ServeOptions` (one field per command-line option) and
:func:`add_serve_options`, which declares them on a parser. Imports nothing of the server's dependencies."""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How the server listens and how its engine is sized (see :func:`jaxformer.serve.server.build_engine`)."""

    name: str = "model"  # the model's name in the API
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 64
    num_pages: int | None = None
    page_size: int = 16
    max_context: int | None = None
    chunk_size: int = 16
    shutdown_timeout: float = 30.0
    precompile: bool = False
    log_level: str = "info"

    @classmethod
    def from_args(cls, args: argparse.Namespace, name: str) -> ServeOptions:
        """The options of a parsed ``jaxformer serve`` command line; ``--served-model-name`` else ``name``."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "name"}
        return cls(name=args.served_model_name or name, **given)


def add_serve_options(a) -> None:
    """The options of :class:`ServeOptions` through a parser's ``add_argument`` ``a`` (the model source
    arguments are the caller's)."""
    a("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    a("--port", type=int, default=8000)
    a("--served-model-name", help="the model's name in the API (default: the directory's name)")
    a("--max-batch", type=int, default=8, help="sequences decoded together per engine step")
    a("--max-queue", type=int, default=64, help="sequences that may wait; more are answered 429")
    a("--num-pages", type=int, help="KV pages per layer (default: max-batch sequences of max-context)")
    a("--page-size", type=int, default=16)
    a("--max-context", type=int, help="longest sequence (prompt + completion); default: the model's context, at "
      "most 2048")
    a("--chunk-size", type=int, default=16, help="prefill tokens per sequence per step (a step with a prefill chunk "
      "runs every row at its width: small keeps decoding streams smooth)")
    a("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get to finish after SIGTERM "
      "before they are cancelled")
    a("--precompile", action="store_true", help="compile every engine step shape before serving (steady latency "
      "from the first request; minutes for a large model)")
    a("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
