"""What runs in the sandbox for 04's checks: the scenarios that exercise a student's f/g and parallel modules there.

A driver travels by value to the sandbox and runs beside the student's code, so it imports only the standard library,
torch and labsupport, and what it returns is read as the student's answer: the host (``probes``) compares it with
its own dense oracle, reads the communication from its own record and the memory from ``/proc``. The driver marks
the points of a scenario with ``dist.barrier()`` (``autograder.checks._host``): after ``from_dense``, between
forward and backward. One entry point, ``drive(obj, mode, tp, ...)``, so that one wrapped object serves every
scenario of an exercise.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from labsupport._driving import settle


def _tp_group(tp: int):
    """The group to pass (None: the whole world), made as the host makes its own (``harness._tp_group``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp == world:
        return None
    groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    return groups[rank // tp]


def _mark() -> None:
    dist.barrier()


def _error(exc) -> tuple:
    return (type(exc).__name__, str(exc))


def _call(fn, *args, **kwargs):
    """(result, None) or (None, (error type, message)); NotImplementedError and AssertionError go on to the host."""
    try:
        return fn(*args, **kwargs), None
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        return None, _error(exc)


def make_dense(spec):
    """The dense module of a spec: ("linear", in, out, bias) / ("mlp", hidden, ffn) / ("attention", hidden, heads),
    its weights drawn from ``seed`` (the last item) as the host draws its own."""
    from labsupport.lessons.tensor_parallel import MLP, SelfAttention

    kind, *sizes, seed = spec
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if kind == "linear":
            return nn.Linear(sizes[0], sizes[1], bias=sizes[2])
        if kind == "mlp":
            return MLP(sizes[0], ffn_hidden=sizes[1])
        return SelfAttention(sizes[0], sizes[1])


def _tensor(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _fg(fn, tp, x_value, incoming):
    group = _tp_group(tp)
    x = x_value.clone().requires_grad_()
    out, error = _call(fn, x, group=group)
    _mark()
    seen = {"error": error, "is_tensor": isinstance(out, torch.Tensor), "type": type(out).__name__,
            "out": _tensor(out) if isinstance(out, torch.Tensor) else None,
            "requires_grad": bool(getattr(out, "requires_grad", False)), "x_after": x.detach().clone()}
    if error is None and seen["is_tensor"] and seen["requires_grad"]:
        seen["backward_error"] = _call(out.backward, incoming)[1]
        _mark()
        seen.update(x_grad=_tensor(x.grad), incoming_after=incoming.clone())
    return seen


def _build(cls, group, dense, kwargs):
    module, error = _call(cls.from_dense, dense, group=group, **kwargs)
    return module, error


def _module(cls, tp, dense, kwargs, X, G, pinned):
    """from_dense on a copy of ``dense``, forward on ``X``, backward of ``G``; marks after from_dense and after
    forward. Returns what the host compares: the module's parameters and their gradients, the output, the input's
    gradient, and for messages only, the tensors the module's attributes keep (``tensor_bytes``)."""
    from labsupport.lessons.tensor_parallel import tensor_bytes

    group = _tp_group(tp)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    given = copy.deepcopy(dense)
    given.zero_grad(set_to_none=True)
    module, error = _build(cls, group, given, kwargs)
    changed = [name for name, value in given.state_dict().items() if not torch.equal(value, before[name])]
    del given
    _mark()
    seen = {"error": error, "changed": changed, "is_module": isinstance(module, nn.Module),
            "type": type(module).__name__}
    if error is not None or not seen["is_module"]:
        return seen
    params = list(module.named_parameters())
    found = tensor_bytes(module)
    seen.update(params=[(n, p.detach().clone()) for n, p in params], kept=found.total, largest=found.largest(),
                pinned={a: (_tensor(getattr(module, a)) if hasattr(module, a) else "missing") for a in pinned})
    x = X.clone().requires_grad_()
    out, error = _call(module, x)
    _mark()
    seen.update(forward_error=error, is_tensor=isinstance(out, torch.Tensor), out_type=type(out).__name__,
                out=_tensor(out) if isinstance(out, torch.Tensor) else None,
                requires_grad=bool(getattr(out, "requires_grad", False)), x_after=x.detach().clone())
    if error is not None or not seen["is_tensor"] or not seen["requires_grad"]:
        return seen
    seen["backward_error"] = _call(out.backward, G)[1]
    _mark()
    seen.update(x_grad=_tensor(x.grad), grads=[_tensor(p.grad) for _, p in params])
    return seen


def _bad(cls, tp, spec):
    """from_dense of a module whose size does not divide by t: what it raised, or None."""
    group = _tp_group(tp)
    try:
        cls.from_dense(make_dense(spec), group=group)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as exc:
        return _error(exc)
    return None


def _memory(cls, tp, spec, kwargs, X):
    """The memory scenario: marks before the dense module exists (the baseline), once it exists, and once
    ``from_dense`` returned and the dense module is gone, each after ``settle()``; then the forward on ``X``."""
    from labsupport.lessons.tensor_parallel import tensor_bytes

    group = _tp_group(tp)
    settle()
    _mark()
    dense = make_dense(spec)
    settle()
    _mark()
    module, error = _build(cls, group, dense, kwargs)
    del dense
    settle()
    _mark()
    if error is not None or not isinstance(module, nn.Module):
        return {"error": error, "is_module": isinstance(module, nn.Module), "type": type(module).__name__}
    found = tensor_bytes(module)
    with torch.no_grad():
        out, error = _call(module, X.clone())
    return {"error": None, "is_module": True, "forward_error": error, "kept": found.total,
            "largest": found.largest(), "out": _tensor(out) if isinstance(out, torch.Tensor) else None}


def drive(obj, mode, tp, *args):
    """The scenario ``mode`` ("fg", "module", "bad", "memory") of the student's ``obj`` on a tensor-parallel size
    ``tp``."""
    return {"fg": _fg, "module": _module, "bad": _bad, "memory": _memory}[mode](obj, tp, *args)

