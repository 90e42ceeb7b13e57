"""The demo's load from processes of its own: P0 from one, the lower tiers from another.

A client's time to first token is its own event loop's too. In the demo's process that loop also draws
the live view and reads the topics, and at 3x load it sent a quarter of the arrivals asked for (a demo of
2026-12-07, before `LoadDriver` kept its own clock); every delay it has lands in the times it measures.
Each child runs a `LoadDriver`
on its share of the arrivals (Poisson streams split by tier add up to the same load) and writes one JSON
line per finished request and a status line twice a second; the parent turns them back into outcomes.
P0 gets a process to itself, as `bench/overload.py` measures it, so the lower tiers' streams do not
delay the clock that times it. `time.monotonic()` is one clock for every process on the host, so the
outcomes' times need no translation.

Run as `python -m sits_app.demo.load_processes PLAN_JSON` (the parent does this).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sits_app.demo.load import LoadDriver, LoadShape, RequestOutcome, ramp, rate_between

# Which tiers each child sends; every tier of the mix must be in one.
GROUPS: tuple[tuple[str, ...], ...] = (("P0",), ("P1", "P2"))
STATUS_EVERY_S = 0.5


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """One phase's load, as `cli.py` shapes it: base rate, a ramp to the peak, held to the end."""

    address: str
    seconds: float
    base_rps: float
    peak_factor: float
    ramp_s: float
    mix: dict[str, float]
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]
    max_in_flight: int = 96
    api: str = "grpc"
    model: str = ""
    seed: int = 7

    def rate(self) -> Callable[[float], float]:
        return ramp(self.base_rps, self.peak_factor, self.ramp_s, self.seconds)

    def share(self, tiers: tuple[str, ...], seed: int) -> LoadPlan:
        """The part of this plan that sends only `tiers`: their share of the rate and of the in-flight cap."""
        part = sum(self.mix.get(t, 0.0) for t in tiers) / sum(self.mix.values())
        return dataclasses.replace(
            self,
            base_rps=self.base_rps * part,
            mix={t: w for t, w in self.mix.items() if t in tiers},
            max_in_flight=max(4, round(self.max_in_flight * part)),
            seed=seed,
        )


class LoadProcesses:
    """A `LoadDriver`'s face (in flight, sent, `on_outcome`, `run`) over one child process per tier group."""

    def __init__(
        self, plan: LoadPlan, groups: tuple[tuple[str, ...], ...] = GROUPS, log_path: Path | None = None
    ) -> None:
        # The children's standard error goes here (the terminal belongs to the live view); None: inherited.
        self._log_path = log_path
        present = [g for g in groups if any(t in plan.mix for t in g)]
        self._plans = [plan.share(g, plan.seed + i) for i, g in enumerate(present)]
        self.on_outcome: Callable[[RequestOutcome], None] | None = None
        self._in_flight = [0] * len(self._plans)
        self._sent_at: list[list[float]] = [[] for _ in self._plans]
        self.refused_locally = 0
        self.behind = 0

    @property
    def in_flight(self) -> int:
        return sum(self._in_flight)

    @property
    def sent(self) -> int:
        return sum(len(s) for s in self._sent_at)

    def sent_rate(self, start_s: float, end_s: float) -> float:
        """Arrivals sent per second that were due between `start_s` and `end_s` into the phase."""
        return rate_between(self._sent_at, start_s, end_s)

    async def run(self, seconds: float, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        with contextlib.ExitStack() as files:
            log = files.enter_context(self._log_path.open("ab")) if self._log_path is not None else None
            children = [
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "sits_app.demo.load_processes",
                    json.dumps(dataclasses.asdict(dataclasses.replace(plan, seconds=seconds))),
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    start_new_session=True,
                )
                for plan in self._plans
            ]
        readers: list[asyncio.Future[None]] = [
            asyncio.ensure_future(self._read(i, child)) for i, child in enumerate(children)
        ]
        stopped = asyncio.ensure_future(stop.wait())
        try:
            either: list[asyncio.Future[Any]] = [stopped, asyncio.gather(*readers)]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            for child in children:
                if child.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.terminate()
            for reader in readers:
                reader.cancel()
            for child in children:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(child.wait(), 10)
        failed = [c.returncode for c in children if c.returncode not in (0, -15)]
        if failed and not stop.is_set():
            where = f"; its log: {self._log_path}" if self._log_path is not None else ""
            raise RuntimeError(f"a load process exited with {failed}{where}")

    async def _read(self, index: int, child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        while line := await child.stdout.readline():
            message: dict[str, Any] = json.loads(line)
            if "outcome" in message:
                if self.on_outcome is not None:
                    self.on_outcome(RequestOutcome(**message["outcome"]))
                continue
            self._in_flight[index] = message["in_flight"]
            self._sent_at[index].extend(message["sent_at"])
            if message.get("done"):
                self.refused_locally += message["refused_locally"]
                self.behind += message["behind"]
        await child.wait()


async def _drive(plan: LoadPlan) -> None:
    def emit(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    shape = LoadShape(rate=plan.rate(), mix=plan.mix, prompt_tokens=plan.prompt_tokens, max_tokens=plan.max_tokens)
    driver = LoadDriver(
        plan.address, shape, max_in_flight=plan.max_in_flight, seed=plan.seed, api=plan.api, model=plan.model
    )
    driver.on_outcome = lambda outcome: emit({"outcome": dataclasses.asdict(outcome)})
    reported = 0

    def status(done: bool = False) -> None:
        nonlocal reported
        sent_at, reported = driver.sent_at[reported:], len(driver.sent_at)
        extra = {"done": True, "refused_locally": driver.refused_locally, "behind": driver.behind} if done else {}
        emit({"in_flight": driver.in_flight, "sent_at": [round(t, 4) for t in sent_at], **extra})

    async def report() -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            status()

    reporter = asyncio.ensure_future(report())
    try:
        await driver.run(plan.seconds)
    finally:
        reporter.cancel()
    status(done=True)


def main(argv: list[str]) -> None:
    fields = json.loads(argv[0])
    fields["prompt_tokens"] = tuple(fields["prompt_tokens"])
    fields["max_tokens"] = tuple(fields["max_tokens"])
    asyncio.run(_drive(LoadPlan(**fields)))


if __name__ == "__main__":
    main(sys.argv[1:])
