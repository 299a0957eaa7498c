"""The multi-rank launcher's failure reports: a rank that dies shows its standard error in the test
failure, and only a death by a signal (not a Python error) gets the one retry."""

import signal

import pytest

from .cp_worker import launch


def test_a_rank_killed_by_a_signal_is_retried_once_then_fails_with_its_stack(tmp_path):
    with pytest.warns(UserWarning, match="retrying the spawn once") as warned:
        with pytest.raises(RuntimeError, match="the second spawn") as failed:
            launch({"crash": dict(how="abort", on_rank=1)}, 2, "cpu", tmp_path)
    assert len([w for w in warned if "retrying" in str(w.message)]) == 1
    message = str(failed.value)
    assert "rank 1 about to abort" in message and f"-{int(signal.SIGABRT)}" in message  # its exit code
    assert "Fatal Python error: Aborted" in message  # faulthandler's stack, written before the abort
    assert "in crash" in message  # the scenario's frame is in the dead rank's stack


def test_a_rank_that_raises_fails_at_once_with_its_traceback(tmp_path, recwarn):
    with pytest.raises(RuntimeError) as failed:
        launch({"crash": dict(how="raise", on_rank=0)}, 2, "cpu", tmp_path)
    # whichever rank spawn reports first, the raising rank's own traceback is in the message
    assert "rank 0 about to raise" in str(failed.value) and "ValueError: rank 0 raised on purpose" in str(failed.value)
    assert not [w for w in recwarn if "retrying" in str(w.message)]  # a Python error is not retried
