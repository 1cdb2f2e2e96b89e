"""The one exception of the command line's edge, and the collection of every problem of a command line.

Validation runs in steps (:class:`Problems`): inside a step a failed :func:`require` records its message
and validation goes on, so one launch reports every problem of the flags at once. A step stops at the
first problem only where the values after it would be meaningless (an exception a recorded problem
caused ends the step quietly).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_collecting: ContextVar[list[str] | None] = ContextVar("_collecting", default=None)


class HostProblem(str):
    """A problem's message that depends on the host the rank runs on (what its filesystem lets it do), not on
    the flags alone: rank 0 cannot speak for it, so the first rank of each host reports its own."""


class ArgumentError(ValueError):
    """Bad command-line values; each message names the flag (or file) and what would be right.
    ``problems``: the messages, one per problem (``str()`` joins them, one per line)."""

    def __init__(self, *problems: str):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def require(cond: bool, message: str) -> None:
    """Record ``message`` as a problem unless ``cond``: in a :meth:`Problems.step`, validation goes on;
    elsewhere :class:`ArgumentError` is raised."""
    if cond:
        return
    found = _collecting.get()
    if found is None:
        raise ArgumentError(message)
    found.append(message)


class Problems:
    """Every problem found by the validation steps run through it, in order, each once."""

    def __init__(self):
        self.found: list[str] = []

    @contextmanager
    def step(self) -> Iterator[list[str]]:
        """Run a validation step: failed :func:`require` calls and a raised :class:`ArgumentError` are
        recorded; any other exception once a problem is recorded (here or in an earlier step) is taken
        for its consequence (a value left unset or invalid) and ends the step quietly. Yields the step's
        own problems (empty afterwards: the step passed)."""
        own: list[str] = []
        token = _collecting.set(own)
        try:
            yield own
        except ArgumentError as e:
            own.extend(e.problems)
        except Exception:
            if not (own or self.found):
                raise
        finally:
            _collecting.reset(token)
            self.found.extend(m for m in own if m not in self.found)

    def raise_if_any(self) -> None:
        if self.found:
            raise ArgumentError(*self.found)
