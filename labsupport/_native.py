"""What a worker's native code writes to stderr (gloo's ``terminate called ... what(): ...``): kept in a file of the
rank, next to its stack file, and quoted when the rank dies of it."""

from __future__ import annotations

import os
import re


#: Lines with which native code says the process is ending: Python's fatal error, a C++ exception no one caught,
#: glibc's abort on a corrupted heap or a smashed stack, a C assert, and a glog fatal check (``F1202 10:00:00.1 ...``)
_ENDING = re.compile(r"Fatal Python error|terminate called|\*\*\* (?!Check failure).+ \*\*\*|double free|"
                     r"free\(\)|malloc\(\)|realloc\(\)|munmap_chunk\(\)|corrupted |.*: Assertion `.*' failed|"
                     r"F\d{4} \d\d:\d\d:\d\d")


def native_log(stack_file: str) -> str:
    """The file a worker's native stderr goes to, next to its stack file."""
    folder, name = os.path.split(stack_file)
    return os.path.join(folder, "native-" + name.replace("stack-", "", 1))


def native_error(stack_file: str, limit: int = 300) -> str | None:
    """The last error native code wrote before the worker died: a C++ exception's ``what()``, else a line that says
    the process is ending (``_ENDING``); None when it wrote neither.
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
    found = found or [line for line in lines if _ENDING.match(line)]
    message = (found or [None])[-1]
    if not message:
        return None
    message = re.sub(r"^\[(enforce fail )?at [^\]]*\]\s*", "", message)
    message = re.sub(r"^F\d{4} [\d:.]+\s+\d+ [^\]]*\]\s*", "", message)  # a glog line's time, thread and place
    return message if len(message) <= limit else message[: limit - 3] + "..."
