"""The RPC's floor under a ``Turn``: a bare grpc.aio server answering canned bytes.

    python -m bench.grpc_floor ANSWER_FILE     # prints its port, serves until terminated

It serves ``/voxrecall.v1.Retrieval/Turn`` as the sidecar does (grpc.aio on uvloop, 127.0.0.1,
a port from the OS) and answers every call with the bytes of ``ANSWER_FILE`` (a real
``TurnResponse`` the sidecar sent) at once: no interceptor, no hooks, no engine, no embedding.
A caller's time to it is what gRPC itself costs a call, both ends, at the callers' pace;
``bench.turn_latency --diy`` measures it beside the sidecar in each round (``grpc_floor``), so
the RPC's share of a ``Turn`` (client time less ``timings.total_ms``) can be read against it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import grpc
import uvloop

from bench.report import plain
from sidecar.gen import retrieval_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Retrieval"].full_name


def handler(answer: bytes) -> grpc.GenericRpcHandler:
    """``Turn`` answered with ``answer`` as it is (the serializer passes bytes through)."""

    async def turn(request: pb.TurnRequest, context: Any) -> bytes:
        return answer

    method = grpc.unary_unary_rpc_method_handler(
        turn,
        request_deserializer=pb.TurnRequest.FromString,  # parsed, as the sidecar parses it
        response_serializer=bytes,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Turn": method})


async def serve(answer: bytes) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler(answer),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("answer", type=Path, help="a serialized TurnResponse to answer with")
    args = parser.parse_args()
    uvloop.run(serve(args.answer.read_bytes()))


if __name__ == "__main__":
    main()
