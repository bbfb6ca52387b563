"""kv-picker's own admin API (``kvpicker.v1.Admin``, proto/picker/api/admin.proto).

Served on a port of its own (``server.admin``: loopback by default, TLS when configured), not
on the ext_proc port every gateway can reach. ``Explain`` runs the live scheduler on a request as a dry run:
same endpoint signals, same KV index, same plugins, but no in-flight slot, no index update and
no decision counted. ``ListEndpoints`` shows what every endpoint is scored on.
"""

from __future__ import annotations

from typing import Any

import grpc

from kv_picker.api import admin_pb2, admin_pb2_grpc
from kv_picker.director import Director
from kv_picker.errors import InternalError, PickerError
from kv_picker.request import LLMRequest
from kv_picker.scheduling.framework import SchedulingResult

# The one table from picker errors to gRPC status codes for the admin API.
_STATUS_BY_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def infer_path(body: bytes) -> str:
    """The OpenAI path a body most likely targets: chat when it has ``messages``."""
    return "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"


def explanation(request: LLMRequest, result: SchedulingResult) -> admin_pb2.ExplainResponse:
    """Every profile's candidates with per-scorer scores, best total first."""
    response = admin_pb2.ExplainResponse(
        model=request.model,
        kind=request.kind,
        priority=request.priority,
        primary_profile=result.primary_profile,
    )
    for name, profile_result in result.profile_results.items():
        profile = response.profiles.add(
            name=name, picked=[e.address for e in profile_result.targets]
        )
        breakdown = profile_result.breakdown or {}
        order = sorted(range(len(profile_result.candidates)),
                       key=lambda i: -profile_result.totals[i])  # fmt: skip
        for i in order:
            profile.candidates.add(
                address=profile_result.candidates[i].address,
                total=profile_result.totals[i],
                scores={scorer: values[i] for scorer, values in breakdown.items()},
            )
    return response


async def dry_run(
    director: Director, body: bytes, path: str = "", headers: dict[str, str] | None = None
) -> admin_pb2.ExplainResponse:
    """Schedule ``body`` without routing it or recording anything.

    Raises:
        PickerError: as the real request would get (400, 404, 429, 503, ...).
    """
    request_headers = {k.lower(): v for k, v in (headers or {}).items()}
    request_headers[":path"] = path or infer_path(body)
    routed = await director.route_body(body, request_headers, dry_run=True, explain=True)
    request, result = routed.request, routed.result
    if request is None or result is None:  # route_body always sets both
        raise InternalError("the dry run returned no scheduling result")
    return explanation(request, result)


def add_admin_service(server: grpc.aio.Server, director: Director) -> None:
    """Serve ``kvpicker.v1.Admin`` on ``server`` (the generated helper has no type hints)."""
    admin_pb2_grpc.add_AdminServicer_to_server(  # type: ignore[no-untyped-call]
        AdminService(director), server
    )


class AdminService(admin_pb2_grpc.AdminServicer):
    """gRPC servicer for ``kvpicker.v1.Admin``."""

    def __init__(self, director: Director) -> None:
        self.director = director

    async def Explain(
        self, request: admin_pb2.ExplainRequest, context: Any
    ) -> admin_pb2.ExplainResponse:
        try:
            return await dry_run(self.director, request.body, request.path, dict(request.headers))
        except PickerError as error:
            code = _STATUS_BY_HTTP.get(error.status, grpc.StatusCode.INTERNAL)
            await context.abort(code, f"{error.status} {error.reason}: {error.message}")
            raise  # abort raises; this keeps type checkers and readers sure of it

    async def ListEndpoints(
        self, request: admin_pb2.ListEndpointsRequest, context: Any
    ) -> admin_pb2.ListEndpointsResponse:
        store = self.director.store
        now_s = store.now()
        response = admin_pb2.ListEndpointsResponse()
        for endpoint in store.all():
            i = endpoint.id
            scraped_s = store.scraped_s[i]
            response.endpoints.add(
                address=endpoint.address,
                labels=dict(endpoint.labels),
                ready=store.ready[i],
                waiting=store.waiting[i],
                running=store.running[i],
                kv_cache_usage=store.kv_usage[i],
                in_flight=store.in_flight[i],
                metrics_age_seconds=now_s - scraped_s if scraped_s else -1.0,
            )
        return response
