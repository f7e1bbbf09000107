"""Errors the whole library shares."""


class NotBuiltError(NotImplementedError):
    """A feature or argument zeropp does not implement yet; the message names it (and, where one exists, what to
    do instead). Never raised for bad input, which is a ``ConfigError``, ``ValueError`` or ``TypeError``."""
