"""Checks called by the hidden tests, one module per notebook.

Every check runs the student's object on real ``torch.distributed`` workers with inputs drawn at grading time and
raises ``AssertionError`` with a message the student can act on.
"""
