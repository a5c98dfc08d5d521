"""Text output for notebooks (no torch, no pandas): ``show_table(header, rows)`` prints an aligned table,
``shorten(text, limit)`` keeps a long text to a limit without cutting a word in two, and ``skipped(exc, name)`` is
the line a demo prints when an exercise it runs is not ready."""

from __future__ import annotations

from .i18n import _

__all__ = ["show_table", "shorten", "skipped"]

#: What ``shorten`` puts where it cut: after the beginning it keeps, or before the end it keeps.
CUT, CUT_BEFORE = "… (cut)", "(cut) …"


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


def shorten(text, limit: int = 300, end: bool = False) -> str:
    """``text`` as it is when it has at most ``limit`` characters; otherwise its beginning up to the last line break
    (or, when that would keep less than half of ``limit``, the last space) before ``limit``, and then ``… (cut)``: a
    long message or log is kept short without ending in the middle of a word, and says that it was cut. With
    ``end=True`` it keeps the end instead (a log's last lines), starting after a line break or a space, with
    ``(cut) …`` before it.

    Example::

        print(labsupport.shorten(str(exc), 900))
    """
    text = str(text)
    if len(text) <= limit:
        return text
    if end:
        tail = text[-limit - 1:]
        cut = tail.find("\n")
        if 0 <= cut <= (limit + 1) // 2:
            return CUT_BEFORE + "\n" + tail[cut + 1:].lstrip("\n")
        cut = tail.find(" ")
        if cut < 0:
            cut = 0
        return CUT_BEFORE + " " + tail[cut + 1:].lstrip()
    head = text[:limit + 1]                # a break right at the limit still counts
    cut = head.rfind("\n")
    if cut >= limit // 2:
        return text[:cut].rstrip() + "\n" + CUT
    cut = max(head.rfind(" "), head.rfind("\t"))
    if cut <= 0:                           # one very long word: nowhere better to cut
        cut = limit
    return text[:cut].rstrip() + " " + CUT


def _not_started(exc: BaseException) -> bool:
    """``exc`` is an exercise's ``NotImplementedError`` (in this kernel, or on a rank: a WorkerError)."""
    if getattr(exc, "exc_type", None) == "NotImplementedError":
        return True
    return isinstance(exc, NotImplementedError) and not getattr(exc, "not_passed", False)


def skipped(exc: BaseException, name: str | None = None) -> str:
    """The line a demo prints when it cannot run because the exercise ``name`` it uses is not ready, given what it
    caught: the exercise's ``NotImplementedError`` (in the kernel or on a rank) says "not started", anything else
    says what it was, on one line that ``shorten`` keeps short.

    Example::

        try:
            labsupport.run(demo, world_size=2)
        except NOT_READY as exc:
            print(labsupport.skipped(exc, "clip_grad_norm_"))
        # skipped: clip_grad_norm_ is not started: it still raises NotImplementedError
    """
    from .visible import NOT_STARTED_LINE

    what = name or _("an exercise this demo runs")
    if _not_started(exc):
        return _("skipped: {what} is {state}").format(what=what, state=_(NOT_STARTED_LINE))
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if getattr(exc, "not_passed", False):   # require_visible: its message names the exercise and what to do
        return shorten(_("skipped: {reason}").format(reason=first), 300)
    if not hasattr(exc, "exc_type") and type(exc).__name__ not in ("WorkerTimeout",):
        first = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return shorten(_("skipped: {what} is not ready: {reason}").format(what=what, reason=first), 300)
