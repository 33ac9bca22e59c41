"""Where the evaluation data is: ``../shared/data`` beside the repository, or the folder the
``VOXRECALL_SHARED_DATA`` environment variable names (the tests read the same switch; CI points
it at an empty folder to prove every test passes or skips on a machine without the data)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "VOXRECALL_SHARED_DATA"
SHARED_DATA = Path(
    os.environ.get(ENV_VAR) or Path(__file__).resolve().parents[2] / "shared" / "data"
)
