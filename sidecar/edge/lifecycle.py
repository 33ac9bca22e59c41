"""The sidecar's lifecycle, explicit: LOADING -> SERVING -> DRAINING.

LOADING: no snapshot yet (health NOT_SERVING; calls answer UNAVAILABLE for bases with none).
SERVING: every configured base has a snapshot. DRAINING: shutting down; new calls are refused
with UNAVAILABLE while calls in flight finish within the grace period.
"""

from __future__ import annotations

from enum import Enum

from sidecar.errors import Draining


class State(Enum):
    LOADING = "LOADING"
    SERVING = "SERVING"
    DRAINING = "DRAINING"


class Lifecycle:
    def __init__(self) -> None:
        self.state = State.LOADING

    def check_accepting(self) -> None:
        if self.state is State.DRAINING:
            raise Draining("the sidecar is shutting down: retry on another instance")
