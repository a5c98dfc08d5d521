"""labsupport: run ``torch.distributed`` workers from a notebook cell, and look at what they do.

The few public names:

* ``run(fn, *args, world_size=4, backend="auto", timeout=60.0, **kwargs)``: start ranks, return their results.
* ``%load_ext labsupport`` then ``%%distributed -n 4``: run a whole cell on every rank.
* ``device()``: inside a worker, the device for this rank's tensors.
* ``shutdown()``: stop the idle workers kept between calls.
* ``WorkerError``, ``WorkerTimeout``: what ``run`` raises when a rank fails or a call deadlocks.
* ``CommCounter``: record the communication calls a rank makes.
* ``Timeline``: record compute and communication spans per rank, to draw them.
* ``grading()``: True while the autograder runs the notebook (measurements shrink).
* ``show_table(header, rows)``: print an aligned text table; ``shorten(text, limit)``: a long text cut at a line or
  a word, saying so; ``skipped(exc, name)``: the line a demo prints when an exercise it runs is not ready.
* ``%%visible_test NAME`` and ``require_passed(NAME)``: visible tests that let *Run All* go past an exercise not
  written yet, and a Validate button that fails until every visible test passes (``labsupport.visible``).
* ``use_language("zh")``, ``language()``: the language of the course's messages (``labsupport.i18n``); the set-up
  cell of each Chinese notebook calls ``use_language("zh")``.
"""

import os as _os

from .comm import CommCounter, CommCall
from .display import shorten, show_table, skipped
from .visible import require_passed, require_visible
from .launch import WorkerError, WorkerTimeout, device, in_worker, run, shutdown
from .i18n import language, use_language
from .timeline import Timeline
from ._pool import start_early as _start_early
from ._pool import stop_with_the_kernel as _stop_with_the_kernel

__all__ = [
    "run",
    "shutdown",
    "device",
    "in_worker",
    "WorkerError",
    "WorkerTimeout",
    "CommCounter",
    "CommCall",
    "Timeline",
    "grading",
    "show_table",
    "shorten",
    "skipped",
    "require_passed",
    "require_visible",
    "use_language",
    "language",
]


def grading() -> bool:
    """True while the autograder executes the notebook (``LABSUPPORT_GRADING=1``): keep measurements small.

    Example::

        SIZES = [4 * 1024, 64 * 1024] if labsupport.grading() else [4 * 1024, 1 << 20, 16 << 20]
    """
    return _os.environ.get("LABSUPPORT_GRADING", "") not in ("", "0")


def load_ipython_extension(ipython):
    """``%load_ext labsupport``: registers the ``%%distributed`` and ``%%visible_test`` cell magics."""
    from .magics import register
    from .visible import register as register_visible_test

    register(ipython)
    register_visible_test(ipython)


_start_early()  # in a notebook kernel: the fork server imports torch while the notebook goes on
_stop_with_the_kernel()  # in a notebook kernel: a shutdown or restart stops the workers first
