"""The HTTP door's floor under a ``Turn``: a bare uvicorn app answering canned JSON.

    python -m bench.http_floor ANSWER_FILE     # prints its port, serves until terminated

It serves ``POST /v1/turn`` as the sidecar's HTTP door does (uvicorn with httptools on uvloop,
127.0.0.1, a port from the OS, TCP_NODELAY) and answers every call with the bytes of
``ANSWER_FILE`` (a real ``TurnResponse`` in the JSON mapping, as the sidecar sent it) at once:
the body read whole and parsed as a ``TurnRequest`` (as the door parses it), then no hooks, no
engine, no embedding. A caller's time to it is what HTTP itself costs a call, both ends, at the
callers' pace; ``bench.turn_latency --diy`` measures it beside the sidecar's ``/v1/turn`` in each
round (``http_floor``), as ``bench.grpc_floor`` measures gRPC's beside ``Turn``.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from google.protobuf import json_format

from bench.report import plain
from sidecar.gen import retrieval_pb2 as pb

HEADERS = [(b"content-type", b"application/json")]


def app(answer: bytes) -> Any:
    """An ASGI app answering ``answer`` to every request, once its body is read and parsed."""
    headers = [*HEADERS, (b"content-length", str(len(answer)).encode())]

    async def serve(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        # parsed as the door parses it (sidecar.http.rpc.read_request)
        json_format.ParseDict(orjson.loads(b"".join(chunks)), pb.TurnRequest())
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    return serve


def bound() -> socket.socket:
    """127.0.0.1 on a port from the OS; IPPROTO_TCP named, as the door's, so the accepted
    sockets get TCP_NODELAY."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("answer", type=Path, help="a TurnResponse as JSON to answer with")
    args = parser.parse_args()
    sock = bound()
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(
        app(args.answer.read_bytes()),
        loop="uvloop",
        http="httptools",
        lifespan="off",
        ws="none",
        log_config=None,
        access_log=False,
        server_header=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
