"""One worker's envelopes in the order recorded (router/service/hint_send.py
``PublishOrder``): an envelope that gives up waiting (the link went down while the one
before it was still publishing) lets no later one overtake that one; and a worker with
nothing in flight has no entry."""

from __future__ import annotations

import asyncio

from kvhint.router.service.hint_send import PublishOrder


async def test_one_given_up_lets_no_later_one_overtake_the_one_before_it() -> None:
    order = PublishOrder()
    publishing, given_up, later = (order.take("w0") for _ in range(3))
    assert await order.turn(publishing, lambda: True)
    # The link is down: the second gives up at once, though the first still publishes.
    assert not await asyncio.wait_for(order.turn(given_up, lambda: False), 1)
    order.leave(given_up)
    waiting = asyncio.create_task(order.turn(later, lambda: True))  # the link is back
    await asyncio.sleep(0.3)
    assert not waiting.done()  # the first is still publishing
    order.leave(publishing)
    assert await asyncio.wait_for(waiting, 1)
    order.leave(later)
    assert not order._last  # nothing in flight, nothing kept (forgotten workers too)


async def test_each_worker_has_its_own_order() -> None:
    order = PublishOrder()
    first = order.take("w0")
    other = order.take("w1")
    assert await asyncio.wait_for(order.turn(other, lambda: True), 1)
    order.leave(other)
    order.leave(first)
    assert not order._last
