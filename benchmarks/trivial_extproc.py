"""The least an ext_proc endpoint picker can do: the floor of ``kv-picker bench overhead``.

A fixed pick (round robin over the endpoints given), no parsing, the body echoed back as it
came: what Envoy and the ext_proc protocol cost in Python before any routing work. It answers
each body mode the way kv-picker does, so the two run on the same Envoy configuration:

- ``FULL_DUPLEX_STREAMED`` request body: hold the headers until the body has arrived, then
  send the headers reply (destination, ``content-length``) and the body back in chunks.
- ``BUFFERED``: continue the headers; answer the whole body with the destination header.
- Response headers, bodies and trailers (when Envoy sends them): continue, or echo the chunks
  back in full-duplex mode.

Run as ``python -m kv_picker_bench.trivial_extproc --port P --endpoint HOST:PORT ...``; it
prints ``ready`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kv_picker.handlers import responses
from kv_picker.wire import DESTINATION_HEADER

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class _Stream:
    __slots__ = ("chunks", "mode", "response_mode", "routed")

    def __init__(self) -> None:
        self.mode: int | None = None
        self.response_mode: int | None = None
        self.chunks: list[bytes] = []
        self.routed = False


class TrivialProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Round robin over ``endpoints``; nothing read, nothing counted."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self._next = itertools.cycle(endpoints).__next__

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream()
        async for message in request_iterator:
            if message.HasField("protocol_config"):
                stream.mode = message.protocol_config.request_body_mode
                stream.response_mode = message.protocol_config.response_body_mode
            for response in self._answer(message, stream):
                yield response

    def _pick(self, content_length: int | None) -> pb.CommonResponse:
        headers = [(DESTINATION_HEADER, self._next())]
        if content_length is not None:
            headers.append(("content-length", str(content_length)))
        return responses.routing_mutation(headers, ())

    def _answer(
        self, message: pb.ProcessingRequest, stream: _Stream
    ) -> Iterator[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            if message.request_headers.end_of_stream:
                stream.routed = True
                yield pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=self._pick(None))
                )
            elif stream.mode != _FULL_DUPLEX:
                yield responses.CONTINUE_HEADERS_REQUEST
        elif kind == "request_body":
            body = message.request_body
            if stream.routed:
                yield responses.CONTINUE_BODY_REQUEST
            elif stream.mode == _FULL_DUPLEX:
                stream.chunks.append(body.body)
                if body.end_of_stream:
                    stream.routed = True
                    whole = b"".join(stream.chunks)
                    stream.chunks = []
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(response=self._pick(len(whole)))
                    )
                    yield from responses.streamed_body(whole, request=True)
            else:  # BUFFERED: the whole body in one message
                stream.routed = True
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=self._pick(None)))
        elif kind == "request_trailers":
            yield responses.CONTINUE_TRAILERS_REQUEST
        elif kind == "response_headers":
            yield responses.CONTINUE_HEADERS_RESPONSE
        elif kind == "response_body":
            body = message.response_body
            if stream.response_mode == _FULL_DUPLEX:
                yield from responses.streamed_body(
                    body.body, request=False, end_of_stream=body.end_of_stream
                )
            else:
                yield responses.CONTINUE_BODY_RESPONSE
        elif kind == "response_trailers":
            yield responses.CONTINUE_TRAILERS_RESPONSE


async def serve(port: int, endpoints: Sequence[str]) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(TrivialProcessor(endpoints), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kv_picker_bench.trivial_extproc",
        description="A trivial ext_proc service: fixed round-robin pick, body echoed.",
    )
    parser.add_argument("--port", type=int, required=True, help="gRPC port on 127.0.0.1")
    parser.add_argument(
        "--endpoint", action="append", required=True, help="an endpoint HOST:PORT (repeatable)"
    )
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the same choice as kv-picker serve --event-loop (asyncio)",
    )
    args = parser.parse_args(argv)
    if args.event_loop == "uvloop":
        import uvloop

        uvloop.run(serve(args.port, args.endpoint))
    else:
        asyncio.run(serve(args.port, args.endpoint))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
