"""Record what the TPU Pallas interpreter does: every input block it copies into VMEM, every grid point.

Used by the dead-block tests (dense and sparse masks) to prove skipped blocks are never fetched.
"""

from __future__ import annotations

import collections

# private: the TPU interpreter copies each input block into VMEM through `ipc.get`
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc


def record_tpu_interpreter(monkeypatch):
    """``(fetched, points, record_point)``.

    ``fetched[(grid rank, input name)]``: ``[(grid point, block index), ...]`` of every copied block
    (recorded from now on, through ``monkeypatch``); ``points[grid rank]``: grid points run, counted
    by ``record_point`` when given as ``pltpu.InterpretParams(grid_point_recorder=record_point)``.
    """
    fetched = collections.defaultdict(list)
    points = collections.Counter()
    real_get = ipc.get

    def recording_get(*args, input_name=None, **kwargs):
        if input_name is not None:
            block, point = tuple(int(x) for x in args[6]), tuple(int(x) for x in args[7])
            fetched[(len(point), input_name)].append((point, block))
        return real_get(*args, input_name=input_name, **kwargs)

    def record_point(token, point, core):
        points[len(point)] += 1
        return token

    monkeypatch.setattr(ipc, "get", recording_get)
    return fetched, points, record_point
