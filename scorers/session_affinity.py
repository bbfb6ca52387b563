"""session-affinity-scorer: keep a session on the endpoint that served its previous request.

Type: ``session-affinity-scorer``

Formula: the endpoint named by the request's session header -> 1.0, every other endpoint 0.
On the way back, the response carries the header naming the endpoint that served it, so a
client that echoes it keeps its session (and its KV cache) in one place.

Header: ``x-session-token`` (configurable), value = URL-safe base64 of the endpoint's
``ip:port``. An unknown, malformed or departed endpoint in the header is ignored (all 0).
Inputs: the request header. Parameters: ``headerName`` (x-session-token).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest

DEFAULT_HEADER = "x-session-token"


def encode_session_token(address: str) -> str:
    return base64.urlsafe_b64encode(address.encode()).decode()


def decode_session_token(token: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(token.encode() + b"=" * (-len(token) % 4)).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class SessionAffinityParams:
    headerName: str = DEFAULT_HEADER

    def validate(self) -> None:
        if not self.headerName or self.headerName != self.headerName.lower():
            raise ValueError("parameter 'headerName' must be a non-empty lower-case header name")


class SessionAffinityScorer:
    type_name: ClassVar[str] = "session-affinity-scorer"
    Params = SessionAffinityParams

    def __init__(self, name: str, params: SessionAffinityParams, ctx: BuildContext) -> None:
        self.name = name
        self.header = params.headerName

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        token = request.headers.get(self.header)
        if not token:
            return
        address = decode_session_token(token)
        if address is None:
            return
        for i, endpoint in enumerate(candidates):
            if endpoint.address == address:
                out[i] = 1.0
                return

    def response_headers(self, request: LLMRequest, endpoint: Endpoint) -> list[tuple[str, str]]:
        """Name the serving endpoint so the client can send it back."""
        return [(self.header, encode_session_token(endpoint.address))]
