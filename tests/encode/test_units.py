"""WriteBehind: a finished unit's write runs behind the next unit's encode, in order, one at a time, and neither
an error nor an interrupt loses a write."""

from __future__ import annotations

import errno
import functools
import threading

import pytest

from glmquant.encode.units import WriteBehind


def test_writes_run_in_order_behind_the_caller() -> None:
    written: list[int] = []
    caller_went_on = threading.Event()

    def write(i: int) -> None:
        if i == 0 and not caller_went_on.wait(timeout=30):  # a synchronous submit would never get here in time
            raise AssertionError("submit waited for the write instead of returning")
        written.append(i)

    with WriteBehind() as writer:
        writer.submit(lambda: write(0))
        caller_went_on.set()  # the caller runs on (the next unit's encode) while write 0 is still waiting
        for i in range(1, 5):
            writer.submit(functools.partial(write, i))
    assert written == [0, 1, 2, 3, 4]


def test_a_failed_write_is_raised_by_the_next_submit_and_stops_the_writes() -> None:
    written: list[int] = []

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "layer-003-unit-000.safetensors")

    with pytest.raises(OSError, match="No space left") as caught, WriteBehind() as writer:
        writer.submit(full_disk)
        writer.submit(lambda: written.append(1))
    assert caught.value.errno == errno.ENOSPC
    assert written == []


def test_the_last_write_failing_is_raised_at_exit() -> None:
    with pytest.raises(OSError, match="read-only"), WriteBehind() as writer:
        writer.submit(lambda: (_ for _ in ()).throw(OSError(errno.EROFS, "read-only file system")))


def test_an_interrupt_lets_the_write_in_flight_finish_and_says_so() -> None:
    """Ctrl-C in the encode (the main thread) leaves the unit already encoded on disk for the resumed job: the write
    is still blocked when the interrupt arrives and is released only afterwards."""
    release = threading.Event()
    finished: list[str] = []
    said: list[str] = []

    def slow_write() -> None:
        release.wait(timeout=30)
        finished.append("unit 0")

    with pytest.raises(KeyboardInterrupt), WriteBehind(said.append) as writer:
        writer.submit(slow_write)
        threading.Timer(0.2, release.set).start()  # after the interrupt below
        raise KeyboardInterrupt
    assert finished == ["unit 0"]
    assert said and "finishing the unit file" in said[0]


def test_an_error_already_raised_stays_the_one_raised() -> None:
    """A NumericalError in the encode while the write in flight fails too: the encode's error is raised, with the
    write's failure noted on it."""

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ArithmeticError) as caught, WriteBehind() as writer:
        writer.submit(full_disk)
        raise ArithmeticError("layer 3: weight is not finite")
    assert any("No space left" in note for note in caught.value.__notes__)
