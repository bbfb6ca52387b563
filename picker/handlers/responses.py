"""Builders for ext_proc ProcessingResponse messages, and the one error -> response table."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kv_picker.errors import PickerError
from kv_picker.wire import (
    BODY_CHUNK_LIMIT_BYTES,
    DESTINATION_KEY,
    DESTINATION_NAMESPACE,
    DROPPED_REASON_HEADER,
)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

CONTINUE_HEADERS_REQUEST = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
CONTINUE_HEADERS_RESPONSE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_BODY_REQUEST = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_BODY_RESPONSE = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_TRAILERS_REQUEST = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
CONTINUE_TRAILERS_RESPONSE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def header_option(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=_OVERWRITE,
    )


def destination_metadata(destination: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: destination}})
    return metadata


def routing_mutation(
    set_headers: Iterable[tuple[str, str]], remove_headers: Iterable[str]
) -> pb.CommonResponse:
    """The common part of the response that carries the pick."""
    return pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=[header_option(name, value) for name, value in set_headers],
            remove_headers=list(remove_headers),
        ),
        clear_route_cache=True,
    )


def streamed_body(
    body: bytes, *, request: bool, end_of_stream: bool = True
) -> Iterator[pb.ProcessingResponse]:
    """Body responses for full-duplex streaming: chunks of at most 62,000 bytes.

    An empty body still yields one (empty) chunk so the end of stream is sent.
    """
    limit = BODY_CHUNK_LIMIT_BYTES
    size = len(body)
    start = 0
    while True:
        end = min(start + limit, size)
        last = end >= size
        chunk = pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(
                        body=body[start:end], end_of_stream=end_of_stream and last
                    )
                )
            )
        )
        if request:
            yield pb.ProcessingResponse(request_body=chunk)
        else:
            yield pb.ProcessingResponse(response_body=chunk)
        if last:
            return
        start = end


def error_body(status: int, message: str, error_type: str, reason: str) -> bytes:
    """An OpenAI-style error document."""
    return json.dumps(
        {"error": {"message": message, "type": error_type, "code": status, "reason": reason}}
    ).encode()


def immediate_error(error: PickerError) -> pb.ProcessingResponse:
    """The only place an error becomes an HTTP response: status, JSON body, reason header."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=pb.HeaderMutation(
                set_headers=[
                    header_option("content-type", "application/json"),
                    header_option(DROPPED_REASON_HEADER, error.reason),
                ]
            ),
            body=error_body(error.status, error.message, error.error_type, error.reason),
            details=f"kv_picker_{error.reason}",
        )
    )
