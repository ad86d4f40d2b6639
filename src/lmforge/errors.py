"""Errors a user can cause and fix (config, data, paths, hardware).

The CLI turns a :class:`UserError` into one line on stderr and exit status 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input; the message names the field or file and the fix."""


class ConfigError(UserError):
    """An invalid configuration key or value."""


class DataError(UserError):
    """Missing or unusable data files."""


class Interrupted(BaseException):
    """A second stop signal during training: exit at once (exit status 128 + the signal's number)."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.signal = sig
