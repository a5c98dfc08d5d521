"""Plots that every lesson can use, drawn with matplotlib: ``plot_timeline`` (a Gantt chart of compute and
communication per rank, from ``labsupport.Timeline`` events). Each lesson's own diagrams live in its lesson module,
``labsupport.lessons.<name>``.

Every function returns the matplotlib ``Figure`` it drew, so a notebook cell shows it and a test can inspect it.
"""

from .timeline import PALETTE, plot_timeline

__all__ = ["plot_timeline", "PALETTE"]
