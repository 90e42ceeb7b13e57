"""SITS_ENGINE_QUEUE_POLL_S: on vLLM's own shared-memory queue condition, and in the stack's CPU engine."""

from __future__ import annotations

import time

import pytest
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from sits_app.stack.vllm_engine import VllmServer
from sits_engine.vllm_plugin.queue_wait import install, poll_seconds


def test_the_setting_is_read_strictly() -> None:
    assert poll_seconds({}) == 0.0
    assert poll_seconds({"SITS_ENGINE_QUEUE_POLL_S": " "}) == 0.0
    assert poll_seconds({"SITS_ENGINE_QUEUE_POLL_S": "0.0005"}) == 0.0005
    for bad in ("fast", "-1", "nan", "1"):
        with pytest.raises(ValueError, match="SITS_ENGINE_QUEUE_POLL_S"):
            poll_seconds({"SITS_ENGINE_QUEUE_POLL_S": bad})


def cpu_and_wall_s(reader: SpinCondition, calls: int) -> tuple[float, float]:
    """The CPU time and wall time `calls` waits of a reader that has just read take."""
    reader.record_read()
    cpu, wall = time.process_time(), time.monotonic()
    for _ in range(calls):
        reader.wait(timeout_ms=1_000)
    return time.process_time() - cpu, time.monotonic() - wall


def test_a_busy_reader_sleeps_between_checks_and_an_idle_one_still_waits_for_the_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)  # put vLLM's back after the test
    context = zmq.Context()
    address = "inproc://sits-queue-wait-test"
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    # Made before the setting is installed, as the queues a worker opens before vLLM loads its plugins.
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        install(0.002, SpinCondition)
        install(0.002, SpinCondition)  # a second load of the plugin wraps vLLM's wait, not its own wrapper
        assert not hasattr(SpinCondition.wait.__wrapped__, "__wrapped__")
        # Now each check sleeps 2 ms: the wall time is at least 200 x 2 ms, the CPU time a fraction of it.
        cpu, wall = cpu_and_wall_s(reader, 200)
        assert wall >= 0.4
        assert cpu < wall / 2
        # A reader idle for longer than vLLM's busy window waits on the notify socket as before, and a
        # write's notification wakes it.
        reader.last_read = time.monotonic() - 10 * reader.busy_loop_s
        writer.notify()
        started = time.monotonic()
        reader.wait(timeout_ms=5_000)
        assert time.monotonic() - started < 4.0
    finally:
        for socket in (writer.local_notify_socket, reader.local_notify_socket):
            socket.close(linger=0)
        for socket in (reader.read_cancel_socket, reader.write_cancel_socket):
            socket.close(linger=0)
        context.term()


@pytest.mark.vllm
async def test_the_stack_s_cpu_engine_sleeps_between_checks_in_its_engine_core_and_worker(
    vllm_engine: VllmServer,
) -> None:
    # vLLM loads its general plugins in each process it starts; the EngineCore and the worker read the queues.
    lines = [line for line in vllm_engine.log_path.read_text().splitlines() if "SITS: busy engine queue" in line]
    assert any("EngineCore" in line for line in lines), lines
    assert any("Worker" in line for line in lines), lines
    assert all("0.1 ms" in line for line in lines), lines
