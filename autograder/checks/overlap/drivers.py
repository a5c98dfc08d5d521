"""What runs in the grading sandbox for the three distributed exercises of notebook 10: ``on_ring`` calls the
student's function on the default group or on a group every rank makes, and lists the matrix products it computed.

This module travels by value to the sandbox (``in_sandbox``'s ``driver``), so it imports only the standard library
and torch. The list of products is the student's side's own report: it words the message of an honest mistake (one
product of the gathered input, every block of attention computed); whether a transfer overlapped a product is
measured by the host (the sandbox's CPU time between a transfer's post and its wait), never read from here.
"""

from __future__ import annotations

import math
import re

import torch
from torch.overrides import TorchFunctionMode

_MATMULS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "linear", "einsum",
            "scaled_dot_product_attention", "dot", "mv", "inner", "tensordot"}


class Products(TorchFunctionMode):
    """Every matrix product inside the block (``@``, ``torch.matmul``, ``mm``, ``bmm``, ``F.linear``, ``einsum``,
    ``scaled_dot_product_attention``, as functions or methods): ``products``, ``(op, shapes, flops)`` each. A
    function mode, not a dispatch mode: the first operation under a dispatch mode imports some 800 modules."""

    def __init__(self):
        super().__init__()
        self.products = []

    # the tap's observer interface (in the sandbox: the function's own calls): step out of the mode for each call,
    # since a torch.distributed call under a function mode imports torch's tracing machinery (a second of CPU)
    def __enter__(self):
        from labsupport import tap

        tap.subscribe(self)
        return super().__enter__()

    def __exit__(self, *exc):
        from labsupport import tap

        tap.unsubscribe(self)
        return super().__exit__(*exc)

    def enter(self, call) -> None:
        depth = torch._C._len_torch_function_stack()
        if call.outer is None and depth and torch._C._get_function_stack_at(depth - 1) is self:
            torch._C._pop_torch_function_stack()
            call.memo["products_off"] = True

    def exit(self, call) -> None:
        if call._memo is not None and call.memo.pop("products_off", False):
            torch._C._push_on_torch_function_stack(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name == "einsum":
                ops = args[1:] if len(args) > 1 else ()
                tensors = list(ops[0]) if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else list(ops)
            shapes = [tuple(t.shape) for t in tensors]
            self.products.append((name, shapes, flops(name, shapes, args)))
        return func(*args, **kwargs)


def flops(name: str, shapes, args) -> int:
    """Two times the multiply-adds of one product."""
    try:
        if name == "einsum":
            letters = re.sub(r"[^a-zA-Z,]", "", args[0].split("->")[0]).split(",")
            size = {}
            for spec, shape in zip(letters, shapes):
                for ch, n in zip(spec[-len(shape):] if shape else "", shape):
                    size[ch] = n
            return 2 * math.prod(size.values())
        if name == "scaled_dot_product_attention":
            q, k = shapes[0], shapes[1]
            return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
        if name == "linear":
            x, w = shapes[0], shapes[1]
            return 2 * math.prod(x[:-1]) * w[0] * w[-1]
        a, b = (shapes[-2], shapes[-1]) if name.startswith(("add", "badd")) else (shapes[0], shapes[1])
        if len(a) == 1 or len(b) == 1:
            return 2 * math.prod(a) * (b[-1] if len(b) > 1 else 1)
        batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2]))
        return 2 * batch * a[-2] * a[-1] * b[-1]
    except Exception:  # noqa: BLE001 - an unusual call: counted as nothing rather than breaking the student's code
        return 0


def _group(ring):
    """The group of the global ranks ``ring`` that the set-up call made."""
    from torch.distributed import distributed_c10d as c10d

    for group, ranks in c10d._world.pg_group_ranks.items():
        if group is not c10d.GroupMember.WORLD and sorted(ranks) == sorted(ring):
            return group
    raise RuntimeError(f"no group of the ranks {list(ring)}")


def on_ring(fn, args, ring):
    """``fn(*args)`` on the default group (``ring`` None) or with ``group=`` the group of the global ranks ``ring``
    (a rank outside it returns None): ``{"out": the result, "products": [...]}``. Called first with ``args`` None,
    by every rank, to make that group."""
    import torch.distributed as dist

    if args is None:  # the set-up call, outside the host's counters (a new group's connections are no message)
        if ring is not None:
            dist.new_group(list(ring))
        with Products():  # the first product under a function mode imports some 500 modules: now, not under a transfer
            torch.ones(1, 1) @ torch.ones(1, 1)
        return None
    kwargs = {}
    if ring is not None:
        if dist.get_rank() not in ring:
            return None
        kwargs["group"] = _group(ring)
    with Products() as mode:
        out = fn(*args, **kwargs)
    return {"out": out, "products": mode.products}
