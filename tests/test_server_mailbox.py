"""The mailbox that carries the engine's events onto the IOLoop: every call delivered, in order, one wake-up
for all posted before the loop gets to them."""
import asyncio
import threading

import pytest

from tornado.ioloop import IOLoop

from tornchat.server.mailbox import Mailbox


def test_calls_posted_while_the_loop_is_busy_arrive_in_order_in_one_wake_up():
    async def main():
        loop = IOLoop.current()
        wake_ups = []

        class Counted:  # the loop, counting the wake-ups asked of it
            def add_callback(self, fn, *args):
                wake_ups.append(fn)
                loop.add_callback(fn, *args)

        mailbox = Mailbox(Counted())
        got = []
        for batch in range(2):
            posted = threading.Event()

            def worker(batch=batch, posted=posted):
                for i in range(100):
                    mailbox.post(got.append, (batch, i))
                posted.set()

            thread = threading.Thread(target=worker)
            thread.start()
            posted.wait()  # the loop's thread blocked until the worker has posted all 100
            thread.join()
            await asyncio.sleep(0.05)  # the loop runs the delivery
            assert got == [(b, i) for b in range(batch + 1) for i in range(100)]
            assert len(wake_ups) == batch + 1  # one per batch: the second found the first delivered

    asyncio.run(main())


def test_a_call_that_fails_is_logged_and_the_calls_after_it_still_arrive(caplog):
    async def main():
        mailbox = Mailbox(IOLoop.current())
        got = []
        mailbox.post(got.append, 1)
        mailbox.post(lambda: 1 / 0)
        mailbox.post(got.append, 2)
        await asyncio.sleep(0.05)
        return got

    assert asyncio.run(main()) == [1, 2]
    assert "delivery failed" in caplog.text


def test_on_a_real_loop_the_doorbell_carries_calls_posted_while_the_loop_is_busy_in_one_delivery():
    """Where the OS has eventfd, the worker rings the mailbox's own doorbell (keeping the GIL) rather than
    add_callback: the calls still arrive in order, one delivery for all posted before the loop gets to them,
    and a call posted during a delivery rings again."""
    async def main():
        loop = IOLoop.current()
        mailbox = Mailbox(loop)
        if mailbox.doorbell is None:
            pytest.skip("no eventfd here: the mailbox wakes the loop with add_callback")
        deliveries = []
        deliver = mailbox._deliver

        def counted():
            deliveries.append(len(mailbox.calls))
            deliver()

        mailbox.doorbell.answer = counted
        got = []
        posted = threading.Event()

        def worker():
            for i in range(100):
                mailbox.post(got.append, i)
            posted.set()

        thread = threading.Thread(target=worker)
        thread.start()
        posted.wait()  # the loop's thread blocked until the worker has posted all 100
        thread.join()
        await asyncio.sleep(0.05)
        assert got == list(range(100)) and deliveries == [100]
        mailbox.post(lambda: mailbox.post(got.append, "again"))  # posted from within a delivery
        await asyncio.sleep(0.05)
        assert got[-1] == "again" and len(deliveries) == 3

    asyncio.run(main())
