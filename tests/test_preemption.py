"""dtx.ckpt.preemption: SIGTERM inside the watcher is a request to stop at the next step boundary, not a death;
leaving the watcher puts the previous handler back; a disabled watcher never asks to stop."""
import os
import signal

from dtx.ckpt.preemption import PreemptionWatcher


def test_sigterm_becomes_a_stop_request_and_the_old_handler_returns():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher(multi_process=False) as watcher:
        assert not watcher.requested(3)
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the handler only sets a flag
        assert watcher.requested(4)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_disabled_watcher_installs_nothing_and_never_stops():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher(enabled=False, multi_process=False) as watcher:
        assert signal.getsignal(signal.SIGTERM) is before
        assert not watcher.requested(1)
