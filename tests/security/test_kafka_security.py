"""SITS's Kafka clients over TLS (and mutual TLS) against a real TLS endpoint, and SASL against a real broker.

Tansu 0.6's own TLS cannot be used: `--cert` and `--key` share a clap group, so they
cannot be given together, and the broker builds a TLS acceptor it never uses (the
connection is served as plain Kafka: a TLS ClientHello reads as a ~369 MB frame length,
so the client hangs). The real Envoy terminates TLS in front of it instead, and Tansu
advertises Envoy's port, so the clients' reconnections go through TLS too.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaError

from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent, ensure_topics
from sits.runtime.events import Topics, new_meta
from sits.runtime.kafka_security import KafkaSecurityError, kafka_client_options
from sits.runtime.settings import Settings, SettingsError, load_settings
from sits.runtime.tap import TopicTap
from sits.v1 import common_pb2, events_pb2
from sits_app.stack.tansu import TansuBroker
from tests.security.conftest import Certs, TlsKafka
from tests.waiting import eventually

TARGET = common_pb2.Target(host="tls-host", gpu_uuid="GPU-tls", engine="vllm-tls")


def sample(fraction: float) -> events_pb2.MetricSample:
    message = events_pb2.MetricSample(meta=new_meta("test", TARGET, time.time()))
    message.gpu.total_bytes = 100
    message.gpu.used_bytes = int(100 * fraction)
    return message


async def round_trip(settings: Settings) -> list[float]:
    """Create the topics, publish two samples and read them back through a consumer group and the tap."""
    topics = Topics(settings.topic_prefix)
    await asyncio.wait_for(ensure_topics(settings), 30)
    received: list[float] = []
    tapped: list[float] = []

    async def handle(event: ReceivedEvent) -> None:
        assert isinstance(event.message, events_pb2.MetricSample)
        received.append(event.message.gpu.used_bytes / 100)

    def on_tap(_topic: str, message: Any) -> None:
        tapped.append(message.gpu.used_bytes / 100)

    async with EventProducer(settings) as producer, TopicTap(settings, [topics.metrics], on_tap, from_beginning=True):
        consumer = EventConsumer(
            settings, group_id=f"{settings.topic_prefix}g", topics=[topics.metrics], handler=handle,
            dead_letters=producer, coalesce=False,
        )  # fmt: skip
        stop = asyncio.Event()
        running = asyncio.create_task(consumer.run(stop))
        try:
            await producer.publish(topics.metrics, sample(0.25))
            await producer.publish(topics.metrics, sample(0.5))
            assert await eventually(lambda: len(received) >= 2 and len(tapped) >= 2, 30), (received, tapped)
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
            await consumer.stop()
    assert sorted(received) == sorted(tapped) == [0.25, 0.5]
    return received


async def refused(settings: Settings, timeout_s: float = 20.0) -> float:
    """Seconds until a producer's start failed; fails the test if it connected."""
    producer = EventProducer(settings)
    started = time.monotonic()
    try:
        with pytest.raises((KafkaError, OSError, TimeoutError, KeyError)):
            await asyncio.wait_for(producer.start(), timeout_s)
    finally:
        await producer.stop()
    return time.monotonic() - started


def tls_settings(kafka: TlsKafka, topic_prefix: str, **security: Any) -> Settings:
    return load_settings(
        Settings, kafka_bootstrap=kafka.bootstrap, topic_prefix=topic_prefix, kafka_partitions=1,
        kafka_request_timeout_ms=3000, **security,
    )  # fmt: skip


async def test_a_tls_client_produces_and_consumes_through_the_tls_endpoint(
    tls_kafka: TlsKafka, certs: Certs, topic_prefix: str
) -> None:
    settings = tls_settings(tls_kafka, topic_prefix, kafka_security_protocol="SSL", kafka_ssl_ca_file=certs.ca)
    assert await round_trip(settings)


async def test_a_plaintext_client_and_a_client_trusting_another_ca_are_refused(
    tls_kafka: TlsKafka, certs: Certs, topic_prefix: str
) -> None:
    await refused(tls_settings(tls_kafka, topic_prefix))  # PLAINTEXT
    await refused(
        tls_settings(tls_kafka, topic_prefix, kafka_security_protocol="SSL", kafka_ssl_ca_file=certs.rogue_ca)
    )
    with pytest.raises((KafkaError, OSError, TimeoutError)):
        await asyncio.wait_for(ensure_topics(tls_settings(tls_kafka, topic_prefix)), 20)


async def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(
    mtls_kafka: TlsKafka, certs: Certs, topic_prefix: str
) -> None:
    base = {"kafka_security_protocol": "SSL", "kafka_ssl_ca_file": certs.ca}
    await refused(tls_settings(mtls_kafka, topic_prefix, **base))
    await refused(
        tls_settings(
            mtls_kafka, topic_prefix, **base,
            kafka_ssl_cert_file=certs.rogue_client_cert, kafka_ssl_key_file=certs.rogue_client_key,
        )
    )  # fmt: skip
    settings = tls_settings(
        mtls_kafka, topic_prefix, **base, kafka_ssl_cert_file=certs.client_cert, kafka_ssl_key_file=certs.client_key
    )
    assert await round_trip(settings)


async def test_sasl_is_spoken_to_a_broker_that_requires_it_and_plaintext_is_refused(
    tmp_path: Path, topic_prefix: str
) -> None:
    """Tansu 0.6 with --authentication offers SCRAM only, with users kept in its storage; in memory
    storage no user can exist before authentication is required, so no login can succeed here. What
    is shown: SITS's clients run the SCRAM exchange (and fail it: no such user), and a client
    without SASL is refused."""
    password = tmp_path / "kafka-password"
    password.write_text("s3cret-kafka-password\n")
    broker = TansuBroker(tmp_path / "tansu", authentication=True)
    broker.start()
    try:
        base = {"kafka_bootstrap": broker.bootstrap, "topic_prefix": topic_prefix, "kafka_request_timeout_ms": 3000}
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            settings = load_settings(
                Settings, **base, kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism=mechanism,
                kafka_sasl_username="sits", kafka_sasl_password_file=password,
            )  # fmt: skip
            options = kafka_client_options(settings)
            assert (options["sasl_mechanism"], options["sasl_plain_password"]) == (mechanism, "s3cret-kafka-password")
            await refused(settings)
        await refused(load_settings(Settings, **base))
        log = (tmp_path / "tansu" / "tansu.log").read_text()
        assert "NotAuthenticated" in log, "the broker refused the client that did not authenticate"
        assert "s3cret-kafka-password" not in log
    finally:
        broker.stop()


def test_security_settings_that_cannot_work_stop_the_process_at_start(certs: Certs, tmp_path: Path) -> None:
    cases = {
        "SITS_KAFKA_SSL_* files are set but": {"kafka_ssl_ca_file": certs.ca},
        "go together": {"kafka_security_protocol": "SSL", "kafka_ssl_cert_file": certs.client_cert},
        "needs SITS_KAFKA_SASL_USERNAME": {"kafka_security_protocol": "SASL_SSL"},
        "SITS_GRPC_TLS_REQUIRE_CLIENT_CERT needs": {"grpc_tls_require_client_cert": True},
    }
    for message, values in cases.items():
        with pytest.raises(SettingsError, match=re.escape(message)):
            load_settings(Settings, **values)
    missing = load_settings(Settings, kafka_security_protocol="SSL", kafka_ssl_ca_file=tmp_path / "nope.crt")
    with pytest.raises(KafkaSecurityError, match="SITS_KAFKA_SSL_CA_FILE"):
        kafka_client_options(missing)
