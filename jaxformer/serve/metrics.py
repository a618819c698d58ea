"""The server's Prometheus metrics (``GET /metrics``), one registry per server.

Gauges are set by the engine thread after every step; counters and histograms as requests arrive and end.
Latencies are seconds from the moment a request was queued: time to first token, and time per output
token (one request's decode time over its tokens after the first).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("jaxformer_requests_running", "Sequences in the engine's running batch", registry=r)
        self.waiting = Gauge("jaxformer_requests_waiting", "Sequences queued, not yet running (incl. preempted)",
                             registry=r)
        self.pages_used = Gauge("jaxformer_kv_pages_used", "KV-cache pages held by sequences", registry=r)
        self.pages_free = Gauge("jaxformer_kv_pages_free", "KV-cache pages on the free list", registry=r)
        self.pages_total = Gauge("jaxformer_kv_pages_total", "KV-cache pages in the pool", registry=r)
        self.preemptions = Counter("jaxformer_preemptions", "Sequences preempted (pages freed, recomputed later)",
                                   registry=r)
        self.prompt_tokens = Counter("jaxformer_prompt_tokens", "Prompt tokens of finished sequences", registry=r)
        self.generation_tokens = Counter("jaxformer_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("jaxformer_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.sequences = Counter("jaxformer_sequences_finished", "Sequences finished, by finish reason",
                                 ["finish_reason"], registry=r)
        self.cancelled = Counter("jaxformer_sequences_cancelled", "Sequences cancelled (client gone, shutdown)",
                                 registry=r)
        self.ttft = Histogram("jaxformer_time_to_first_token_seconds", "Queued to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxformer_time_per_output_token_seconds",
                              "A sequence's time per generated token after its first", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.e2e = Histogram("jaxformer_e2e_request_latency_seconds", "Queued to finished, per sequence",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._preemptions_seen = 0

    def refresh(self, engine, waiting: int) -> None:
        """The gauges from the engine's state (on the engine thread, after a step)."""
        m = engine.manager
        self.running.set(len(engine.running))
        self.waiting.set(waiting)
        self.pages_total.set(m.num_pages)
        self.pages_free.set(m.num_free)
        self.pages_used.set(m.num_pages - m.num_free)
        seen = engine.stats["preemptions"]
        if seen > self._preemptions_seen:
            self.preemptions.inc(seen - self._preemptions_seen)
            self._preemptions_seen = seen

    def finished(self, choice, result, now: float) -> None:
        """One sequence ended (``choice``: the worker's :class:`Choice`; ``result``: the engine's)."""
        self.sequences.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(len(choice.prompt))
        self.generation_tokens.inc(len(result.tokens))
        self.e2e.observe(now - choice.submitted)
        if choice.first_token is not None and len(result.tokens) > 1:
            self.tpot.observe((now - choice.first_token) / (len(result.tokens) - 1))
