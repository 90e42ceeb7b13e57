"""`sits mesh ...`: render Envoy / Istio configs from the mesh policy, serve the admission processor.

The lead wires `configure_parser` / `run` into the `sits` command:
    sits mesh render --policy mesh/policy.yaml --out DIR [--istio] [--validate]
    sits mesh ext-proc --policy mesh/policy.yaml [--decision-addr HOST:PORT] [--envoy-admin URL]

ext-proc runs in the services' skeleton (`sits.runtime.service.ServiceApp`): settings from SITS_* variables
(SITS_DECISION_ADDR is where the decision service is unless --decision-addr says otherwise), /metrics, and
SIGTERM/SIGINT draining.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from sits_mesh.envoy_config import render_bootstrap_yaml
from sits_mesh.istio import render_istio_yaml
from sits_mesh.policy import MeshPolicy, PolicyError, load_policy

DEFAULT_POLICY = Path("mesh/policy.yaml")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="mesh_command", required=True)
    render = commands.add_parser("render", help="render the Envoy bootstrap (and Istio resources)")
    render.add_argument("--policy", type=Path, default=DEFAULT_POLICY, help="mesh policy YAML")
    render.add_argument("--out", type=Path, required=True, help="folder for envoy.yaml (and istio.yaml)")
    render.add_argument("--istio", action="store_true", help="also write istio.yaml (EnvoyFilter, DestinationRule)")
    render.add_argument("--validate", action="store_true", help="check envoy.yaml with `envoy --mode validate`")

    serve = commands.add_parser("ext-proc", help="serve the admission external processor")
    serve.add_argument("--policy", type=Path, default=DEFAULT_POLICY, help="mesh policy YAML")
    serve.add_argument(
        "--decision-addr", default=None, help="the decision service's gRPC address (default: SITS_DECISION_ADDR)"
    )
    serve.add_argument(
        "--host-name",
        default=None,
        help="Target.host sent in AdmitRequest (default: SITS_HOST_NAME, this host's name, as capture names the "
        "engine's samples: admission answers from them)",
    )
    serve.add_argument(
        "--envoy-admin",
        default=None,
        help="Envoy's admin URL, where the bypass is switched (default: the policy's admin address)",
    )


def _render(args: argparse.Namespace, policy: MeshPolicy) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    envoy_path = out / "envoy.yaml"
    envoy_path.write_text(render_bootstrap_yaml(policy))
    written = [envoy_path]
    if args.istio:
        istio_path = out / "istio.yaml"
        istio_path.write_text(render_istio_yaml(policy))
        written.append(istio_path)
    for path in written:
        print(f"wrote {path}")
    if args.validate:
        from sits_mesh.envoy_process import validate_config

        result = validate_config(envoy_path)
        if result.returncode != 0:
            print(f"envoy --mode validate refused {envoy_path}:\n{result.stdout}{result.stderr}", file=sys.stderr)
            return 1
        print(f"{envoy_path}: envoy --mode validate OK")
    return 0


async def _serve(args: argparse.Namespace, policy: MeshPolicy) -> int:
    from sits.runtime.grpc_tls import channel_credentials
    from sits.runtime.service import ServiceApp
    from sits.runtime.settings import Settings, SettingsError, load_settings
    from sits.v1 import common_pb2
    from sits_mesh.envoy_process import EnvoyAdmin
    from sits_mesh.ext_proc import DecisionAdmitter, ExtProcServer, FilePressure, serve_admission

    try:
        settings = load_settings(Settings)
    except SettingsError as err:
        print(f"sits mesh ext-proc: {err}", file=sys.stderr)
        return 2
    decision_addr = args.decision_addr or settings.decision_addr
    admission = policy.admission
    target = common_pb2.Target(
        host=settings.host_name if args.host_name is None else args.host_name, engine=admission.engine
    )
    envoy = EnvoyAdmin(args.envoy_admin or f"http://{policy.admin.address}:{policy.admin.port}")
    # Shed counts and the bypass gauge go to the app's /metrics, on SITS_METRICS_BIND:SITS_METRICS_PORT.
    async with ServiceApp("admission", settings) as app:
        # SITS_GRPC_TLS*: the decision service may serve TLS, and may want this process's certificate.
        admitter = DecisionAdmitter(
            decision_addr, target, admission.decision_timeout_s, credentials=channel_credentials(settings)
        )
        app.on_close(admitter.close)

        def ready(server: ExtProcServer) -> None:
            bypass = f", bypass switched at {envoy.admin_url}" if admission.bypass_max_request_tokens else ""
            print(
                f"admission processor on {server.host}:{server.port}, decision at {decision_addr}{bypass}, "
                f"/metrics on {settings.metrics_bind}:{app.metrics_port}",
                flush=True,
            )

        pressure = FilePressure(Path(policy.overload.pressure_file))
        await app.run(serve_admission(policy, admitter, pressure, envoy, app.stop, ready))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except (OSError, PolicyError) as err:
        print(str(err), file=sys.stderr)
        return 2
    if args.mesh_command == "render":
        return _render(args, policy)
    if args.mesh_command == "ext-proc":
        return asyncio.run(_serve(args, policy))
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sits mesh")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
