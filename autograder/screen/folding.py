"""The constant strings an expression may evaluate to, folded from constants: ``"tb_" + "frame"``, an f-string of
constants, ``"{}_{}".format("tb", "frame")``, ``"emarf_bt"[::-1]``, ``"".join(["tb", "_frame"])``, a name bound
to constants. The screen screens ``getattr(x, <such a string>)`` as the attribute it spells.

``_Folding`` folds; which constants a name holds is learned by ``_Bindings`` (``bindings.py``), which it is part of.
"""

from __future__ import annotations

import ast
import itertools

_MAX_VALUES = 64  # a folded expression with more possible values is left unknown
_MAX_LENGTH = 4096  # and one that spells a longer string


class _Folding:
    """Folding over the constants the cell's names hold: ``strings`` (a name's possible string values) and
    ``sequences`` (the strings of the tuple or list a name holds), filled in by ``_Bindings``."""

    strings: dict[str, set[str]]
    sequences: dict[str, set[str]]

    def fold(self, node) -> set[str] | None:
        """Every string ``node`` may evaluate to, folded from constants; None when it is not known."""
        values = self._fold(node)
        return values if values and len(values) <= _MAX_VALUES else None

    def _fold(self, node):
        try:
            values = self._fold_node(node)
            return values if values is None or all(len(v) <= _MAX_LENGTH for v in values) else None
        except (ArithmeticError, AttributeError, IndexError, KeyError, TypeError, ValueError, MemoryError):
            return None  # "{0.x}".format("a"), "abc"[::0]: not a string the cell could spell

    def _fold_node(self, node):
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            return set(self.strings[node.id]) if node.id in self.strings else None
        if isinstance(node, ast.IfExp):
            body, orelse = self._fold(node.body), self._fold(node.orelse)
            return body | orelse if body is not None and orelse is not None else None
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Add):
                return self._product([node.left, node.right], "".join)
            if isinstance(node.op, ast.Mult):
                text, times = (node.left, node.right) if isinstance(node.right, ast.Constant) else (node.right,
                                                                                                    node.left)
                values = self._fold(text)
                if values is not None and isinstance(times, ast.Constant) and isinstance(times.value, int) \
                        and 0 <= times.value <= 8:
                    return {v * times.value for v in values}
            if isinstance(node.op, ast.Mod):
                return self._percent(node)
            return None
        if isinstance(node, ast.JoinedStr):
            folded = []
            for v in node.values:
                if isinstance(v, ast.FormattedValue):
                    if v.format_spec is not None or v.conversion not in (-1, ord("s"), ord("r"), ord("a")):
                        return None
                    values = self._fold(v.value)
                    if values is None:
                        return None
                    folded.append(values if v.conversion in (-1, ord("s")) else {repr(x) for x in values})
                else:
                    folded.append(self._fold(v))
            if any(f is None for f in folded):
                return None
            return {"".join(combo) for combo in self._combos(folded)} or None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            values = self._fold(node.value)
            bounds = [self._int(b) for b in (node.slice.lower, node.slice.upper, node.slice.step)]
            if values is None or any(b is False for b in bounds):
                return None
            return {v[slice(*bounds)] for v in values}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
            method, base = node.func.attr, node.func.value
            if method == "join" and len(node.args) == 1:
                items = self._items(node.args[0])
                seps = self._fold(base)
                if items is None or seps is None:
                    return None
                return {sep.join(combo) for sep in seps for combo in self._combos(items)}
            if method == "format":
                templates = self._fold(base)
                args = [self._fold(a) for a in node.args]
                if templates is None or any(a is None for a in args):
                    return None
                return {t.format(*combo) for t in templates for combo in self._combos(args)}
            if method in ("lower", "upper", "strip", "lstrip", "rstrip", "title", "casefold") and not node.args:
                values = self._fold(base)
                return {getattr(v, method)() for v in values} if values is not None else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" \
                and len(node.args) == 1:
            return self._fold(node.args[0])
        return None

    @staticmethod
    def _int(node):
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
                and isinstance(node.operand.value, int):
            return -node.operand.value
        return False

    def _items(self, node) -> list[set[str]] | None:
        """The possible strings of each element of a literal tuple, list or set (``reversed``/``list`` of one)."""
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [self._fold(e) for e in node.elts]
            return None if any(i is None for i in items) else items
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("reversed", "list",
                                                                                                "tuple", "sorted") \
                and len(node.args) == 1:
            inner = self._items(node.args[0])
            if inner is None:
                values = self._fold(node.args[0])  # reversed("emarf_bt"): the characters
                if values is None:
                    return None
                inner = [{c} for c in next(iter(values))] if len(values) == 1 else None
            if inner is not None and node.func.id == "reversed":
                inner = inner[::-1]
            return inner if node.func.id != "sorted" else None
        return None  # a name bound to a sequence gives its members to a loop (``members``), not an order

    def _combos(self, items):
        count = 1
        for i in items:
            count *= len(i)
            if count > _MAX_VALUES:
                return []
        return itertools.product(*items)

    def _product(self, parts, join):
        folded = [self._fold(p) for p in parts]
        if any(f is None for f in folded):
            return None
        return {join(combo) for combo in self._combos(folded)} or None

    def _percent(self, node):
        templates = self._fold(node.left)
        right = node.right
        args = [self._fold(e) for e in right.elts] if isinstance(right, ast.Tuple) else [self._fold(right)]
        if templates is None or any(a is None for a in args):
            return None
        return {t % tuple(combo) for t in templates for combo in self._combos(args)}

    def members(self, node) -> set[str] | None:
        """The strings a loop over ``node`` may give (a literal of constants, or a name bound to one)."""
        items = self._items(node)
        if items is not None:
            return set().union(*items) if items else set()
        if isinstance(node, ast.Name) and node.id in self.sequences:
            return set(self.sequences[node.id])
        return None
