"""Small real snapshots for store and refresh tests, each version about its own topic.

Every chunk id starts with the version id, so a test can tell which snapshot served a chunk.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from bench.fuzz_snapshot import array_slots, set_item
from index.embedders.base import Embedder
from index.hnsw_file import HEADER
from index.http_store import HttpStore
from index.mapped import MAGIC
from index.snapshot import (
    CHUNKS,
    GAZETTEER,
    LEXICAL,
    MANIFEST,
    PAGES,
    VECTORS,
    sha256_file,
    write_snapshot,
)
from index.store import LATEST, LocalStore, new_version_id
from index.types import Chunk

KB = "docs"
EPOCH = 1_700_000_000.0

TOPICS = {
    "password": [
        "To reset your password, open Settings, choose Security and press Reset password.",
        "The reset link we email you expires after one hour; ask for a new one if it lapsed.",
        "A new password needs twelve characters and may not repeat your last three passwords.",
    ],
    "roaming": [
        "Roaming in the European Union costs nothing extra on the Plus and Max plans.",
        "Outside the EU, a roaming day pass costs five euros and includes one gigabyte of data.",
        "Turn data roaming on under Settings, Mobile network, Roaming before you travel.",
    ],
    "voicemail": [
        "Call 1233 from your phone to listen to your voicemail messages.",
        "Set a voicemail greeting by calling 1233 and pressing 3 for personal options.",
        "Voicemail keeps messages for thirty days before deleting them.",
    ],
    "invoices": [
        "Invoices are emailed on the first day of each month as a PDF attachment.",
        "Download older invoices from the Billing page of your account for up to two years.",
        "Pay an invoice by direct debit, card, or bank transfer within fourteen days.",
    ],
}


def version_id(n: int) -> str:
    """The n-th version id: sortable like the ones builds make."""
    return new_version_id(f"{n:08x}", now=EPOCH + n)


def write_version(
    root: Path,
    version: str,
    embedder: Embedder,
    topic: str = "password",
    *,
    kb: str = KB,
    page_bytes: int = 0,
    damage: Callable[[Path], None] | None = None,
    point: bool = True,
    source: str = "faq",
    chunk_pad: int = 0,
    field_pad: int = 0,
) -> Path:
    """Write a snapshot of ``topic`` into ``root`` as ``version``, its chunks in ``source``;
    ``damage`` runs on the folder before LATEST is written; ``point=False`` uploads the folder
    without moving LATEST. ``chunk_pad`` words are added to each chunk's text (not to what
    is embedded): a snapshot built before the chunker's cap held chunks that large.
    ``field_pad`` characters are added to each chunk's title, breadcrumb, URL, embedded text and
    a metadata value (a hostile snapshot; embedded without them)."""
    texts = TOPICS[topic]
    pad = "x" * field_pad
    chunks = [
        Chunk(
            chunk_id=f"{version}-{i}",
            source=source,
            source_path=f"{topic}.md",
            title=topic.title() + pad,
            breadcrumbs=(topic.title() + pad,),
            text=text + " filler" * chunk_pad,
            embed_text=f"{topic.title()}\n{text}",
            url=f"https://example.com/{topic}{pad}" if pad else "",
            metadata={"lang": "en", "tags": (topic, "help"), **({"note": pad} if pad else {})},
        )
        for i, text in enumerate(texts)
    ]
    vectors = embedder.embed_batch([c.embed_text for c in chunks])
    if pad:
        chunks = [dataclasses.replace(c, embed_text=c.embed_text + pad) for c in chunks]
    store = LocalStore(root)
    staging = store.staging_dir(kb)
    write_snapshot(
        staging,
        knowledge_base=kb,
        version=version,
        embedder=embedder.info,
        chunks=chunks,
        vectors=vectors,
        pages={f"{source}:{topic}.md": " ".join(texts) + " " * page_bytes},
        page_count=1,
        hnsw_m=8,
        hnsw_ef_construction=50,
        target_recall=0.9,
        sources=[source],
    )
    folder = store.version_dir(kb, version)
    staging.rename(folder)
    if damage is not None:
        damage(folder)
    if point:
        point_at(root, version, kb)
    return folder


def point_at(root: Path, version: str, kb: str = KB) -> None:
    """Write LATEST the way a publisher does: temp file, then rename."""
    tmp = root / kb / f".{LATEST}.tmp"
    tmp.write_text(f"{version}\n", encoding="utf-8")
    tmp.replace(root / kb / LATEST)


def flip_a_byte(folder: Path, name: str = VECTORS) -> None:
    """Corrupt one file in place, keeping its size (what bit rot or a bad copy does)."""
    path = folder / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def resign(folder: Path, name: str) -> None:
    """Write ``name``'s sha256 and size into the manifest, as someone able to write to the store
    would after changing that file: the checksums pass, only the content can tell."""
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest["files"][name] = sha256_file(folder / name)
    manifest["sizes"][name] = (folder / name).stat().st_size
    (folder / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


def _patch(name: str, change: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        path.write_bytes(change(path.read_bytes()))
        resign(folder, name)

    return damage


def _at(offset: int, value: int, width: int) -> Callable[[bytes], bytes]:
    return lambda data: data[:offset] + value.to_bytes(width, "little") + data[offset + width :]


def _item(array: str, i: int, value: int) -> Callable[[bytes], bytes]:
    """Element ``i`` of one array of a mapped file set to ``value``."""

    def edit(data: bytes) -> bytes:
        out = bytearray(data)
        set_item(out, array_slots(data)[array], i, value)
        return bytes(out)

    return edit


def _header(field: str, value: object) -> Callable[[bytes], bytes]:
    """One field of a mapped file's JSON header set to ``value``, the arrays moved with the end
    of the header (their offsets count from there)."""

    def edit(data: bytes) -> bytes:
        start = len(MAGIC) + 4
        length = int.from_bytes(data[len(MAGIC) : start], "little")
        header = {**json.loads(data[start : start + length]), field: value}
        raw = json.dumps(header, separators=(",", ":")).encode()
        prefix = MAGIC + len(raw).to_bytes(4, "little") + raw
        body = data[start + length + (-(start + length) % 64) :]
        return prefix + b"\0" * (-len(prefix) % 64) + body

    return edit


def _entry_point_alone(data: bytes) -> bytes:
    """The entry point's level-0 link count set to 0: a well-formed layout, every id in range,
    but a search whose descent ends at the entry point finds it alone (attack F5, s12)."""
    entry = int.from_bytes(data[52:56], "little")
    per_element = int.from_bytes(data[24:32], "little")
    return _at(HEADER.size + entry * per_element, 0, 4)(data)


def _element_7_starts(*values: float) -> Callable[[bytes], bytes]:
    """Element 7's vector's first values set to ``values``."""

    def edit(data: bytes) -> bytes:
        per_element = int.from_bytes(data[24:32], "little")
        start = HEADER.size + 7 * per_element + int.from_bytes(data[40:48], "little")
        packed = struct.pack(f"<{len(values)}f", *values)
        return data[:start] + packed + data[start + len(packed) :]

    return edit


# Files whose checksums match a manifest re-signed after the change (issue 14's attacks): each
# crashed the sidecar or broke its calls before the loader checked what it reads.
TAMPERED: dict[str, Callable[[Path], None]] = {
    "hnsw_entry_point_past_the_end": _patch(VECTORS, _at(52, 0xFFFFFF00, 4)),
    # 2**30 levels: hnswlib reads ~100 GB past the entry point's links, unmapped, and crashes
    # every run; at 100,000 it read ~13 MB past them, which the heap sometimes held, and then
    # it either crashed or raised "cand error" on the garbage (the test's reproduction flaked)
    "hnsw_top_level_2_30": _patch(VECTORS, _at(48, 1 << 30, 4)),
    # passed every check and warm-up, then failed a share of searches with hnswlib's
    # RuntimeError, UNKNOWN to the caller, while SERVING (s12's F5)
    "hnsw_entry_point_linked_to_none": _patch(VECTORS, _entry_point_alone),
    # searched without an error, and the element is found by no query (s13's F1: an
    # embedder's overflow published)
    "hnsw_a_vector_of_nan": _patch(VECTORS, _element_7_starts(math.nan)),
    # +3e38 and -3e38 (s13's second attack, V1): finite, summing to 0; the element came first
    # for half of all queries
    "hnsw_a_vector_of_3e38": _patch(VECTORS, _element_7_starts(3e38, -3e38)),
    # a squared norm of 1e36, finite in float32: the element comes first for every query whose
    # first value is positive (a norm check that only asked "finite" let it through)
    "hnsw_a_vector_of_1e18": _patch(VECTORS, _element_7_starts(1e18)),
    "pages_file_is_5": _patch(PAGES, lambda _: b"5"),
    "pages_text_offset_past_the_blob": _patch(PAGES, _item("t_offsets", 1, 1 << 40)),
    "chunk_string_offsets_decrease": _patch(CHUNKS, _item("s_offsets", 2, 1)),
    "chunk_span_past_the_table": _patch(CHUNKS, _item("first", 1, 0xFFFFFFFF)),
    "chunk_more_crumbs_than_strings": _patch(CHUNKS, _item("crumbs", 0, 100)),
    "chunk_source_out_of_range": _patch(CHUNKS, _item("source_of", 0, 7)),
    "chunk_meta_list_longer_than_its_span": _patch(CHUNKS, _item("meta_n", 0, 1 << 20)),
    "chunk_meta_entries_past_meta_n": _patch(CHUNKS, _item("meta_first", 1, 1 << 40)),
    "lexical_doc_id_past_the_end": _patch(LEXICAL, _item("doc_ids", 0, 1 << 20)),
    "lexical_indptr_decreases": _patch(LEXICAL, _item("indptr", 1, 0xFFFFFF00)),
    "lexical_cut_in_half": _patch(LEXICAL, lambda data: data[: len(data) // 2]),
    "lexical_10_bytes": _patch(LEXICAL, lambda data: data[:10]),
    # within the earlier checks, but BM25's weights NaN or its fallback empty (s12's F8)
    "lexical_k1_0": _patch(LEXICAL, _header("k1", 0.0)),
    "lexical_k1_1e300": _patch(LEXICAL, _header("k1", 1e300)),
    "lexical_tf_0": _patch(LEXICAL, _item("tfs", 0, 0)),
    "lexical_doc_len_0": _patch(LEXICAL, _item("doc_len", 0, 0)),
    # the follow-ups' matching tables: a lookup would read a key past the keys' table, or
    # tables made for another entities.bin than the snapshot's (issue 19)
    "gazetteer_prefix_key_past_the_keys": _patch(GAZETTEER, _item("prefix_key", 0, 1 << 20)),
    "gazetteer_of_another_entities_file": _patch(GAZETTEER, _header("entities", "0" * 64)),
}

# Element 0's first level-0 link named past the end (96 bytes of header, then its link count):
# the header is whole, so only the check of the whole layout (``check_hnsw_file``) refuses it,
# and a search that walks that link crashes hnswlib.
LEVEL0_LINK_PAST_THE_END = _patch(VECTORS, _at(HEADER.size + 4, 0xFFFFFF00, 4))


class DiskFullStore(HttpStore):
    """An HttpStore whose cache disk is full while ``full`` is set: ENOSPC at its write seam."""

    full = False

    def _write(self, f: BinaryIO, data: bytes) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._write(f, data)


def resident_kb(path: Path) -> int | None:
    """The resident kB of this process's mappings of ``path`` (None: no /proc smaps here)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    kb, inside = 0, False
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            kb += int(fields[1])
    return kb
