"""Checks for notebook 04_tensor_parallel: ``check_copy_to_tp``, ``check_reduce_from_tp``,
``check_ColumnParallelLinear``, ``check_RowParallelLinear``, ``check_ParallelMLP``, ``check_ParallelAttention``.

The oracle is the dense layer in one process: every rank builds the same dense module (same seed) and runs it on
the same input, so it knows the whole output, the input's gradient and every weight's gradient. The student's
layer, built with ``from_dense`` on t ranks, must give the same output (or this rank's slice of it), the same
input gradient, and for each of its parameters the gradient of the dense weight's shard it holds.

Parameters are recognised by value, not by name: a parameter must equal one of the shards this rank may hold
(``w.chunk(t, 0)[r]`` of a column-parallel weight, ``w.chunk(t, 1)[r]`` of a row-parallel one, a bias chunk, the
full row-parallel bias, or for attention the q, k and v shards concatenated into one fused weight). So fused or
separate q/k/v and any attribute names are accepted; interleaved shards, a full weight, or a shard of the wrong
rank are named in the message.

How: the student's function or class runs in the grading sandbox of each rank, exercised by ``drivers.drive`` (from
a copy of the dense module: from_dense, forward, backward); the host (the probe) compares what comes back with its
own oracle and splits its own record of the calls at the driver's marks: from_dense (no communication), forward
and backward (kind, bytes and group of every call). What a module keeps is measured, not walked: after every
configuration, a memory scenario on 2 ranks builds the module from a dense layer of 16 to 18 MiB, and the host
reads the sandbox's resident size from ``/proc`` before the dense layer exists and once from_dense has returned and
the dense layer is dropped (the driver trims the heap first): the growth must be the shards' bytes, whatever holds
the rest (an attribute starting with '_', a module inside a list, a closure, a global, bytes or numpy copies); a
shard that is a view of the full weight keeps the full weight. The module's own attributes (``tensor_bytes``) only
name the culprit in the message. World sizes 1 to 4, plus 4 ranks split into two tensor-parallel groups of 2
(``group=`` must be honoured); shapes are drawn at grading time (hidden sizes divisible by t, odd batch and
sequence). Probes keep ranks in step: after each phase all ranks agree on whether one failed.

The package: ``harness`` (running probes in step, recording and comparing collectives), ``shards`` (parameters
recognised by value, and their gradients), ``exercise`` (one parallel module against its dense oracle, and the
memory scenario's verdict), ``probes`` (what runs on the workers for each exercise, with the wrong answers each is
known for), ``drivers`` (what runs in the sandbox).
"""

from __future__ import annotations

import random

from .._common import draw_seed, in_sandbox
from . import drivers
from .harness import _run
from .probes import _fg_shape, _probe_attention, _probe_column, _probe_fg, _probe_memory, _probe_mlp, _probe_row

#: Exercises whose check failed in this process (the hidden tests run in order, one notebook per judge), and what
#: each later exercise is built on: a failure downstream says which earlier one may cause it. Messages only.
_FAILED: set[str] = set()
_BUILT_ON = {
    "ColumnParallelLinear": ("copy_to_tp",),
    "RowParallelLinear": ("reduce_from_tp",),
    "ParallelMLP": ("copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear"),
    "ParallelAttention": ("copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear"),
}


def _checked(name, run):
    """Run one exercise's check; remember a failure, and lead a failure with the earlier ones it may come from."""
    try:
        run()
    except AssertionError as exc:
        _FAILED.add(name)
        causes = [c for c in _BUILT_ON.get(name, ()) if c in _FAILED]
        if not causes:
            raise
        raise AssertionError(f"({' and '.join(causes)} failed {'its' if len(causes) == 1 else 'their'} own test "
                             f"above, and {name} uses {'it' if len(causes) == 1 else 'them'}: fix "
                             f"{'that' if len(causes) == 1 else 'those'} first.) {exc}") from None
    else:
        _FAILED.discard(name)


__all__ = [
    "check_copy_to_tp",
    "check_reduce_from_tp",
    "check_ColumnParallelLinear",
    "check_RowParallelLinear",
    "check_ParallelMLP",
    "check_ParallelAttention",
]


def _sandboxed(obj, what):
    """The student's function or class as the probes call it: ``fn(mode, tp, ...)`` runs ``drivers.drive`` on it in
    the sandbox of each rank, on every configuration (the sandbox of a rank outside a tensor-parallel group makes
    that group as torch does, without telling its host)."""
    return in_sandbox(obj, what, driver=drivers.drive)


def _module_check(name, cls, probe, **kwargs):
    """The exercise's probe on every configuration, then its memory scenario (on 2 ranks)."""
    seed = draw_seed()
    fn = _sandboxed(cls, name)

    def run():
        _run(probe, fn, seed, what=name, seed=seed, **kwargs)
        _run(_probe_memory, name, fn, seed, what=name, seed=seed, configs=((2, 2),))

    _checked(name, run)


def check_copy_to_tp(copy_to_tp) -> None:
    """f: identity in forward with no communication; one all-reduce (sum) of the gradient in backward, over
    ``group``; input untouched."""
    seed = draw_seed()
    shape = _fg_shape(random.Random(seed))
    fn = _sandboxed(copy_to_tp, "copy_to_tp")
    _checked("copy_to_tp", lambda: _run(_probe_fg, "copy_to_tp", fn, seed, shape, what="copy_to_tp", seed=seed))


def check_reduce_from_tp(reduce_from_tp) -> None:
    """g: one all-reduce (sum) over ``group`` in forward, input untouched; identity in backward, no communication."""
    seed = draw_seed()
    shape = _fg_shape(random.Random(seed))
    fn = _sandboxed(reduce_from_tp, "reduce_from_tp")
    _checked("reduce_from_tp", lambda: _run(_probe_fg, "reduce_from_tp", fn, seed, shape, what="reduce_from_tp",
                                            seed=seed))


def check_ColumnParallelLinear(ColumnParallelLinear) -> None:
    """from_dense keeps rows chunk(t, 0)[r] of the weight and its bias chunk (nothing more); forward equals this
    rank's slice of the dense output (or all of it with gather_output=True); input and weight gradients equal the
    dense ones; no communication in forward (one all-gather when gathering), one all-reduce in backward."""
    _module_check("ColumnParallelLinear", ColumnParallelLinear, _probe_column)


def check_RowParallelLinear(RowParallelLinear) -> None:
    """from_dense keeps columns chunk(t, 1)[r] of the weight and the full bias; forward equals the dense output
    with the bias added once; gradients equal the dense ones; one all-reduce in forward, none in backward (one
    all-gather with input_is_parallel=False)."""
    _module_check("RowParallelLinear", RowParallelLinear, _probe_row)


def check_ParallelMLP(ParallelMLP) -> None:
    """fc1 column-parallel, fc2 row-parallel, only this rank's shards kept; output, input gradient and shard
    gradients equal the dense MLP's; exactly one all-reduce of b*s*h elements in forward and one in backward."""
    _module_check("ParallelMLP", ParallelMLP, _probe_mlp)


def check_ParallelAttention(ParallelAttention) -> None:
    """Heads split over ranks (q, k, v column-parallel, fused or separate; out_proj row-parallel), only this rank's
    shards kept; output, input gradient and shard gradients equal the dense attention's; exactly one all-reduce of
    b*s*h elements in forward and one in backward."""
    _module_check("ParallelAttention", ParallelAttention, _probe_attention,
                  configs=((2, 2), (3, 3), (4, 4), (4, 2), (1, 1)))
