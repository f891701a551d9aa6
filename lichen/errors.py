"""User-facing errors.

A `UserError` is a mistake the user can fix (bad flag, bad file, bad value). The CLI prints its message as one
line and exits with code 2, without a traceback. Messages name the flag, file, line or field and say what to do.

A `RunError` stops a run that started correctly because something it depends on failed (an engine that serves
other weights than trained, a verifier that fails every sample). The CLI prints it as one line too, with exit
code 1: its message is the whole diagnosis, a traceback of lichen's own frames would add nothing.
"""


class UserError(Exception):
    """A mistake in the user's input; printed without traceback, exit code 2."""


class ConfigError(UserError):
    """A bad flag, flag combination or config file."""


class DataError(UserError):
    """A bad data file: missing, malformed line, missing key."""


class NotAvailableYet(ConfigError):
    """A valid flag or value whose feature is not built yet."""


class RunError(Exception):
    """A run cannot go on (engine, sync or verifier failure); printed as one line without traceback, exit code 1."""


class PromptTooLong(DataError):
    """A prompt (as text, after the chat template) longer than --max-prompt-chars: dropped without tokenizing."""

    def __init__(self, chars: int, limit: int) -> None:
        super().__init__(f"the prompt renders to {chars} characters, over --max-prompt-chars {limit}")
        self.chars = chars
        self.limit = limit
