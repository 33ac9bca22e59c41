"""Bearer tokens on every call, and per-caller scopes over knowledge bases and functions.

    auth = Authenticator(config.sidecar.auth, default_knowledge_base="help", functions=fn_bases)
    server = grpc.aio.server(interceptors=[HookInterceptor([..., auth, ...])])

A call presents ``authorization: Bearer <token>``; a missing or wrong token gets UNAUTHENTICATED.
The token is compared with every configured one in constant time (``hmac.compare_digest``), all
of them every time, so timing says neither whether nor which token matched. What is outside a
caller's scope is answered as if it did not exist, so a token learns no name outside its scope:
a base outside it is NOT_FOUND with the message an unknown base gets (``scope.unknown_base``),
listing the caller's own bases; a function outside it is an unknown function
(``sidecar.functions.tools.visible``, set here: ``Toolbox`` sees only those, and an unknown function's
answer lists only those). ``Status`` and ``ListTools`` answers show only what is in scope; a
caller scoped by functions alone may use their bases (``sidecar.config`` fills that in). Sessions are per caller
(``sidecar.turn.sessions.owner``): the same session id from two callers names two sessions. A
caller's ``filters`` go with every search of its calls (``sidecar.turn.scope.caller_filters``). Tokens come from ``sidecar.config`` (read from the environment once, in the entry point)
and never appear in a message, a log line or a metric: callers are named by ``name``.
Health checks are exempt (``sidecar.edge.interceptor.EXEMPT_SERVICES``).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from typing import Any

from index.config import MIN_TOKEN_CHARS
from index.errors import ConfigError
from sidecar.config import AuthConfig, CallerConfig
from sidecar.edge.interceptor import Call, Hook
from sidecar.errors import Unauthenticated
from sidecar.functions import tools
from sidecar.gen import retrieval_pb2 as pb
from sidecar.turn import scope, sessions

BEARER = "bearer"


class Authenticator(Hook):
    def __init__(
        self,
        auth: AuthConfig,
        *,
        default_knowledge_base: str = "",
        functions: Mapping[str, str] | None = None,
    ) -> None:
        """``functions`` maps each knowledge function's name to its base."""
        for caller in auth.callers:
            if not caller.token:
                raise ConfigError(
                    f"[sidecar.auth] caller {caller.name!r}: the environment variable "
                    f"{caller.token_env} is unset or empty: set it to the caller's token"
                )
            if len(caller.token) < MIN_TOKEN_CHARS:
                raise ConfigError(
                    f"[sidecar.auth] caller {caller.name!r}: the token in {caller.token_env} "
                    f"is shorter than {MIN_TOKEN_CHARS} characters; make one with "
                    "`openssl rand -hex 32`"
                )
        tokens = [c.token for c in auth.callers]
        if len(set(tokens)) != len(tokens):
            raise ConfigError("[sidecar.auth] two callers have the same token: give each its own")
        self._callers = [(c.token.encode(), c) for c in auth.callers]
        self.default_knowledge_base = default_knowledge_base
        self.functions = dict(functions or {})

    def start(self, call: Call) -> None:
        header = call.header("authorization")
        if not header:
            raise Unauthenticated(
                "no credentials: send `authorization: Bearer <token>` (gRPC metadata, or an "
                "HTTP header; `voxrecall ask` and `Connection.from_env` read it from "
                "VOXRECALL_TOKEN)"
            )
        if call.header_count("authorization") > 1:  # which one a proxy checked is unknown
            raise Unauthenticated("the call sent more than one authorization header: send one")
        token = _bearer(header)
        if token is None:
            raise Unauthenticated("authorization must be `Bearer <token>`")
        caller = self._match(token)
        if caller is None:
            raise Unauthenticated("the bearer token is not valid")
        call.caller = caller
        sessions.owner.set(caller.name)  # this caller's sessions are its own
        scope.caller_filters.set(caller.filters)  # every search of this call carries them
        tools.visible.set(self._visible_functions(caller))

    def identify(self, header: str) -> CallerConfig | None:
        """The caller whose token an ``authorization`` header presents, or None (no token, a
        bad one): for an answer open to every client that says more to a caller (``/readyz``
        names the bases it may use)."""
        token = _bearer(header)
        return None if token is None else self._match(token)

    def _match(self, presented: bytes) -> CallerConfig | None:
        found = None
        for secret, caller in self._callers:  # no early exit: every token is compared
            if hmac.compare_digest(presented, secret):
                found = caller
        return found

    # -- scopes ------------------------------------------------------------------------------

    def request(self, call: Call, message: Any) -> None:
        caller: CallerConfig | None = call.caller
        if caller is None or not (caller.knowledge_bases or caller.functions):
            return
        if isinstance(message, pb.ConverseRequest):
            message = message.turn
        # an InvokeToolRequest needs nothing here: Toolbox sees only the caller's functions
        if isinstance(message, pb.TurnRequest | pb.SearchRequest | pb.ReadPageRequest):
            self._check_base(caller, message.knowledge_base or self.default_knowledge_base)

    reads_encoded = True  # it changes a ListTools answer only; never a Search's

    def response(self, call: Call, message: Any) -> None:
        caller: CallerConfig | None = call.caller
        if caller is None or not (caller.knowledge_bases or caller.functions):
            return
        if isinstance(message, pb.ListToolsResponse):  # a Status lists the caller's bases itself
            tools = [t for t in message.tools if self._function_allowed(caller, t.name)]
            del message.tools[:]
            message.tools.extend(tools)

    def reachable_bases(self, caller: CallerConfig | None, bases: Iterable[str]) -> list[str]:
        """Those of ``bases`` the caller may use (all of them for an unscoped caller)."""
        if caller is None:
            return list(bases)
        return [kb for kb in bases if self._base_allowed(caller, kb)]

    def _visible_functions(self, caller: CallerConfig) -> frozenset[str] | None:
        if not (caller.knowledge_bases or caller.functions):
            return None
        return frozenset(f for f in self.functions if self._function_allowed(caller, f))

    @staticmethod
    def _base_allowed(caller: CallerConfig, kb: str) -> bool:
        return not caller.knowledge_bases or kb in caller.knowledge_bases

    def _function_allowed(self, caller: CallerConfig, name: str) -> bool:
        if caller.functions and name not in caller.functions:
            return False
        kb = self.functions.get(name)
        return kb is None or self._base_allowed(caller, kb)

    def _check_base(self, caller: CallerConfig, kb: str) -> None:
        # an empty name with no default is the service's INVALID_ARGUMENT, not a scope question
        if kb and not self._base_allowed(caller, kb):
            raise scope.unknown_base(kb, caller.knowledge_bases)


def _bearer(header: str) -> bytes | None:
    """The token of an ``authorization: Bearer <token>`` header, or None for any other form."""
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        return None
    return token.strip().encode()
