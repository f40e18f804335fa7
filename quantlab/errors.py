"""Errors that are the user's to fix: printed as one line, no traceback."""


class UserError(Exception):
    """Bad input (unknown name, missing file, unreachable store). The message is
    the whole explanation and should say what would have been valid."""
