"""The Execute sender (sender.py): order per worker, no worker waits behind another, failures strand nothing."""

from __future__ import annotations

import threading

from dtorch_controller.sender import Sender


def test_each_address_gets_its_batches_in_order_while_a_stuck_one_holds_nobody_else():
    sender = Sender(threads=4)
    got: dict[str, list[int]] = {"a": [], "b": []}
    stuck, released = threading.Event(), threading.Event()
    done = threading.Semaphore(0)

    def deliver(address: str, n: int):  # noqa: ANN202
        def run() -> None:
            if address == "a" and n == 0:
                stuck.set()
                assert released.wait(10.0)  # a worker that does not answer yet
            if address == "b" and n == 2:
                raise ConnectionError("refused")  # logged; the next one still goes
            got[address].append(n)
            done.release()
        return run

    try:
        for n in range(5):
            sender.send("a", deliver("a", n))
            sender.send("b", deliver("b", n))
        assert stuck.wait(10.0)
        for _ in range(4):  # b's four that succeed, while a's first is stuck
            assert done.acquire(timeout=10.0)
        assert got == {"a": [], "b": [0, 1, 3, 4]}
        released.set()
        for _ in range(5):
            assert done.acquire(timeout=10.0)
        assert got["a"] == [0, 1, 2, 3, 4]
    finally:
        released.set()
        sender.close()


def test_nothing_goes_out_after_close():
    sender = Sender(threads=1)
    sent: list[int] = []
    sender.close()
    sender.send("a", lambda: sent.append(1))
    assert sent == []
