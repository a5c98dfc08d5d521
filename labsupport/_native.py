"""What a worker's native code writes to stderr (gloo's ``terminate called ... what(): ...``): kept in a file of the
rank, next to its stack file, and quoted when the rank dies of it."""

from __future__ import annotations

import os
import re


def native_log(stack_file: str) -> str:
    """The file a worker's native stderr goes to, next to its stack file."""
    folder, name = os.path.split(stack_file)
    return os.path.join(folder, "native-" + name.replace("stack-", "", 1))


def native_error(stack_file: str, limit: int = 300) -> str | None:
    """The last error native code wrote before the worker died: a C++ exception's ``what()``, else a "Fatal Python
    error" or "terminate called" line; None when it wrote neither.
    Source paths of the build machine are dropped (``[enforce fail at /__w/.../pair.cc:456] ``)."""
    try:
        with open(native_log(stack_file), "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = []
    for i, line in enumerate(lines):
        if "what():" in line:
            rest = line.split("what():", 1)[1].strip()
            found.append(rest or (lines[i + 1] if i + 1 < len(lines) else ""))
    # no what(): only lines that say a process is ending, never a stray warning of an earlier moment
    found = found or [line for line in lines if line.startswith(("Fatal Python error", "terminate called"))]
    message = (found or [None])[-1]
    if not message:
        return None
    message = re.sub(r"^\[(enforce fail )?at [^\]]*\]\s*", "", message)
    return message if len(message) <= limit else message[: limit - 3] + "..."
