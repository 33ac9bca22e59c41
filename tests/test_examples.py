"""The runnable examples as a user starts them: what is missing is said in one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.hardening_kit import REPO

pytest.importorskip("websockets")  # the realtime-example extra (also in dev, through Pipecat)
REALTIME = REPO / "examples" / "openai_realtime_agent.py"


def run_realtime(**env: str) -> subprocess.CompletedProcess[str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if k != "OPENAI_API_KEY" and not k.startswith("VOXRECALL_")
    }
    return subprocess.run(
        [sys.executable, str(REALTIME), "How much is roaming?"],
        cwd=REPO, env=keep | {"PYTHONPATH": str(REPO)} | env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_realtime_example_without_an_api_key_says_what_to_set() -> None:
    out = run_realtime()
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: set OPENAI_API_KEY to an OpenAI API key (the Realtime API needs one)"
    ]


def test_realtime_example_reads_the_clients_variables() -> None:
    """A token bound for another machine in the clear is refused before anything connects."""
    out = run_realtime(
        OPENAI_API_KEY="sk-test", VOXRECALL_TARGET="sidecar:50051", VOXRECALL_TOKEN="t" * 32
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "in the clear to sidecar:50051" in line
    assert "VOXRECALL_TLS_CA" in line


# An example run with one of its extra's modules made unimportable (None in sys.modules), as
# after only `pip install -e '.[pipecat]'`: one line naming the module and the extra, exit 2.
WITHOUT = (
    "import runpy, sys; sys.modules[sys.argv[1]] = None; sys.argv = sys.argv[2:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.parametrize(
    ("example", "module", "extra"),
    [
        ("pipecat_agent.py", "fastapi", "pipecat-example"),
        ("pipecat_agent.py", "pipecat", "pipecat-example"),
        ("livekit_agent.py", "livekit.plugins", "livekit-example"),
        ("livekit_agent.py", "livekit", "livekit-example"),
        ("openai_realtime_agent.py", "websockets", "realtime-example"),
    ],
)
def test_an_example_without_its_extra_says_what_to_install(
    example: str, module: str, extra: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT, module, str(REPO / "examples" / example)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {module}")  # or the submodule the example imports from it
    assert error.endswith(
        f"is not installed: this example needs its extra, pip install -e '.[{extra}]'"
    )
    assert "Traceback" not in out.stderr


def test_realtime_example_that_cannot_reach_the_api_says_so_in_one_line() -> None:
    """Offline (as here), behind a proxy, or with a key refused: one line naming the URL, not
    a websockets traceback."""
    out = run_realtime(OPENAI_API_KEY="sk-test")
    assert out.returncode == 1, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: cannot reach wss://api.openai.com/")


LIVEKIT = REPO / "examples" / "livekit_agent.py"
LIVEKIT_VARIABLES = ("LIVEKIT_URL", "LIVEKIT_API_KEY", "LIVEKIT_API_SECRET")


def run_livekit(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The example without LiveKit (unimportable, as without its extra), so that once past its
    own check it stops at the import, wherever the extra is installed."""
    keep = {k: v for k, v in os.environ.items() if k not in LIVEKIT_VARIABLES}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, "livekit", str(LIVEKIT), *argv],
        cwd=REPO, env=keep | {"PYTHONPATH": str(REPO)} | env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_livekit_example_without_its_server_says_what_to_set() -> None:
    """LiveKit's own CLI printed a traceback and exited 0; the example says it in one line."""
    out = run_livekit("dev", LIVEKIT_API_KEY="key")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: set LIVEKIT_URL, LIVEKIT_API_SECRET to your LiveKit server's URL, API key and "
        "secret (or pass --url, --api-key, --api-secret)"
    ]


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (("dev",), dict.fromkeys(LIVEKIT_VARIABLES, "x")),
        (("start", "--url=wss://lk", "--api-key", "k", "--api-secret", "s"), {}),
        (("console",), {}),  # runs in the terminal, no server
        (("dev", "--help"), {}),
    ],
)
def test_livekit_example_with_its_server_given_goes_on(
    argv: tuple[str, ...], env: dict[str, str]
) -> None:
    out = run_livekit(*argv, **env)
    assert out.returncode == 2
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: livekit")  # past the check, at the extra's import
