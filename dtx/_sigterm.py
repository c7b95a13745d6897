"""SIGTERM noted from the ``dtx train`` / ``dtx launch`` command's first moment, before its imports.

Importing dtx takes seconds (jax, flax, orbax); a scheduler may preempt a job in that window, and
Python's default action would kill it with signal 15. When the process *is* the dtx command (not
your program importing dtx), :func:`install` sets a handler that only notes the signal; the run's
:class:`dtx.ckpt.preemption.PreemptionWatcher` (or the launcher) then takes the signal over and
asks :func:`take` whether one came before it did. Standard library only: it runs first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_COMMANDS = ("train", "launch")  # the commands that stop cleanly on SIGTERM
_PUBLISHING = ("export",)  # the commands whose work ends in one atomic act (:func:`publishing`)
_received = False


def _note(signum, frame) -> None:
    global _received
    _received = True


def _is_dtx_command(argv: list[str], commands: tuple[str, ...] = _COMMANDS) -> bool:
    """``dtx train ...`` (the console script) or ``python -m dtx.tools.cli train ...`` (``dtx launch``'s ranks);
    ``commands``: the command words that count (default: ``train`` and ``launch``)."""
    for i, word in enumerate(argv[:-1]):
        if (os.path.basename(word) == "dtx" or (word == "dtx.tools.cli" and argv[i - 1:i] == ["-m"])) and \
                argv[i + 1] in commands:
            return True
    return False


def install() -> bool:
    """Note SIGTERM from now on if this process is the dtx command and nothing else handles it yet."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if (not _is_dtx_command(argv) or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        return False
    signal.signal(signal.SIGTERM, _note)
    return True


def installed() -> bool:
    """Whether the early handler is SIGTERM's handler now."""
    return signal.getsignal(signal.SIGTERM) is _note


def take() -> bool:
    """Whether a SIGTERM came while the early handler was SIGTERM's handler (once: the note is cleared)."""
    global _received
    noted, _received = _received, False
    return noted


def hand_back(restore_default: bool = True) -> None:
    """Give SIGTERM its default action again (``restore_default``); a signal noted meanwhile is delivered
    now, to whatever handles it then: the default kills the process, as if it had never been caught.

    ``restore_default=False`` where something below Python took SIGTERM over since (JAX's preemption
    notifier in a multi-process job): setting a Python handler now would silently disable it.
    """
    if restore_default and installed() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if take():
        os.kill(os.getpid(), signal.SIGTERM)


def settle() -> None:
    """The command's work is done and said: a SIGTERM from now until the process ends has nothing to stop.

    Python restores a caught signal's default action as the interpreter shuts down (JAX's teardown takes
    a moment), and a SIGTERM then would turn a finished run's exit status 0 into signal 15. Ignored
    instead -- only where the early handler is SIGTERM's (the dtx command, not your program).
    """
    if installed() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def publishing():
    """The block publishes the command's finished work in one atomic act (``dtx export``'s rename of its
    folder into place); after it nothing is left that a SIGTERM could stop.

    A SIGTERM during the block is noted, not obeyed. Once the block completes, SIGTERM is ignored until the
    process ends: a signal on the way out (the printout, JAX's teardown) cannot turn the success into signal
    15, exit 143, and one noted during the block is dropped -- the work it would have stopped is out. If the
    block raises, SIGTERM has its default action back and a noted one is delivered (:func:`hand_back`).
    Before the block SIGTERM keeps its default action: a signal mid-work kills the command, which publishes
    nothing. Only where this process is such a dtx command (not your program calling
    :func:`dtx.run.evaluate.export_run`), in the main thread, and nothing else handles SIGTERM.
    """
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if (not _is_dtx_command(argv, _PUBLISHING) or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    signal.signal(signal.SIGTERM, _note)  # a Python handler: noted in any thread, acted on by none
    try:
        yield
    except BaseException:
        hand_back()
        raise
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    take()
