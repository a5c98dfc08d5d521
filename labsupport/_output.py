"""The ranks' prints in the notebook: whole lines prefixed ``[rank N]``, the head and the tail of long output.

A rank that prints a lot (a training loop printing every step) shows its first lines as they come; once it has
shown half of ``MAX_LINES_PER_RANK``, its later lines are kept in a bounded buffer, and when the call ends the
last ones appear after a line saying how many were skipped in between: the final loss is what a student wants to
see. Memory stays bounded: at most ``MAX_LINES_PER_RANK`` lines per rank, each cut at ``MAX_PARTIAL_LINE``
characters once buffered.
"""

from __future__ import annotations

import os
import sys
from collections import deque

from .i18n import _

#: Lines of output shown per rank and call: the first half as they come, the last half when the call ends.
MAX_LINES_PER_RANK = int(os.environ.get("LABSUPPORT_MAX_LINES", "1000"))
#: A line without a newline is shown once it is this long, so that a rank printing without newlines cannot fill
#: the notebook's memory; a buffered tail line is cut at this length.
MAX_PARTIAL_LINE = 10_000


class RankOutput:
    """Relay the output of ``n`` ranks to this process's stdout and stderr."""

    def __init__(self, n: int, max_lines: int | None = None):
        max_lines = MAX_LINES_PER_RANK if max_lines is None else max_lines
        self.head = (max_lines + 1) // 2
        self.tail_size = max_lines - self.head
        self.shown = [0] * n  # lines shown live
        self.tails = [deque(maxlen=self.tail_size) for _ in range(n)]  # (stream, line) after the head
        self.skipped = [0] * n  # lines dropped between the head and the tail
        self.partial: dict[tuple[int, str], str] = {}  # (rank, stream) -> the start of a line still to come

    @staticmethod
    def _target(stream: str):
        """The workers' stderr goes to stderr, except while grading (``LABSUPPORT_GRADING=1``): nbgrader gives no
        points to a test cell that wrote to stderr, and a student's own ``print(..., file=sys.stderr)``, a printed
        traceback or a warning must not cost any."""
        if stream == "stdout" or os.environ.get("LABSUPPORT_GRADING", "") not in ("", "0"):
            return sys.stdout
        return sys.stderr

    def emit(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)  # a stdout fragment must never be glued to a line of stderr
        lines = (self.partial.pop(key, "") + text).split("\n")
        rest = lines.pop()  # '' when text ended with a newline
        if len(rest) > MAX_PARTIAL_LINE:
            lines.append(rest)
        elif rest:
            self.partial[key] = rest
        out = []
        for line in lines:
            if self.shown[rank] < self.head:
                self.shown[rank] += 1
                out.append(f"[rank {rank}] {line}\n")
                continue
            tail = self.tails[rank]
            if not tail and not self.skipped[rank] and self.tail_size:
                note = _("… more output: its last {count} lines appear when the call ends …").format(
                    count=self.tail_size)
                out.append(f"[rank {rank}] {note}\n")
            if len(tail) == tail.maxlen:
                self.skipped[rank] += 1
            if len(line) > MAX_PARTIAL_LINE:
                more = _("… ({count} more characters)").format(count=len(line) - MAX_PARTIAL_LINE)
                line = f"{line[:MAX_PARTIAL_LINE]} {more}"
            if tail.maxlen:
                tail.append((stream, line))
        if out:
            target = self._target(stream)
            target.write("".join(out))
            target.flush()

    def flush(self) -> None:
        """At the end of the call: lines still without a newline, then each rank's tail."""
        pending = sorted(self.partial.items())
        self.partial.clear()
        for (rank, stream), text in pending:
            self.emit(rank, stream, text + "\n")
        for rank, tail in enumerate(self.tails):
            if self.skipped[rank]:
                skipped = _("… {count} lines skipped …").format(count=self.skipped[rank])
                sys.stdout.write(f"[rank {rank}] {skipped}\n")
            for stream, line in tail:
                self._target(stream).write(f"[rank {rank}] {line}\n")
            tail.clear()
            self.skipped[rank] = 0
        sys.stdout.flush()
        sys.stderr.flush()
