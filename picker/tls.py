"""TLS on the gRPC ports from certificate files that are re-read when they change.

Certificates are short-lived and rotated in place (cert-manager renews a Secret, the kubelet
swaps the mounted files), so a port must take new ones without a restart. Two ways exist:
restart the port when the files change, or hand gRPC *dynamic* credentials. A restart drops
the gateway's HTTP/2 connection, and with it every request stream in flight through it.
``grpc.dynamic_ssl_server_credentials`` instead asks a fetcher for the certificate
configuration before every new connection's handshake: connections open keep the certificate
they were made with, new ones get the new files. The fetcher only ``stat``s the files (the
gateway opens few connections, each long-lived) and reads them when their stamp changed.

A new set is checked before it is used: the key must match the certificate and the client CA
must parse (the stdlib ``ssl`` module loads them), so a rotation caught half-way (the
certificate written, the key not yet) keeps the previous set until the files agree again.

```
handshake ──> fetch() ──stat──> stamp unchanged ──> None (keep the current set)
                          └──> stamp changed ──> read + check ──ok──> new configuration
                                                           └─fail─> None, retried next time
```
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from kv_picker.config import TLSConfig
from kv_picker.errors import ConfigError

log = logging.getLogger(__name__)

# (mtime_ns, size, inode) of each file: the kubelet's atomic swap changes the inode.
Stamp = tuple[tuple[int, int, int], ...]


class CertificateFiles:
    """A port's certificate, key and optional client CA, re-read when they change.

    Args:
        tls: the paths.
        on_reload: called with ``"applied"`` or ``"rejected"`` after each attempted reload.
    """

    def __init__(self, tls: TLSConfig, on_reload: Callable[[str], None] | None = None) -> None:
        self.tls = tls
        self._paths = tuple(
            Path(p) for p in (tls.cert_path, tls.key_path, tls.client_ca_path) if p is not None
        )
        self._on_reload = on_reload
        self._lock = threading.Lock()  # gRPC may call the fetcher from several threads
        self._stamp: Stamp | None = None
        self._rejected: Stamp | None = None

    def initial(self) -> grpc.ServerCertificateConfiguration:
        """The configuration to start with.

        Raises:
            ConfigError: a file is missing, unreadable, or the key does not match.
        """
        stamp = self._stamp_now()
        try:
            configuration = self._read()
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"server TLS files ({self.tls.cert_path}): {exc}") from exc
        self._stamp = stamp
        return configuration

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate fetcher: a new configuration when the files changed, else None."""
        try:
            stamp = self._stamp_now()
        except OSError:
            return None  # a file is being replaced: keep the current set
        with self._lock:
            if stamp == self._stamp or stamp == self._rejected:
                return None
            try:
                configuration = self._read()
            except (OSError, ssl.SSLError, ValueError) as exc:
                self._rejected = stamp
                log.warning(
                    "new TLS files for %s rejected, keeping the current ones: %s",
                    self.tls.cert_path,
                    exc,
                )
                self._report("rejected")
                return None
            self._stamp = stamp
            log.info("TLS files reloaded: %s", self.tls.cert_path)
            self._report("applied")
            return configuration

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that follow the files (client certificates required when a client
        CA is configured)."""
        return grpc.dynamic_ssl_server_credentials(
            self.initial(),
            self.fetch,
            require_client_authentication=self.tls.client_ca_path is not None,
        )

    def _stamp_now(self) -> Stamp:
        stamps = []
        for path in self._paths:
            info = os.stat(path)
            stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
        return tuple(stamps)

    def _read(self) -> grpc.ServerCertificateConfiguration:
        tls = self.tls
        # The stdlib loader refuses a key that does not match its certificate and a CA file
        # that is not PEM; gRPC would only fail later, at a handshake.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.cert_path, tls.key_path)
        client_ca = None
        if tls.client_ca_path is not None:
            context.load_verify_locations(cafile=tls.client_ca_path)
            client_ca = Path(tls.client_ca_path).read_bytes()
        pair = (Path(tls.key_path).read_bytes(), Path(tls.cert_path).read_bytes())
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=client_ca)

    def _report(self, result: str) -> None:
        if self._on_reload is not None:
            self._on_reload(result)
