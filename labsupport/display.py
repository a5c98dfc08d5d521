"""Text output for notebooks: ``show_table(header, rows)`` prints an aligned table (no torch, no pandas)."""

from __future__ import annotations

__all__ = ["show_table"]


def show_table(header, rows) -> None:
    """Print ``rows`` (lists of values) under ``header`` as an aligned text table, numbers right-aligned.

    Example::

        show_table(["N", "sent per rank"], [[2, "1.000 S"], [4, "1.500 S"]])
    """
    cells = [[str(h) for h in header]] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for k, row in enumerate(cells):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))
