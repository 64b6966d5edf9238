"""Exceptions raised by dflashkit: every user-facing failure is one of these, with a message that says
what is wrong and how to fix it."""


class DFlashError(Exception):
    """Base class of dflashkit's errors."""


class InvalidInputError(DFlashError, ValueError):
    """A request that cannot be served as given: empty prompt, bad sampling parameters, too-long context."""


class IncompatibleDrafterError(DFlashError):
    """A drafter that does not fit the target it is used with (hidden size, vocabulary, layers, fingerprint)."""


class CheckpointError(DFlashError):
    """A drafter checkpoint that is missing, malformed or of an unsupported kind."""


class DataError(DFlashError, RuntimeError):
    """A data source that is missing or unusable, or an output folder that cannot be resumed as asked."""
