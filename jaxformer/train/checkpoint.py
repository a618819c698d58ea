"""Checkpoints: an orbax CheckpointManager (async, keep the last K) under ``RUN_DIR/checkpoints``.

Each step directory holds ``state`` (params, optimiser state, step, RNG; sharded
arrays), ``data`` (the grain iterator state, one JSON file per process) and
``meta`` (the step, the resolved config and a fingerprint of the parameters).
Restoring tries the newest step first; a checkpoint that fails to load, or whose
parameters do not match the fingerprint, is renamed ``<step>.corrupt`` with a
warning and the previous one is tried, so a bad checkpoint never becomes a
crash loop or silent garbage. Restoring onto a different mesh works because the
target shardings come from the current mesh.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import time
import warnings
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

def _closed_loop_callback(unraisable) -> bool:
    """An aborted restore's leftovers: a tensorstore future of the failed read completing after orbax closed the
    event loop it would notify (``RuntimeError: Event loop is closed`` in asyncio's ``call_soon_threadsafe``)."""
    exc, tb = unraisable.exc_value, unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_filename.endswith("base_events.py"))


def _quiet_aborted_restores() -> None:
    """Drop the unraisable-exception reports of a failed restore's leftovers (:func:`_closed_loop_callback`: on a
    mesh of 4 devices ~50 tracebacks under the one warning that says the checkpoint was set aside); any other
    report goes to the hook there was. Installed once per process, by the first restore."""
    hook = sys.unraisablehook
    if getattr(hook, "jaxformer_quiet", False):
        return

    def quiet(unraisable):
        if not _closed_loop_callback(unraisable):
            hook(unraisable)

    quiet.jaxformer_quiet = True
    sys.unraisablehook = quiet


class _RoutineNotices(logging.Filter):
    """Drops absl warnings that describe normal operation and that a user cannot act on: orbax announcing a
    read-only manager (``eval`` / ``generate`` open checkpoints read-only on purpose), and grain replaying
    its packing buffer to the restored position on resume (exact, it only costs a few elements)."""

    PREFIXES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True",
                "[elements_from_buffer_after_checkpoint]")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


logging.getLogger("absl").addFilter(_RoutineNotices())


@jax.jit
def _abs_sums(params) -> list[jax.Array]:
    return [jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in jax.tree.leaves(params)]


def fingerprint(params) -> list[float]:
    """Per-leaf sum of |x| (float64 on the host): a cheap integrity check for restored params.

    One program for the whole tree. On a mesh over several processes a leaf's sum may be a collective; with
    eager ops per leaf (dozens of small programs) two CPU processes training together (gloo,
    tests/train/test_multihost.py) hung for good in 3 of 19 runs, always one process inside these sums and the other
    in orbax's barrier program after them; as one program, 0 of 37 (experiments/results/multihost.md; the mechanism
    was not pinned down)."""
    return [float(s) for s in jax.device_get(_abs_sums(params))]


def signature(tree) -> list[str]:
    """``path:shape:dtype`` of every leaf: what a checkpoint must share with the state it restores into."""
    return [f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}"
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


class IncompatibleCheckpointError(ValueError):
    """A readable checkpoint whose arrays do not fit the current config (model or optimiser changed)."""


def _matches(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) for x, y in zip(a, b))


class Checkpointer:
    """Save and restore train state + data-iterator state + metadata for one run directory."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).absolute()
        self._keep, self._async, self._read_only = keep, async_save, read_only
        self._open()

    def _open(self):
        options = ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=not self._read_only,
                                               read_only=self._read_only,
                                               enable_async_checkpointing=self._async)
        self._mgr = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "data", "meta"))

    def steps(self) -> list[int]:
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def save(self, step: int, state, data_iter, meta: dict) -> None:
        """Start saving ``step`` (async: returns once the arrays are copied off the devices)."""
        meta = {**meta, "step": int(step), "fingerprint": fingerprint(state["params"]),
                "signature": signature(state), "time": time.time()}
        self._mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(meta),
        ), force=True)

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    def _fitting_meta(self, step: int, want: list[str]) -> dict | None:
        """The metadata of ``step`` (None if it does not read); IncompatibleCheckpointError if its arrays'
        signature is not ``want``."""
        try:
            saved = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:  # noqa: BLE001 - unreadable meta: the caller decides
            return None
        have = saved.get("signature")
        if have is not None and have != want:
            diff = sorted(set(have) ^ set(want))[:6]
            raise IncompatibleCheckpointError(
                f"checkpoint step {step} in {self.directory} does not fit this config (did the model or "
                f"optimizer change?); differing arrays: {diff}. Use a new --run-dir.")
        return saved

    def latest_meta(self, abstract_state) -> dict | None:
        """The metadata (``step``, ``config``, ...) of the newest checkpoint whose metadata reads, its arrays
        and data state unread (what a resume will start from, known before anything is built), or None.
        Raises IncompatibleCheckpointError as :meth:`restore_latest` does."""
        want = signature(abstract_state)
        for step in reversed(self.steps()):
            meta = self._fitting_meta(step, want)
            if meta is not None:
                return meta
        return None

    def restore_latest(self, abstract_state, state_shardings, data_iter=None):
        """``(state, meta)`` from the newest readable checkpoint, or ``None`` when there is none.

        ``data_iter`` (if given) is set to the saved iterator state.
        """
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_state, state_shardings)
        want = signature(abstract_state)
        _quiet_aborted_restores()  # an unreadable one's aborted reads report as they finish, during and after
        for step in reversed(self.steps()):
            self._fitting_meta(step, want)  # unreadable meta: handled as corrupt below
            try:
                items = dict(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
                if data_iter is not None:
                    items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
                out = self._mgr.restore(step, args=ocp.args.Composite(**items))
                state, meta = out["state"], out["meta"]
                if not _matches(fingerprint(state["params"]), meta.get("fingerprint", [])):
                    raise ValueError("parameters do not match the saved fingerprint")
                return state, meta
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is set aside
                bad = self.directory / str(step)
                aside = bad.with_name(f"{step}.corrupt")
                action = "skipped" if self._read_only else f"moved to {aside.name}"
                warnings.warn(f"checkpoint step {step} in {self.directory} is unreadable "
                              f"({type(e).__name__}: {str(e)[:200]}); {action}, "
                              f"trying the previous one", RuntimeWarning, stacklevel=2)
                if self._read_only:
                    continue
                if jax.process_index() == 0 and bad.exists():
                    if aside.exists():
                        shutil.rmtree(aside)
                    bad.rename(aside)
                self._mgr.close()
                self._open()
        return None
