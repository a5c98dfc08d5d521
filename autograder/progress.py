"""A tiny progress bar on stderr (no dependency): redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    """``update(done, text)`` after each step of ``total``.

    On a terminal the bar is redrawn in place; elsewhere (a log, CI) each step is one plain line, or nothing when
    ``plain=False`` (for steps too small to be worth a line each).
    """

    def __init__(self, total: int, label: str, stream=None, plain: bool = True):
        self.total, self.label, self.plain = total, label, plain
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()

    def update(self, done: int, text: str = "") -> None:
        elapsed = time.monotonic() - self.start
        if self.tty:
            width = 24
            filled = int(width * done / max(self.total, 1))
            line = f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {elapsed:5.0f}s {text}"
            self.stream.write(line[:120].ljust(120))
            if done >= self.total:
                self.stream.write("\n")
        elif self.plain:
            self.stream.write(f"{self.label} {done}/{self.total} ({elapsed:.0f}s) {text}\n")
        else:
            return
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line on a terminal if it did not reach the end."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
