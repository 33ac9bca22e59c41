"""Server reflection (what grpcurl lists and describes by), with an idle deadline.

grpcio's servicer reads its request stream for as long as the client keeps it open: an idle
reflection stream held its slot for ever. Here a stream that sends no request, or does not read
an answer, for ``REFLECTION_IDLE_S`` ends DEADLINE_EXCEEDED and gives its slot back. Its slots
are counted apart from Converse's (``sidecar.edge.limits``: ``REFLECTION_STREAMS``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

from sidecar.edge.limits import idle_limited, written_within
from sidecar.edge.status import status_for
from sidecar.errors import IdleTimeout

# grpcurl sends its requests back to back and reads each answer at once; a stream quiet this
# long is abandoned.
REFLECTION_IDLE_S = 10.0
_SETTING = "server reflection's idle limit"
_AGAIN = "open a new reflection stream to go on"


class IdleLimitedReflection(ReflectionServicer):  # type: ignore[misc]
    """grpcio's reflection servicer, each stream ended when idle for ``idle_s``."""

    def __init__(self, service_names: Sequence[str], idle_s: float = REFLECTION_IDLE_S) -> None:
        super().__init__(service_names)
        self.idle_s = idle_s

    async def ServerReflectionInfo(
        self,
        request_iterator: AsyncIterator[reflection_pb2.ServerReflectionRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        requests = idle_limited(request_iterator, self.idle_s, _SETTING, _AGAIN)
        try:
            async for answer in super().ServerReflectionInfo(requests, context):
                await written_within(context.write(answer), self.idle_s, _SETTING, _AGAIN)
        except IdleTimeout as exc:  # abort would wait behind the answers left unread
            context.set_code(status_for(exc))
            context.set_details(str(exc))


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Reflection on ``server`` for ``service_names`` (and itself)."""
    names = (*service_names, reflection.SERVICE_NAME)
    servicer = IdleLimitedReflection(names, REFLECTION_IDLE_S)
    reflection_grpc.add_ServerReflectionServicer_to_server(servicer, server)
