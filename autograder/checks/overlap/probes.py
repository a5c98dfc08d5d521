"""What runs on the workers for the checks of notebook 10: an order log of this rank's transfers and matrix
products.

``OrderLog`` records, in one sequence, every point-to-point transfer this rank posts (from ``labsupport.tap``, the
tap ``CommCounter`` also reads: below the student's Python, whichever way the call was written), every explicit
``wait()`` on a request, and every matrix product (a ``TorchFunctionMode``: ``@``, ``torch.matmul``, ``mm``,
``bmm``, ``F.linear``, ``einsum``, ``scaled_dot_product_attention``, called as functions or as methods, all reach
it with their operands). So a check sees whether the transfer of the next chunk was posted before the product of
the chunk already here and waited for after it, which is what overlap means, without timing anything on a shared
machine. (A function mode, not a dispatch mode: the first operation under a dispatch mode imports some 800 modules,
5 to 15 s on a busy machine.)
"""

from __future__ import annotations

import itertools
import math
import re

import torch
from torch.overrides import TorchFunctionMode

_MATMULS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "linear", "einsum",
            "scaled_dot_product_attention", "dot", "mv", "inner", "tensordot"}


class OrderLog(TorchFunctionMode):
    """Inside a ``with`` block on one rank: ``posts`` (dicts: what, peer, nbytes, blocking, pos, waited),
    ``products`` (dicts: op, shapes, flops, pos)."""

    nested = True  # the tap's observer interface: look at calls inside others (a blocking send's own wait)

    def __init__(self):
        super().__init__()
        self._count = itertools.count()
        self.posts, self.products, self._works, self._last = [], [], {}, None
        self.refused = None  # the first built-in collective called inside the block

    # -- the tap
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
            # step out of the mode for the call itself: a collective under a function mode imports torch's tracing
            # machinery (seconds on a busy machine), and there is no product to see inside a call
            torch._C._pop_torch_function_stack()
            call.memo["overlap_off"] = True
        if call.is_comm and not call.in_comm and call.kind not in ("send", "recv", None):
            self.refused = self.refused or call.kind
        if call.is_comm and not call.in_comm and call.kind in ("send", "recv"):
            blocking, outer = False, call.outer
            while outer is not None:  # dist.send is dist.isend(...).wait(): look at every enclosing call
                blocking = blocking or (outer.level == "api" and outer.name in ("send", "recv"))
                outer = outer.outer
            rec = {"what": call.kind, "peer": call.peer, "nbytes": call.nbytes, "blocking": blocking,
                   "pos": next(self._count), "waited": None}
            call.memo["overlap_post"] = rec
            self.posts.append(rec)
            self._last = rec
        elif call.level == "wait" and call.outer is None:
            rec = self._works.get(id(call.target))
            if rec is not None and rec["waited"] is None:
                rec["waited"] = next(self._count)

    def exit(self, call) -> None:
        if call._memo is not None and call.memo.pop("overlap_off", False):
            torch._C._push_on_torch_function_stack(self)
        rec = call.memo.get("overlap_post") if call._memo is not None else None
        if rec is not None and call.result is not None:
            self._works[id(call.result)] = rec
        elif call.level == "api" and call.name in ("isend", "irecv") and call.result is not None and self._last:
            self._works[id(call.result)] = self._last

    # -- the products
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name == "einsum":
                ops = args[1:] if len(args) > 1 else ()
                tensors = list(ops[0]) if len(ops) == 1 and isinstance(ops[0], (list, tuple)) else list(ops)
            shapes = [tuple(t.shape) for t in tensors]
            self.products.append({"op": name, "shapes": shapes, "flops": _flops(name, shapes, args),
                                  "pos": next(self._count)})
        return func(*args, **kwargs)


def _flops(name: str, shapes, args) -> int:
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


def rows_of(product: dict, weight_shape) -> int | None:
    """The rows of the input a product with the weight (either orientation) computed; None if it did not use it.
    The shapes drawn make the weight's two sizes differ from every other size."""
    out, k = weight_shape
    shapes = product["shapes"]
    if product["op"].startswith(("add", "badd")):
        shapes = shapes[-2:]
    hits = [i for i, s in enumerate(shapes) if tuple(s[-2:]) in ((out, k), (k, out)) and math.prod(s) == out * k]
    if len(shapes) != 2 or len(hits) != 1:
        return None
    other = shapes[1 - hits[0]]
    if k not in other:
        return None
    return math.prod(other) // k
