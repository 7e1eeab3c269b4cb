"""s3kv.testing.virtual_loop: an event loop whose time jumps to its next
timer, so the fleet model's hours of virtual time take no real time, and a
latency modelled with asyncio.sleep delays only the coroutine that waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from s3kv.testing.virtual_loop import VirtualTimeLoop, inline, run


def test_sleeping_an_hour_takes_no_real_time():
    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(3600)
        return loop.time() - t0

    wall = time.perf_counter()
    assert run(main()) == pytest.approx(3600)
    assert time.perf_counter() - wall < 5  # a real sleep would take the hour


def test_timers_fire_in_order_at_their_times():
    fired: list[tuple[str, float]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for name, at in [("c", 30.0), ("a", 0.5), ("b", 7.25), ("d", 30.0)]:
            loop.call_at(at, lambda n=name: fired.append((n, loop.time())))
        await asyncio.sleep(31)

    run(main())
    assert fired == [("a", 0.5), ("b", 7.25), ("c", 30.0), ("d", 30.0)]


def test_ready_work_does_not_move_time():
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(1000):
            await asyncio.sleep(0)
        return t0, loop.time()

    t0, t1 = run(main(), start=100.0)
    assert t0 == t1 == 100.0


def test_a_modelled_latency_delays_only_its_own_coroutine():
    done: dict[str, float] = {}

    async def request(name: str, latency: float) -> None:
        await asyncio.sleep(latency)  # the request's round trip
        done[name] = asyncio.get_running_loop().time()

    async def main() -> None:
        await asyncio.gather(request("slow", 0.040), request("fast", 0.025), request("slower", 0.450))

    run(main())
    assert done == {
        "fast": pytest.approx(0.025),
        "slow": pytest.approx(0.040),
        "slower": pytest.approx(0.450),
    }
    assert list(done) == ["fast", "slow", "slower"]


def test_wait_for_times_out_in_virtual_time():
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100), timeout=2.5)
        return loop.time()

    assert run(main()) == pytest.approx(2.5)


def test_inline_offload_runs_on_the_loop():
    async def main() -> int:
        return await inline(sum, [1, 2, 3])

    assert run(main()) == 6


def test_a_thread_still_wakes_a_loop_with_no_timers():
    # Nothing scheduled: the loop waits on the real selector, as any loop does.
    async def main() -> int:
        return await asyncio.to_thread(lambda: 42)

    assert run(main()) == 42


def test_time_never_moves_back():
    loop = VirtualTimeLoop(5.0)
    try:
        loop.advance(-3)
        assert loop.time() == 5.0
        loop.advance(2)
        assert loop.time() == 7.0
    finally:
        loop.close()


def test_run_cancels_what_main_left_running():
    cancelled = []

    async def forever() -> None:
        try:
            await asyncio.sleep(1e9)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        asyncio.get_running_loop().create_task(forever())
        await asyncio.sleep(1)

    run(main())
    assert cancelled == [True]
