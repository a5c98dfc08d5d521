"""nbgrader reads this file when it runs from the repository root: JupyterLab's Validate button (started by
``./course lab``) and ``nbgrader`` commands typed here. The settings are the course's own
(``autograder/nbgrader_config.py``): the layout, and cells allowed three minutes each instead of nbgrader's 30 s;
and Validate's dialog opens with the course's checklist (``labsupport.visible.checklist_first``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autograder.nbgrader_config import make_config  # noqa: E402
from labsupport.visible import checklist_first  # noqa: E402

c = get_config()  # noqa: F821 (provided by traitlets when it runs this file)
c.merge(make_config(os.path.dirname(os.path.abspath(__file__))))
# Validate's dialog opens with the course's checklist, not with the source of the hidden-test cell that raised it
# (labsupport/visible.py); it acts only under Validate
c.Execute.on_cell_error = checklist_first
