"""What may import what: the turn engine is free of gRPC, and the indexer never imports the
sidecar. Each is checked in a fresh interpreter, where ``sys.modules`` shows every import that
happened, direct or not."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import grpc
import pytest

import index
from index.errors import EmbedderError, SnapshotError, SnapshotNotFound, VoxrecallError
from sidecar import errors
from sidecar.edge.status import code_of_http_status, http_status_for, status_for, tool_error_type


def _loaded_after(imports: str, prefix: str) -> list[str]:
    """The modules named ``prefix`` or ``prefix.*`` loaded after running ``imports``."""
    code = (
        f"import sys; {imports}; "
        f"print('\\n'.join(m for m in sys.modules if m == {prefix!r} or m.startswith({prefix!r} + '.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    return out.stdout.split()


def test_the_turn_engine_never_imports_grpc() -> None:
    assert _loaded_after("import sidecar.turn.engine", "grpc") == []


@pytest.mark.parametrize("package", ["boto3", "botocore"])
def test_a_sidecar_without_an_s3_store_never_imports_boto3(package: str) -> None:
    """boto3 is an extra: a sidecar serving a folder or an HTTP store starts without it (checked
    here, where nothing skips it when the extra is absent)."""
    assert _loaded_after("import sidecar.edge.server, sidecar.cli, index.store", package) == []


def test_the_indexer_never_imports_the_sidecar() -> None:
    names = [m.name for m in pkgutil.walk_packages(index.__path__, "index.")]
    assert "index.build" in names  # the walk found the package's modules
    assert _loaded_after("; ".join(f"import {n}" for n in names), "sidecar") == []


@pytest.mark.parametrize(
    ("error", "code", "http"),
    [
        (errors.BodyTooLarge("big"), grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
        (errors.ToolCallError("invalid_arguments", "no"), grpc.StatusCode.INVALID_ARGUMENT, 400),
        (errors.Loading("wait", retry_ms=50), grpc.StatusCode.UNAVAILABLE, 503),
        (errors.IdleTimeout("quiet"), grpc.StatusCode.DEADLINE_EXCEEDED, 408),
        (SnapshotNotFound("run an index build"), grpc.StatusCode.UNAVAILABLE, 503),
        (EmbedderError("down"), grpc.StatusCode.UNAVAILABLE, 503),
        (SnapshotError("corrupt"), grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_one_row_gives_an_error_its_grpc_and_http_status(
    error: VoxrecallError, code: grpc.StatusCode, http: int
) -> None:
    assert status_for(error) is code
    assert http_status_for(error) == http


def test_an_http_status_reads_back_as_the_code_of_its_row() -> None:
    assert code_of_http_status(401) is grpc.StatusCode.UNAUTHENTICATED
    assert code_of_http_status(413) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of_http_status(418) is grpc.StatusCode.INVALID_ARGUMENT
    assert code_of_http_status(500) is grpc.StatusCode.INTERNAL
    assert code_of_http_status(502) is grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    ("code", "type_"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "invalid_arguments"),
        (grpc.StatusCode.NOT_FOUND, "not_found"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted"),
        (grpc.StatusCode.UNAVAILABLE, "unavailable"),
        (grpc.StatusCode.UNAUTHENTICATED, "unavailable"),
        (grpc.StatusCode.INTERNAL, "unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "unavailable"),
    ],
)
def test_a_refused_tool_call_names_only_a_code_the_model_can_act_on(
    code: grpc.StatusCode, type_: str
) -> None:
    assert tool_error_type(code) == type_
