"""The embedded default embedder, with the real int8 model shipped in index/model/."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from index.embedders.base import Embedder
from index.embedders.local import MODEL_FILE, TOKENIZER_FILE, LocalEmbedder, default_model_dir
from index.errors import EmbedderError


@pytest.fixture(scope="module")
def embedder() -> Iterator[LocalEmbedder]:
    emb = LocalEmbedder()
    yield emb
    asyncio.run(emb.aclose())


@pytest.fixture
async def async_embedder() -> AsyncIterator[LocalEmbedder]:
    emb = LocalEmbedder()
    yield emb
    await emb.aclose()


def test_info_and_protocol(embedder: LocalEmbedder) -> None:
    assert isinstance(embedder, Embedder)
    assert embedder.info.name == "local/all-MiniLM-L6-v2-int8"
    assert embedder.info.dimension == 384


def test_default_model_dir_holds_the_model() -> None:
    folder = default_model_dir()
    for name in (MODEL_FILE, TOKENIZER_FILE, "NOTICE", "LICENSE"):
        assert (folder / name).is_file(), name
    assert (folder / MODEL_FILE).stat().st_size < 30_000_000


def test_shape_dtype_and_unit_norm(embedder: LocalEmbedder) -> None:
    vectors = embedder.embed_batch(["How do I open a new tab?", "", "ok"])
    assert vectors.shape == (3, 384)
    assert vectors.dtype == np.float32
    assert vectors.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_empty_input(embedder: LocalEmbedder) -> None:
    vectors = embedder.embed_batch([])
    assert vectors.shape == (0, 384)
    assert vectors.dtype == np.float32


def test_paraphrase_closer_than_unrelated(embedder: LocalEmbedder) -> None:
    query, paraphrase, unrelated = embedder.embed_batch(
        ["How do I open a new tab?", "Opening another tab", "The weather in Paris"]
    )
    assert float(query @ paraphrase) > float(query @ unrelated) + 0.2
    assert float(paraphrase @ query) > float(paraphrase @ unrelated)


def test_deterministic(embedder: LocalEmbedder) -> None:
    texts = ["Refunds take five business days.", "Press 1 for billing."]
    first = embedder.embed_batch(texts)
    second = embedder.embed_batch(texts)
    np.testing.assert_array_equal(first, second)


def test_alone_equals_in_a_padded_batch(embedder: LocalEmbedder) -> None:
    short = "Reset my password"
    longer = [
        "To configure two-factor authentication, open Settings, choose Security, and scan the "
        "QR code with an authenticator app; keep the recovery codes somewhere safe.",
        "Our premium plan includes unlimited storage, priority support and single sign-on.",
    ]
    alone = embedder.embed_batch([short])[0]
    in_batch = embedder.embed_batch([longer[0], short, longer[1]])
    np.testing.assert_allclose(in_batch[1], alone, atol=1e-4)
    np.testing.assert_allclose(in_batch[0], embedder.embed_batch([longer[0]])[0], atol=1e-4)


async def test_batches_split_by_batch_size_agree(async_embedder: LocalEmbedder) -> None:
    texts = [f"question number {i} about the invoice" for i in range(7)]
    small = LocalEmbedder(batch_size=3)
    try:
        np.testing.assert_allclose(
            small.embed_batch(texts), async_embedder.embed_batch(texts), atol=1e-4
        )
    finally:
        await small.aclose()


async def test_parallel_embedding_makes_the_single_text_vectors_in_order(
    embedder: LocalEmbedder,
) -> None:
    """A build embeds on every core; each vector must be the one a text alone gets (issue 19:
    cosine >= 0.999; here equal, since each text still runs alone), rows in input order."""
    texts = [f"Step {i}: open Settings, then {'Security ' * (i % 5)}and save." for i in range(23)]
    parallel = LocalEmbedder(parallel=3)
    try:
        got = parallel.embed_batch(texts)
    finally:
        await parallel.aclose()
    want = np.stack([embedder.embed_batch([t])[0] for t in texts])
    assert got.shape == (23, 384)
    np.testing.assert_array_equal(got, want)
    assert float(np.min(np.sum(got * want, axis=1))) >= 0.999


async def test_async_embed_equals_embed_batch(async_embedder: LocalEmbedder) -> None:
    texts = ["How do I open a new tab?", "The weather in Paris"]
    np.testing.assert_array_equal(
        await async_embedder.embed(texts), async_embedder.embed_batch(texts)
    )
    empty = await async_embedder.embed([])
    assert empty.shape == (0, 384)


async def test_embed_after_aclose_raises() -> None:
    emb = LocalEmbedder()
    await emb.aclose()
    await emb.aclose()  # idempotent
    with pytest.raises(EmbedderError, match="closed"):
        await emb.embed(["hello"])


def test_long_text_is_truncated(embedder: LocalEmbedder) -> None:
    words = " ".join(f"word{i % 97} and" for i in range(1000))  # 2000 words
    assert len(words.split()) == 2000
    vectors = embedder.embed_batch([words, words + " a different ending after the cut"])
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # everything past max_tokens is cut, so the two texts embed the same
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-6)


def _copy_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in (MODEL_FILE, TOKENIZER_FILE):
        shutil.copyfile(default_model_dir() / name, folder / name)
    return folder


def test_corrupted_model_is_refused(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path)
    data = bytearray((folder / MODEL_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(EmbedderError, match=MODEL_FILE) as info:
        LocalEmbedder(folder)
    assert "export_model.py" in str(info.value)


def test_corrupted_tokenizer_is_refused(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path)
    with (folder / TOKENIZER_FILE).open("a", encoding="utf-8") as fh:
        fh.write(" ")
    with pytest.raises(EmbedderError, match=TOKENIZER_FILE):
        LocalEmbedder(folder)


def test_missing_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EmbedderError, match=MODEL_FILE):
        LocalEmbedder(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threads": 0}, "threads"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"max_tokens": 513}, "max_tokens"),
        ({"batch_size": 0}, "batch_size"),
        ({"parallel": 0}, "parallel"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalEmbedder(**kwargs)  # type: ignore[arg-type]


async def test_a_pair_runs_side_by_side_with_the_single_text_vectors(
    async_embedder: LocalEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's two queries (QueryEmbedder.get_many) come as one call of two texts: each runs
    alone on a thread of its own, and a cancelled pair leaves the embedder working."""
    pair = ["HARBOR GRILL: do they take reservations", "do they take reservations"]
    threads: dict[str, str] = {}
    embed_rows = async_embedder._embed_rows

    def recording(texts: list[str]) -> np.ndarray:
        threads[texts[0]] = threading.current_thread().name.rsplit("_", 1)[0]
        return embed_rows(texts)

    monkeypatch.setattr(async_embedder, "_embed_rows", recording)
    cancelled = asyncio.ensure_future(async_embedder.embed(["a pair", "cut off"]))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    got = await async_embedder.embed(pair)
    assert [threads[text] for text in pair] == ["voxrecall-embed", "voxrecall-embed-beside"]
    want = np.concatenate([async_embedder.embed_batch([text]) for text in pair])
    np.testing.assert_array_equal(got, want)


def test_truncates_agrees_with_the_tokenizer(embedder: LocalEmbedder) -> None:
    """``truncates`` skips the tokenizer for a text too short to reach the limit (an ASCII
    character is one token at most): at and past that bound it answers as the tokenizer does."""
    whole = Tokenizer.from_file(str(default_model_dir() / TOKENIZER_FILE))
    whole.no_padding()
    whole.no_truncation()
    texts = [
        "?" * 254,  # one token a character: 254 + [CLS] + [SEP] = 256, the limit
        "?" * 255,
        "a," * 127,
        "a," * 128,
        "How do I split a pane? " * 10,
        "word " * 300,
        "한" * 63,  # a Hangul syllable is more than one token
        "한" * 70,
        "é?" * 127,
        "roaming123456 " * 285,  # a turn at the 4,000-character cap, counted a slice at a time
        "supercalifragilisticexpialidocious " * 114,  # few words, many pieces each
        "x" * 3999,  # one word: one [UNK]
        ("x" * 300 + " ") * 13,  # words longer than a slice
        "a\tb\nc " * 500,
        "pneumonoultramicroscopic " * 9 + "é " * 100,  # 2 + 8 pieces a word: short of the limit
        "世" * 4000,  # no whitespace: a character a token
        "x" * 16000,  # no whitespace, one word a slice: an [UNK] each
    ]
    for text in texts:
        assert embedder.truncates(text) == (len(whole.encode(text).ids) > 256), text[:20]


class _Counting:
    """A tokenizer that records the length of every text it encodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, list[int]()

    def encode(self, text: str, **options: bool) -> object:
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **options)


def test_truncates_reads_a_long_turn_only_until_it_is_past_the_limit(
    embedder: LocalEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn at the 4,000-character cap is tokenized on the event loop (a Turn's ``truncated``):
    only its first slices, until their tokens are past the limit, not the whole text."""
    counting = _Counting(embedder._tokenizer)
    monkeypatch.setattr(embedder, "_tokenizer", counting)
    assert embedder.truncates(" ".join(f"roaming{i}" for i in range(450))[:3999])
    assert sum(counting.lengths) < 2000  # of 3,999
    counting.lengths.clear()
    assert embedder.truncates("世" * 16000)  # no whitespace to cut at (a review)
    assert sum(counting.lengths) < 2000


def test_a_long_text_is_embedded_from_its_head_alone(
    embedder: LocalEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer holds the GIL for all it is given (the event loop waits ~7 ms for a 16 KiB
    turn): embedding hands it only the head the model reads, and the vector is the whole text's."""
    text = " ".join(f"roaming{i}" for i in range(1800))[:16000]
    ids = np.asarray([embedder._tokenizer.encode(text).ids], dtype=np.int64)  # the whole text's
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": ids * 0}
    (raw,) = embedder._session.run(["sentence_embedding"], feeds)
    whole = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    counting = _Counting(embedder._tokenizer)
    monkeypatch.setattr(embedder, "_tokenizer", counting)
    np.testing.assert_allclose(embedder.embed_batch([text]), whole, atol=1e-6)
    assert max(counting.lengths) < 4000  # of 16,000


def test_a_head_has_exactly_the_whole_texts_first_tokens(embedder: LocalEmbedder) -> None:
    """Cut where the tokenizer splits for certain, and given way to the whole text when it falls
    short: words longer than a slice, control characters the count splits at and the
    tokenizer drops, accents alone, CJK, every kind of space, seeded mixes of them all."""
    rng = np.random.default_rng(7)
    parts = [
        "word",
        "x" * 120,
        "é",
        "\u0301",
        "\x1c",
        "\u00a0",
        "。",
        "日本",
        "a.b",
        "\u3000",
        "naïve",
    ]
    texts = ["a\x1cb " * 3000, "\u0301 " * 2000 + "word " * 300, ("x" * 900 + "\x1f") * 16]
    for _ in range(60):
        picks = rng.integers(0, len(parts), int(rng.integers(100, 3000)))
        texts.append("".join(parts[i] + (" " if rng.random() < 0.6 else "") for i in picks))
    for text in texts:
        assert embedder._encode(text).ids == embedder._tokenizer.encode(text).ids, text[:30]
