"""Our error types. Anything a user can cause ends in one of these, with one readable line."""

from __future__ import annotations


class XrouteError(Exception):
    """Base of every error a user can cause; the CLI prints ``str(e)`` and exits non-zero."""


class BundleError(XrouteError):
    """A telemetry bundle is missing a table or holds a bad value.

    The message names the file, the (1-based data) row and the column where known.
    """

    def __init__(self, file: str, problem: str, row: int | None = None, column: str | None = None):
        self.file, self.problem, self.row, self.column = file, problem, row, column
        where = file
        if row is not None:
            where += f", row {row}"
        if column is not None:
            where += f", column '{column}'"
        super().__init__(f"bad telemetry bundle: {where}: {problem}")


class ConfigError(XrouteError):
    """A configuration file or option is invalid; the message names the field."""
