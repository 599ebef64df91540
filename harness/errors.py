"""Errors that mean the evaluator itself cannot run (never the candidate's fault). Light to import."""


class HarnessError(Exception):
    """The evaluator cannot run as configured; the message is one line for the user."""
