"""nbgrader reads this file when it runs from the repository root: JupyterLab's Validate button (started by
``./course lab``) and ``nbgrader`` commands typed here. The settings are the course's own
(``autograder/nbgrader_config.py``): the layout, and cells allowed three minutes each instead of nbgrader's 30 s.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autograder.nbgrader_config import make_config  # noqa: E402

c = get_config()  # noqa: F821 (provided by traitlets when it runs this file)
c.merge(make_config(os.path.dirname(os.path.abspath(__file__))))
