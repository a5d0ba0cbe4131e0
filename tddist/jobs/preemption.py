"""Preemption signals of ``CheckpointManager``: which signals to handle, and their handlers.

A scheduler announces a preemption with a signal (``SIGUSR1`` by default,
``SIGTERM`` under some launchers). The handler only calls the manager's
``request_preemption`` (it sets a flag): nothing collective may run inside a
signal handler, so the ranks agree on the preemption at the next ``step()``.
This module parses the manager's ``preempt_signal`` argument, installs the
handlers and puts the previous ones back; it has no collectives.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from types import FrameType

    #: What ``signal.signal`` returns and accepts: a handler, SIG_DFL/SIG_IGN, or None.
    _Handler = Callable[[int, FrameType | None], Any] | int | None

logger = logging.getLogger(__name__)


def parse_signals(spec: Any) -> list[signal.Signals]:
    """Signals from a signal, a name ("USR1", "SIGTERM"), a comma-separated string, a list of these, or None."""
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = [s for s in spec.split(",") if s.strip()]
    items = [spec] if isinstance(spec, int) else list(spec)
    try:
        return [_signal(s) for s in items]
    except (AttributeError, TypeError, ValueError):
        raise InvalidArgumentError(f"preempt_signal={spec!r}: expected a signal, several, or None") from None


def _signal(item: str | int) -> signal.Signals:
    if isinstance(item, str):
        name = item.strip().upper()
        return getattr(signal.Signals, name if name.startswith("SIG") else "SIG" + name)
    return signal.Signals(item)


class PreemptionSignals:
    """The handlers of the preemption signals, installed until ``uninstall()``.

    Each handler calls ``request`` (the manager's ``request_preemption``,
    which only sets a flag). A signal that cannot be handled here (outside
    the main thread) is logged and skipped. Nothing here is collective.

    Args:
        signals: the signals to handle (see ``parse_signals``).
        request: called by the handler, with no arguments, on each signal.
    """

    def __init__(self, signals: Iterable[signal.Signals], request: Callable[[], None]) -> None:
        self._request = request
        self._previous: dict[signal.Signals, _Handler] = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                logger.warning("cannot handle %s outside the main thread; use request_preemption()", sig.name)

    def uninstall(self) -> None:
        """Put back the handlers that were there before (once; later calls do nothing)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._request()  # only a flag: the ranks agree at the next step()
