"""The one exception the engine raises for problems a user can fix."""
from __future__ import annotations


class EbbError(Exception):
    """A problem the user can act on: `what` went wrong, and `fix` says what to do.

    The CLI prints it as one line on stderr and exits with code 2; the window shows it inline.
    """

    def __init__(self, what: str, fix: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}" if self.fix else self.what


class DeviceLost(EbbError):
    """A remote device went away. The session must be rebuilt on the devices that are left;
    nothing may be freed on the lost one (ggml would abort)."""


class TurnCancelled(Exception):
    """Stop was pressed before the reply started (during the images' encoding or a swap): the
    plan's cleanup steps have run, the model is back where it was. `stats`: the prompt's
    figures so far when it was stopped while read (an events.GenStats), else None."""

    stats: object = None


class DeviceOutOfMemory(EbbError):
    """An accelerator could not allocate a buffer (its server or driver is short of memory,
    whatever the budget said). The caller falls back to fewer layers or the CPU."""


_ALLOCATION_WORDS = ("unable to allocate", "failed to allocate", "out of memory",
                     "could not allocate")


def is_allocation_failure(exc: BaseException) -> bool:
    return isinstance(exc, DeviceOutOfMemory) or any(w in str(exc).lower() for w in _ALLOCATION_WORDS)
