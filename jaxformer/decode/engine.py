"""Continuous-batching engine over the paged KV cache.

Each :meth:`Engine.step`:

1. admits waiting requests, oldest first, while a batch slot and the pages for
   their tokens are free (a computed shared prefix costs no new pages);
2. gives every running sequence its next tokens: a prefill chunk of up to
   ``chunk_size`` tokens, or the one token it sampled last step; the decoding
   sequences run as one call at width 1 (the paged-attention kernel) and those with
   a prefill chunk as another at the width of their longest chunk (so a sequence
   joining never makes the decoding ones compute chunk-wide rows); widths come from
   a few buckets (``chunk_size`` halved down to 8), so a handful of compiled shapes
   serve every batch. The step's
   work follows the tokens in the cache, not the engine's capacity: it runs only as
   many batch rows as sequences (a power of two, at most ``max_batch``), and sends
   block tables only as wide as the longest of them needs this step (a power of two
   of pages, at least ``MIN_TABLE_TOKENS`` tokens' worth, ``MIN_BATCHED_TABLE_TOKENS`` in a decode
   call of ``BATCHED_DECODE_ROWS`` rows or more, at most ``max_context``'s),
   so the paged attention and the prefill's page gather read those pages alone, and
   compiled programs stay few (about log2 of each); ``stats["table_width"]`` and
   ``stats["batch_rows"]`` say what the last step used. The head runs only at each
   row's last real token (``logits_at``);
3. when pages run out, preempts the newest running sequence (its pages are freed
   and it returns to the front of the queue, to be recomputed from its prompt and
   the tokens it already generated; its sampling keys depend only on the token
   index, so it continues exactly as before);
4. samples per request (temperature, top-k, top-p, seed), appends, and retires
   finished sequences at once (max tokens, a stop token, or a full context),
   freeing their pages; ``Result.stopped_by`` says which.

Sliding window (``window=W``, models with relative positions only: RoPE, ALiBi):
every token attends to its last ``W`` positions, so a sequence may run past the
context; positions keep counting. Before each step a sequence's pages whose tokens
all lie behind its next token's window go back to the free list, so in decode it
holds at most ``ceil(W / L) + 1`` pages, however long it runs. A preempted sequence is
recomputed the same way (windowed prefill, dropping pages as it goes). A model trained with a
sliding window (``sparsity.window=(W - 1, 0)``: Mistral, Qwen2) brings its own
``config.sparsity.causal_window`` W, which the engine always uses (a ``window=`` given too must equal it).

A bad request (empty prompt, prompt longer than the context, out-of-vocabulary
ids, invalid sampling parameters, more pages than the pool has) gets a
``Result`` with ``finish_reason="error"`` and a message; the others run on.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.decode.block_manager import BlockManager, OutOfPages
from jaxformer.decode.generate import check_prompt
from jaxformer.decode.paged_cache import PagedKVCache, copy_pages, init_page_pools
from jaxformer.decode.sampling import SamplingParams, request_keys, sample
from jaxformer.nn.params import FEATURE_MAJOR_ROWS, add_transposed_copies

TRACE_COUNTS: collections.Counter = collections.Counter()
MIN_TABLE_TOKENS = 256  # narrowest block table a step sends, in tokens: fewer compiled programs, and below
# this much context a decode step's attention is a small part of its weight reads anyway
BATCHED_DECODE_ROWS, MIN_BATCHED_TABLE_TOKENS = 16, 64  # ... except in a decode call of 16 or more rows: its
# attention reads B x M x L keys: at 16 rows of ~90 cached tokens it took ~40% of the step over a 256-token
# table (SmolLM2-135M on 2 Zen 2 cores; 16 concurrent sequences ran 1.15x as fast at 64,
# experiments/results/decode_cpu.md), worth two more compiled programs (~5 s each there) in a long run. At 8
# rows the step hardly moved (78 vs 80 ms), so engines of `generate`'s default 8 rows compile nothing more


@dataclasses.dataclass
class Result:
    """What became of one request. ``finish_reason``: "stop" | "length" | "error" | "cancelled"
    (:meth:`Engine.cancel`); ``stopped_by``, the finer cause: "stop_token" | "max_new_tokens" | "context" (the
    sequence filled ``max_context``; a sliding window never does) | "error" | "cancelled" (the server's worker
    reports a request a stop string ended as "stop" | "stop_string")."""

    request_id: Hashable
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    error: str | None = None
    num_preemptions: int = 0
    stopped_by: str = "error"


@dataclasses.dataclass
class _Req:
    rid: Hashable
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One engine step's device inputs, a row per batch slot (``B`` slots, step width ``T``).

    tokens, positions: ``[B, T]`` int32, each row's new tokens (zero-padded) and their positions.
    tables: ``[B, M]`` int32 block tables, ``M`` the step's width (:func:`table_width`).
    lengths: ``[B]`` tokens already cached, counted from the table's first page.
    num_new: ``[B]`` new tokens per row (0: an idle slot).
    seeds ``[B]`` uint32 and steps ``[B]`` (tokens generated so far): the sampling keys.
    temperature, top_k, top_p: ``[B]`` sampling parameters.
    """

    tokens: jax.Array
    positions: jax.Array
    tables: jax.Array
    lengths: jax.Array
    num_new: jax.Array
    seeds: jax.Array
    steps: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What an engine step is compiled for: ``paged_attention``'s backend and interpret flag, and the
    sliding KV window (None: none)."""

    backend: str = "auto"
    interpret: bool = False
    window: int | None = None


class StaticModel:
    """The static half of the model for the jitted step: its graphdef and the state's tree structure, hashed
    once. Hashing a graphdef walks every node (about a millisecond for 30 layers) and flattening an
    ``nnx.State`` sorts its keys in Python, both on every call; the step takes this and the state's leaves."""

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticModel) and self._hash == other._hash
                                 and (self.graphdef, self.treedef) == (other.graphdef, other.treedef))

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def of(graphdef, treedef) -> StaticModel:
        """One object per distinct model, so engines over equal models share compiled steps by identity."""
        return StaticModel(graphdef, treedef)


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=2)
def engine_step(model: StaticModel, leaves, pools, inputs: StepInputs, options: StepOptions):
    """One batched model call over paged caches (the state given as ``model.treedef``'s ``leaves``); returns
    each row's next token and the new pools. The head runs at each row's last new token only (the one
    sampled)."""
    (B, T), M = inputs.tokens.shape, inputs.tables.shape[1]
    TRACE_COUNTS[f"step_B{B}_T{T}_M{M}"] += 1
    caches = [PagedKVCache(k, v, inputs.tables, inputs.lengths, inputs.num_new, options.backend,
                           options.interpret, options.window) for k, v in pools]
    state = jax.tree.unflatten(model.treedef, leaves)
    logits, caches = nnx.merge(model.graphdef, state)(inputs.tokens, positions=inputs.positions, cache=caches,
                                                      logits_at=jnp.maximum(inputs.num_new - 1, 0))
    nxt = sample(logits[:, 0], request_keys(inputs.seeds, inputs.steps), inputs.temperature, inputs.top_k,
                 inputs.top_p)
    return nxt, [(c.k_pages, c.v_pages) for c in caches]


RELATIVE_POSITIONS = ("rope", "alibi")


def pages_per_sequence(max_context: int, page_size: int, window: int | None = None) -> int:
    """Most pages one sequence holds at once (the block-table width ``M``): its context, or with
    a sliding window also the window's pages plus the one the next token starts."""
    full = -(-max_context // page_size)
    return full if window is None else max(full, -(-window // page_size) + 1)


def bucket(n: int, low: int, high: int) -> int:
    """The smallest power of two ``>= max(n, low)``, at most ``high``."""
    return min(high, 1 << (max(n, low, 1) - 1).bit_length())


def min_table_tokens(rows: int, width: int) -> int:
    """The narrowest block table (tokens) a call of ``rows`` batch rows of ``width`` tokens sends:
    ``MIN_BATCHED_TABLE_TOKENS`` for a decode call (width 1) of at least ``BATCHED_DECODE_ROWS`` rows,
    ``MIN_TABLE_TOKENS`` otherwise."""
    return MIN_BATCHED_TABLE_TOKENS if width == 1 and rows >= BATCHED_DECODE_ROWS else MIN_TABLE_TOKENS


def table_width(pages: int, capacity: int, page_size: int, floor_tokens: int = MIN_TABLE_TOKENS) -> int:
    """Block-table width (pages) a step sends when its longest sequence needs ``pages`` pages: a power
    of two of at least ``floor_tokens`` tokens' pages (a call's own: :func:`min_table_tokens`), at most
    ``capacity`` (``max_pages_per_seq``)."""
    return bucket(pages, -(-floor_tokens // page_size), capacity)


def check_window(window: int | None, config) -> int | None:
    """The sliding KV window to decode ``config``'s model with, given the requested ``window``.

    A model with its own sliding window (``config.sparsity.causal_window``) always uses it; a requested
    ``window`` must then equal it. Otherwise ``window`` (or None): an int in [1, max_seq_len].
    Either way a window needs relative positions (RoPE, ALiBi). ValueError naming the reason."""
    model = config.sparsity.causal_window
    if model is not None:
        if window is not None and window != model:
            raise ValueError(f"window={window!r} differs from the model's own sliding window "
                             f"sparsity.causal_window={model} (sparsity.window={config.sparsity.window}); omit "
                             f"window or pass {model}")
        window = model
    elif window is None:
        return None
    elif not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= config.max_seq_len:
        raise ValueError(f"window={window!r} must be an int in [1, max_seq_len={config.max_seq_len}] "
                         "(the model was trained on no longer distances)")
    if config.positions.kind not in RELATIVE_POSITIONS:
        own = f" (its own, sparsity.window={config.sparsity.window})" if model is not None else ""
        raise ValueError(f"a sliding window{own} needs relative positions (rope or alibi); this model has "
                         f"positions.kind={config.positions.kind!r}, which stops at its {config.max_seq_len}-token "
                         "context")
    return window


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """An :class:`Engine`'s sizes and choices.

    num_pages, page_size: the page pool per layer (``P``, ``L``); ``num_pages`` None: room for ``max_batch``
      sequences of ``max_context`` (of the window, with one).
    max_batch: sequences run together per step. chunk_size: prefill tokens per sequence per step.
    max_context: longest sequence (default ``config.max_seq_len``).
    prefix_sharing: reuse computed pages of equal prompt prefixes.
    backend, interpret: passed to ``paged_attention`` for decode steps.
    window: a sliding KV window of this many positions (see the module docstring); ``max_context`` then
      bounds prompts only. Default: the model's own ``config.sparsity.causal_window`` (None for a model
      without one).
    reserve: ``"pages"`` (default): a sequence holds the pages its tokens fill, taken as it grows;
      ``"context"``: admitting a sequence reserves its whole ``max_context`` of pages, as a contiguous KV
      cache preallocates ``max_context`` slots per sequence (a baseline to measure paging against: at most
      ``num_pages // pages per sequence`` sequences run at once, and none is ever preempted).
    feature_major: give the step's model transposed copies of the attention's and the FFNs' projections and
      an untied head (a tied head reads its table as it is), so steps of 2-32 tokens run them feature-major
      (:func:`jaxformer.nn.params.add_transposed_copies`: those products 1.3-2.8x faster on XLA's CPU backend,
      for the copies' memory: every layer's weights (and an untied head) once more, 425 MB beside the 538 MB of
      SmolLM2-135M). None (default): on when JAX's default backend is the CPU, for modules whose first such
      weight has at least ``FEATURE_MAJOR_MIN_WEIGHTS`` entries per layer; True: every module without
      adapters.
    """

    num_pages: int | None = None
    page_size: int = 16
    max_batch: int = 8
    chunk_size: int = 64
    max_context: int | None = None
    prefix_sharing: bool = True
    backend: str = "auto"
    interpret: bool = False
    window: int | None = None
    reserve: str = "pages"
    feature_major: bool | None = None


FEATURE_MAJOR_MIN_WEIGHTS = 1 << 18  # a module's first copied weight (1 MiB of fp32) for the CPU default:
# SmolLM2-135M's 576 x 1,536 ran its batched decode steps 1.10-1.21x faster feature-major on Zen 3
# (experiments/results/serve_cpu.md); a 4-layer 256 x 704 model's engine ran 0.81x (its 2-6 ms steps are call
# overhead; one `serve.py --small` run beside a study, not in a committed table)


def step_model(graphdef, state, feature_major: bool | None) -> tuple[StaticModel, list]:
    """The jitted step's static model and leaves for ``(graphdef, state)``, with the transposed copies added
    (:class:`EngineOptions`'s ``feature_major``; the state's own arrays are shared, not copied)."""
    if feature_major is None and jax.default_backend() == "cpu":
        feature_major, min_weights = True, FEATURE_MAJOR_MIN_WEIGHTS
    else:
        min_weights = 0
    if feature_major:
        model = nnx.merge(graphdef, state)
        if add_transposed_copies(model, min_weights):
            graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return StaticModel.of(graphdef, treedef), leaves


class Engine:
    """Continuous batching for a decoder-only model (see the module docstring).

    Args:
      graphdef, state, config: the model (``jaxformer.model.init`` or a restored checkpoint).
      options: the engine's sizes and choices (:class:`EngineOptions`), ``changes`` (its fields by name,
        ``Engine(g, s, c, num_pages=64, max_batch=4)``) over them.
    """

    def __init__(self, graphdef, state, config, options: EngineOptions | None = None, **changes):
        o = dataclasses.replace(EngineOptions() if options is None else options, **changes)
        self.engine_options = o
        self.graphdef, self.state, self.config = graphdef, state, config
        self.max_context = config.max_seq_len if o.max_context is None else o.max_context
        if not 0 < self.max_context <= config.max_seq_len:
            raise ValueError(f"max_context={o.max_context} must be in [1, config.max_seq_len={config.max_seq_len}]")
        if o.reserve not in ("pages", "context"):
            raise ValueError(f"reserve={o.reserve!r} must be 'pages' or 'context'")
        if o.max_batch < 1 or o.chunk_size < 2:
            raise ValueError(f"max_batch={o.max_batch} must be >= 1 and chunk_size={o.chunk_size} >= 2")
        if o.page_size < 1:
            raise ValueError(f"page_size={o.page_size} must be >= 1")
        self.max_batch, self.chunk_size = o.max_batch, o.chunk_size
        self.window = check_window(o.window, config)
        self.options = StepOptions(o.backend, o.interpret, self.window)
        self.max_pages_per_seq = pages_per_sequence(self.max_context, o.page_size, self.window)
        num_pages = o.max_batch * self.max_pages_per_seq if o.num_pages is None else o.num_pages
        if o.reserve == "context" and num_pages < self.max_pages_per_seq:
            raise ValueError(f"reserve='context' needs num_pages >= {self.max_pages_per_seq} (one sequence's "
                             f"max_context={self.max_context} in pages of {o.page_size}); got num_pages={num_pages}")
        self.manager = BlockManager(num_pages, o.page_size, prefix_sharing=o.prefix_sharing)
        self.pools = init_page_pools(config, num_pages, o.page_size)
        self.waiting: collections.deque[_Req] = collections.deque()
        self.running: list[_Req] = []
        self.results: dict[Hashable, Result] = {}
        self._ids = itertools.count()
        self.stats = collections.Counter()
        self._plain = step_model(graphdef, state, False)
        self._feature_major = None  # built at the first call of FEATURE_MAJOR_ROWS rows (a 425 MB copy at 135M)

    # -- requests
    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None, request_id=None) -> Hashable:
        """Queue a request; a bad one is answered at once with an error ``Result``. Returns its id."""
        def in_use(rid) -> bool:
            return rid in self.results or any(r.rid == rid for r in itertools.chain(self.waiting, self.running))

        if request_id is None:  # the next automatic id that no request (a caller-named one included) holds
            rid = next(self._ids)
            while in_use(rid):
                rid = next(self._ids)
        elif in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        else:
            rid = request_id
        params = SamplingParams() if params is None else params
        try:
            prompt = check_prompt(list(prompt), self.config)
            if len(prompt) > self.max_context:
                raise ValueError(f"prompt of {len(prompt)} tokens is longer than the context "
                                 f"max_context={self.max_context}")
            params.validate(self.config.vocab_size)
            need = self.pages_needed(len(prompt), params.max_new_tokens)
            if need > self.manager.num_pages:
                raise ValueError(f"request needs {need} pages of "
                                 f"{self.manager.page_size} tokens; the pool has {self.manager.num_pages}")
        except (ValueError, TypeError) as e:
            self.results[rid] = Result(rid, list(prompt) if isinstance(prompt, Iterable) else [], [],
                                       "error", error=str(e))
            return rid
        self.waiting.append(_Req(rid, prompt, params))
        return rid

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def run(self) -> dict[Hashable, Result]:
        """Step until every submitted request has a result; return all results."""
        while not self.done:
            self.step()
        return self.results

    def cancel(self, request_id: Hashable) -> bool:
        """Drop a waiting or running request now: its pages go back to the pool (those no other sequence
        shares) before the next step, and its ``Result`` has ``finish_reason="cancelled"`` and the tokens it
        generated. False (nothing changed) if it is not waiting or running: unknown, or already finished."""
        for queue in (self.waiting, self.running):
            req = next((r for r in queue if r.rid == request_id), None)
            if req is not None:
                self._finish(req, "cancelled", "cancelled", queue)
                self.stats["cancelled"] += 1
                return True
        return False

    def in_progress(self) -> dict[Hashable, list[int]]:
        """The tokens each waiting or running request has generated so far, by request id: what a caller streams
        between steps. The engine's own lists, not copies (read them, slice what is new): a preempted request
        keeps its tokens, so each list only grows."""
        return {r.rid: r.generated for r in itertools.chain(self.running, self.waiting)}

    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Every ``(B, T, M)`` a step of this engine can run: batch rows (powers of two up to ``max_batch``)
        x widths (1 and the prefill buckets, :meth:`_width`) x block-table widths (:func:`table_width`)."""
        rows = sorted({bucket(b, 1, self.max_batch) for b in range(1, self.max_batch + 1)})
        widths = sorted({1} | {self._width(n) for n in range(2, self.chunk_size + 1)})
        L, cap = self.manager.page_size, self.max_pages_per_seq
        return [(B, T, M) for B in rows for T in widths
                for M in sorted({table_width(p, cap, L, min_table_tokens(B, T)) for p in range(1, cap + 1)})]

    def compile_all(self) -> int:
        """Compile the step for every shape in :meth:`step_shapes` now, so no request waits for a compilation
        later (a server warms up with it); returns how many. The steps run on idle rows only (``num_new`` 0,
        as a step's padding rows), so the pools and every request are unchanged."""
        shapes = self.step_shapes()
        for B, T, M in shapes:
            z = np.zeros(B, np.int32)
            inputs = StepInputs(np.zeros((B, T), np.int32), np.zeros((B, T), np.int32), np.zeros((B, M), np.int32),
                                z, z, np.zeros(B, np.uint32), z, np.zeros(B, np.float32), z, np.ones(B, np.float32))
            _, self.pools = engine_step(*self._step_model(B * T), self.pools, inputs, self.options)
        jax.block_until_ready(self.pools)
        return len(shapes)

    def _step_model(self, rows: int) -> tuple[StaticModel, list]:
        """The step's model for a call of ``rows`` tokens: with the transposed copies for the rows they serve
        (:data:`jaxformer.nn.params.FEATURE_MAJOR_ROWS`), made at the first such call, so an engine whose calls
        all have one row or more than 32 (one long prompt in chunks of more than 32 tokens, then batch-1
        decode) never copies its weights (425 MB at 135M); a prompt's chunk of 2-32 tokens or a
        batch of 2-32 sequences makes them. Other rows run the plain model, which computes them the same way."""
        o = self.engine_options
        if rows not in FEATURE_MAJOR_ROWS or o.feature_major is False:
            return self._plain
        if self._feature_major is None:  # from the plain model's leaves: the weights the engine was built with
            plain, leaves = self._plain
            self._feature_major = step_model(self.graphdef, jax.tree.unflatten(plain.treedef, leaves),
                                             o.feature_major)
        return self._feature_major

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Most pages a request of this prompt length and ``max_new_tokens`` holds at once: what
        :meth:`submit` checks against the pool (the last new token is sampled, never cached)."""
        longest = prompt_len + max_new_tokens - 1
        return min(self.manager.pages_for(longest), self._peak_pages(prompt_len))

    # -- scheduling
    def _peak_pages(self, prompt_len: int) -> int:
        """Most pages a request holds at once: its context, or with a window its prompt's pages
        or the window's (plus the page the next token starts), whichever is more."""
        if self.window is None:
            return self.max_pages_per_seq
        return max(self.manager.pages_for(prompt_len), self.manager.pages_for(self.window) + 1)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            # pages up front for the prompt; a windowed sequence recomputed after preemption gets
            # the pages of its generated tokens chunk by chunk, dropping those behind the window
            cut = len(req.prompt) if self.window is not None else len(req.tokens)
            head, tail = req.tokens[:cut], req.tokens[cut:]
            # keep a page of growth per running sequence, so admitting never forces a preemption at once
            if self.manager.pages_needed_to_add(head) > self.manager.num_free - len(self.running):
                break
            if (self.engine_options.reserve == "context"
                    and (len(self.running) + 1) * self.max_pages_per_seq > self.manager.num_pages):
                break  # every running sequence keeps its max_context of pages: no room for another
            self.manager.add(req.rid, head)
            self.manager.append(req.rid, tail)
            self.running.append(self.waiting.popleft())

    def _preempt_newest(self) -> _Req:
        req = self.running.pop()
        self.manager.finish(req.rid)
        req.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(req)
        return req

    def _schedule(self) -> tuple[list[tuple[_Req, int]], list[tuple[int, int]]]:
        """(request, tokens to compute) per running sequence, and the page copies to make first."""
        plan, copies = [], []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            start = self.manager.num_computed(req.rid)
            n = min(len(req.tokens) - start, self.chunk_size)
            if self.window is not None:
                # free the pages behind the first new token's window; keep the chunk within its peak pages
                self.stats["pages_dropped"] += self.manager.drop_before(req.rid, max(0, start - self.window + 1))
                local = start - self.manager.num_dropped(req.rid) * self.manager.page_size
                n = min(n, self._peak_pages(len(req.prompt)) * self.manager.page_size - local)
            try:
                copies += self.manager.prepare_write(req.rid, n)
            except OutOfPages:
                victim = self._preempt_newest()  # the last running request: not yet in the plan (running[:i])
                if victim is req:
                    break
                continue
            plan.append((req, n))
            i += 1
        return plan, copies

    def _width(self, n: int) -> int:
        """Step width for a longest chunk of ``n``: 1, else the smallest of ``chunk_size / 2^i``
        (down to 8) that holds it, so a step of short chunks does not pay for a full one."""
        if n == 1:
            return 1
        width = self.chunk_size
        while width // 2 >= max(n, 8) and width % 2 == 0:
            width //= 2
        return width

    def _inputs(self, plan: list[tuple[_Req, int]]) -> StepInputs:
        """The step's inputs: ``B`` rows (the plan's, padded to a power of two), width ``T``
        (:meth:`_width`), tables ``M`` pages wide (:func:`table_width` of the longest row's need: its
        cached tokens plus this step's, from the table's first page); records ``M`` and ``B`` in stats."""
        L = self.manager.page_size
        T = self._width(max(n for _, n in plan))
        B = bucket(len(plan), 1, self.max_batch)
        rows = [(req, n, self.manager.num_computed(req.rid), self.manager.num_dropped(req.rid) * L,
                 self.manager.block_table(req.rid)) for req, n in plan]
        M = table_width(max(-(-(start - offset + n) // L) for _, n, start, offset, _ in rows),
                        self.max_pages_per_seq, L, min_table_tokens(B, T))
        ints = np.zeros((5, B), np.int32)  # lengths (from the table's first page), num_new, offsets, steps, top_k
        reals = np.zeros((2, B), np.float32)  # temperature, top_p
        reals[1] = 1.0
        seeds = np.zeros(B, np.uint32)
        tokens = np.zeros((B, T), np.int32)
        tables = np.zeros((B, M), np.int32)
        for b, (req, n, start, offset, table) in enumerate(rows):
            tokens[b, :n] = req.tokens[start:start + n]
            live = table[:M]  # pages past the longest row's need hold no token of this step
            tables[b, :len(live)] = live
            p = req.params
            ints[:, b] = start - offset, n, offset, len(req.generated), p.top_k
            reals[:, b] = p.temperature, p.top_p
            seeds[b] = p.seed
        lengths, num_new, offsets, steps, top_k = ints
        positions = (offsets + lengths)[:, None] + np.arange(T, dtype=np.int32)[None, :]
        if self.window is None:  # padding columns past the context (learned positions stop there)
            positions = np.minimum(positions, self.max_context - 1)
        self.stats["table_width"], self.stats["batch_rows"] = M, B
        self.stats["max_table_width"] = max(self.stats["max_table_width"], M)
        return StepInputs(tokens, positions, tables, lengths, num_new, seeds, steps, reals[0], top_k, reals[1])

    def _finish(self, req: _Req, reason: str, stopped_by: str, queue=None) -> None:
        """Retire ``req`` from ``queue`` (default: the running list): its pages back to the pool, its
        ``Result`` recorded."""
        (self.running if queue is None else queue).remove(req)
        if req.rid in self.manager:  # a running request holds pages; a waiting one none
            self.manager.finish(req.rid)
        self.results[req.rid] = Result(req.rid, req.prompt, list(req.generated), reason,
                                       num_preemptions=req.preemptions, stopped_by=stopped_by)

    def step(self) -> None:
        """Admit, schedule, run one batched model call, sample and retire finished sequences."""
        self._admit()
        if not self.running:
            if self.waiting:
                raise RuntimeError("the first waiting request does not fit an empty page pool")
            return
        plan, copies = self._schedule()
        if not plan:
            return
        if copies:
            n = 1 << (len(copies) - 1).bit_length()
            src = np.zeros(n, np.int32)
            dst = np.full(n, self.manager.num_pages, np.int32)
            src[: len(copies)], dst[: len(copies)] = zip(*copies)
            self.pools = copy_pages(self.pools, jnp.asarray(src), jnp.asarray(dst))
        sampled = {}
        # decoding rows and prefill chunks in separate calls: one [B, T] call would run every decoding
        # row at the chunk's width (16 rows x 16 positions where 15 + 16 are needed)
        for group in ([(r, n) for r, n in plan if n == 1], [(r, n) for r, n in plan if n > 1]):
            if group:
                inputs = self._inputs(group)
                nxt, self.pools = engine_step(*self._step_model(inputs.tokens.size), self.pools, inputs,
                                              self.options)
                sampled.update(zip((id(r) for r, _ in group), np.asarray(nxt).tolist()))
        self.stats["steps"] += 1
        self.stats["tokens_computed"] += sum(n for _, n in plan)
        for req, n in plan:
            self.manager.commit(req.rid, n)
            if self.manager.num_computed(req.rid) < len(req.tokens):
                continue  # more prefill to do
            tok = int(sampled[id(req)])
            req.generated.append(tok)
            self.manager.append(req.rid, [tok])
            if tok in req.params.stop_tokens:
                self._finish(req, "stop", "stop_token")
            elif len(req.generated) >= req.params.max_new_tokens:
                self._finish(req, "length", "max_new_tokens")
            elif self.window is None and len(req.tokens) > self.max_context:
                self._finish(req, "length", "context")


def serve(graphdef, state, config, requests: Iterable[tuple[Sequence[int], SamplingParams]], **engine_kwargs
          ) -> list[Result]:
    """Run ``(prompt_tokens, params)`` requests through one :class:`Engine`; results in request order."""
    engine = Engine(graphdef, state, config, **engine_kwargs)
    ids = [engine.submit(prompt, params) for prompt, params in requests]
    results = engine.run()
    return [results[i] for i in ids]
