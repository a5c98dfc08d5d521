"""Diagrams and measurement plots drawn with matplotlib, one module per topic.

Every function returns the matplotlib ``Figure`` it drew, so a notebook cell shows it and a test can inspect it.
"""

import matplotlib

matplotlib.rcParams.setdefault("figure.dpi", 100)
