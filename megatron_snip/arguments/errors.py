"""The one exception of the command line's edge."""


class ArgumentError(ValueError):
    """A bad command-line value; the message names the flag (or file) and what would be right."""


def require(cond: bool, message: str) -> None:
    """Raise :class:`ArgumentError` with ``message`` unless ``cond``."""
    if not cond:
        raise ArgumentError(message)
