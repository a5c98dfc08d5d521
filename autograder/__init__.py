"""The course's grader: nbgrader orchestration and the checks that hidden tests call.

Command line: ``python -m autograder --help``.
"""
