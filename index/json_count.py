"""How many JSON objects and arrays a body may hold, counted before it is parsed.

A parse (orjson, json) builds a Python object of each while it holds the GIL, so a small body of
``[],[],...`` holds the event loop, or a worker thread and the loop with it, for as long as the
parse takes. Every reader of a peer's JSON (the HTTP door, the embedder and reranker clients,
a snapshot's manifest) counts first, at C speed, and refuses a body over its own limit.
"""

from __future__ import annotations


def json_containers(data: bytes | str) -> int:
    """The ``[`` and ``{`` of ``data``: its JSON objects and arrays at most (brackets inside
    strings count too, so the count errs only toward refusing)."""
    if isinstance(data, str):
        return data.count("[") + data.count("{")
    return data.count(b"[") + data.count(b"{")
