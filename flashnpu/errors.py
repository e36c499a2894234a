"""Errors shared by every layer of flashnpu.

``UsageError`` is raised by the sub-commands (and the code they drive) for
bad input from the user; the ``flashnpu`` entry point prints it as one line
on stderr and exits with status 2.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""
