"""User-facing errors.

A `UserError` is a mistake the user can fix (bad flag, bad file, bad value). The CLI prints its message as one
line and exits with code 2, without a traceback. Messages name the flag, file, line or field and say what to do.
"""


class UserError(Exception):
    """A mistake in the user's input; printed without traceback, exit code 2."""


class ConfigError(UserError):
    """A bad flag, flag combination or config file."""


class DataError(UserError):
    """A bad data file: missing, malformed line, missing key."""


class NotAvailableYet(ConfigError):
    """A valid flag or value whose feature is not built yet."""
