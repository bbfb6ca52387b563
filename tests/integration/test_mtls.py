"""Mutual TLS on the ext_proc port, through real Envoy: Envoy presents a client certificate
signed by the CA the picker trusts and is served; a client without one, or with one from
another CA, is refused; new certificate files are taken without a restart."""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_picker_bench.localstack import (
    LocalStack,
    envoy_bootstrap,
    free_port,
    http_get,
    picker_tls,
)
from tests.certificates import CertificateAuthority
from tests.integration.conftest import post

SERVED_BY = "x-kv-picker-sim-endpoint"


class Pki:
    """The gateway's CA (trusted by the picker), a rogue CA, and the files the picker reads."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = CertificateAuthority("gateway CA")
        self.rogue = CertificateAuthority("rogue CA")
        self.ca_path = directory / "ca.crt"
        self.ca_path.write_bytes(self.ca.cert_pem)
        self.server_cert, self.server_key = self.ca.issue("kv-picker", server=True).write(
            directory, "server"
        )
        self.client_ca_path = directory / "client-ca.crt"
        self.client_ca_path.write_bytes(self.ca.cert_pem)
        self.envoy_cert, self.envoy_key = self.ca.issue("envoy", server=False).write(
            directory, "envoy"
        )
        self.rogue_cert, self.rogue_key = self.rogue.issue("intruder", server=False).write(
            directory, "rogue"
        )

    def replace(self, target: Path, content: bytes) -> None:
        """Swap a file atomically, as the kubelet updates a mounted Secret."""
        staged = target.with_suffix(".new")
        staged.write_bytes(content)
        staged.replace(target)


def upstream_tls(pki: Pki) -> dict[str, Any]:
    """Envoy's transport socket towards the picker: verify it, present Envoy's certificate."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
            "UpstreamTlsContext",
            "sni": "localhost",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": str(pki.envoy_cert)},
                        "private_key": {"filename": str(pki.envoy_key)},
                    }
                ],
                "validation_context": {"trusted_ca": {"filename": str(pki.ca_path)}},
            },
        },
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(pki: Pki) -> Iterator[LocalStack]:
    tls = {
        "certPath": str(pki.server_cert),
        "keyPath": str(pki.server_key),
        "clientCAPath": str(pki.client_ca_path),
    }
    with LocalStack(
        sims=2, time_scale=0.02, start_envoy=False, picker_config={"server": {"tls": tls}}
    ) as local:
        local.envoy_port, local.envoy_admin_port = free_port(), free_port()
        bootstrap = envoy_bootstrap(
            local.envoy_port, local.envoy_admin_port, local.picker_grpc_port
        )
        (ext_proc,) = [
            c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ext_proc"
        ]
        ext_proc["transport_socket"] = upstream_tls(pki)
        local.envoy = local.launch_envoy("envoy", bootstrap, local.envoy_admin_port)
        yield local


def health_check(
    port: int, ca: Path, cert: Path | None = None, key: Path | None = None
) -> grpc.StatusCode:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=5
            )
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def served_certificate(port: int, pki: Pki) -> bytes:
    """The DER certificate the picker presents to a new connection."""
    context = ssl.create_default_context(cafile=str(pki.ca_path))
    context.load_cert_chain(str(pki.envoy_cert), str(pki.envoy_key))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_envoy_with_a_client_certificate_is_served(stack: LocalStack) -> None:
    served = set()
    for i in range(6):
        body = {"model": stack.model, "prompt": f"mutual TLS request {i}", "max_tokens": 2}
        reply = post(f"{stack.url}/v1/completions", body)
        assert reply.status == 200, reply.body
        served.add(reply.headers[SERVED_BY])
    assert served <= set(stack.sim_addresses)


def test_clients_without_the_right_certificate_are_refused(stack: LocalStack, pki: Pki) -> None:
    port = stack.picker_grpc_port
    assert health_check(port, pki.ca_path, pki.envoy_cert, pki.envoy_key) == grpc.StatusCode.OK
    assert health_check(port, pki.ca_path) == grpc.StatusCode.UNAVAILABLE
    assert (
        health_check(port, pki.ca_path, pki.rogue_cert, pki.rogue_key)
        == grpc.StatusCode.UNAVAILABLE
    )
    # Plaintext does not get through either.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=3
        )


def test_rotated_files_are_taken_without_a_restart(stack: LocalStack, pki: Pki) -> None:
    port = stack.picker_grpc_port
    picker_pid = stack.picker.process.pid if stack.picker else None
    before = served_certificate(port, pki)
    renewed = pki.ca.issue("kv-picker renewed", server=True)
    # The key first, then the certificate: in between the pair does not match and the old
    # one stays in use.
    pki.replace(pki.server_key, renewed.key_pem)
    assert served_certificate(port, pki) == before
    pki.replace(pki.server_cert, renewed.cert_pem)
    after = served_certificate(port, pki)
    assert after != before
    assert ssl.DER_cert_to_PEM_cert(after).encode().strip() == renewed.cert_pem.strip()

    # Trust moves to the other CA: its clients get in, the old ones no longer do.
    pki.replace(pki.client_ca_path, pki.rogue.cert_pem)
    time.sleep(0.05)
    assert health_check(port, pki.ca_path, pki.rogue_cert, pki.rogue_key) == grpc.StatusCode.OK
    assert (
        health_check(port, pki.ca_path, pki.envoy_cert, pki.envoy_key)
        == grpc.StatusCode.UNAVAILABLE
    )
    pki.replace(pki.client_ca_path, pki.ca.cert_pem)
    assert health_check(port, pki.ca_path, pki.envoy_cert, pki.envoy_key) == grpc.StatusCode.OK
    # Envoy's connection was never cut: requests still flow, and it is the same process.
    body = {"model": stack.model, "prompt": "after rotation", "max_tokens": 2}
    assert post(f"{stack.url}/v1/completions", body).status == 200
    assert stack.picker is not None and stack.picker.process.pid == picker_pid
    metrics = stack.picker_metrics_text()
    assert 'kv_picker_tls_reloads_total{port="grpc",result="applied"}' in metrics
    assert 'kv_picker_tls_reloads_total{port="grpc",result="rejected"} 1.0' in metrics


class MountedSecret:
    """A directory laid out as the kubelet mounts a Secret: each file a link through ``..data``,
    which an update swaps atomically to a new timestamped directory."""

    def __init__(self, directory: Path, files: dict[str, bytes]) -> None:
        self.directory = directory
        directory.mkdir()
        self.version = 0
        self.update(files)
        for name in files:
            (directory / name).symlink_to(f"..data/{name}")

    def update(self, files: dict[str, bytes]) -> None:
        self.version += 1
        version = self.directory / f"..v{self.version}"
        version.mkdir()
        for name, content in files.items():
            (version / name).write_bytes(content)
        staged = self.directory / "..data_tmp"
        staged.symlink_to(version.name)
        staged.replace(self.directory / "..data")


def envoy_serials(admin_port: int) -> set[str]:
    """Serial numbers of the certificates Envoy holds (its admin /certs)."""
    _, body = http_get(f"http://127.0.0.1:{admin_port}/certs")
    return {
        entry["serial_number"]
        for certificate in json.loads(body)["certificates"]
        for entry in certificate.get("cert_chain", [])
    }


def test_envoy_presents_a_renewed_client_certificate_without_a_restart(tmp_path: Path) -> None:
    """The bundled Envoy's files (a mounted Secret) change: Envoy takes them through file-based
    SDS, so a picker that only trusts the new issuer still serves it, Envoy never restarted."""
    pki = Pki(tmp_path)
    envoy_files = MountedSecret(
        tmp_path / "envoy-tls",
        {
            "ca.crt": pki.ca.cert_pem,
            "tls.crt": pki.envoy_cert.read_bytes(),
            "tls.key": pki.envoy_key.read_bytes(),
        },
    )
    sds_directory = tmp_path / "envoy-config"
    sds_directory.mkdir()
    transport_socket, sds_files = picker_tls(
        str(envoy_files.directory), str(sds_directory), "localhost", client_certificate=True
    )
    for name, document in sds_files.items():
        (sds_directory / name).write_text(yaml.safe_dump(document))
    tls = {
        "certPath": str(pki.server_cert),
        "keyPath": str(pki.server_key),
        "clientCAPath": str(pki.client_ca_path),
    }
    config = {"server": {"tls": tls}}
    with LocalStack(sims=1, time_scale=0.02, start_envoy=False, picker_config=config) as local:
        local.envoy_port, local.envoy_admin_port = free_port(), free_port()
        bootstrap = envoy_bootstrap(
            local.envoy_port, local.envoy_admin_port, local.picker_grpc_port
        )
        (ext_proc,) = [
            c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ext_proc"
        ]
        ext_proc["transport_socket"] = transport_socket
        local.envoy = local.launch_envoy("envoy", bootstrap, local.envoy_admin_port)
        envoy_pid = local.envoy.process.pid
        body = {"model": local.model, "prompt": "before the renewal", "max_tokens": 2}
        assert post(f"{local.url}/v1/completions", body).status == 200

        # The client certificate is renewed by another issuer, and the picker trusts only it.
        renewed = pki.rogue.issue("envoy renewed", server=False)
        before = envoy_serials(local.envoy_admin_port)
        envoy_files.update(
            {"ca.crt": pki.ca.cert_pem, "tls.crt": renewed.cert_pem, "tls.key": renewed.key_pem}
        )
        deadline = time.monotonic() + 10
        while envoy_serials(local.envoy_admin_port) == before:
            assert time.monotonic() < deadline, "Envoy never took the renewed certificate"
            time.sleep(0.05)
        pki.replace(pki.client_ca_path, pki.rogue.cert_pem)
        local.start_picker(config)  # new connections: a handshake with the renewed certificate
        body = {"model": local.model, "prompt": "after the renewal", "max_tokens": 2}
        assert post(f"{local.url}/v1/completions", body).status == 200
        assert local.envoy.process.pid == envoy_pid
