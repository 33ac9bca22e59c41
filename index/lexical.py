"""The lexical (BM25) index: the sidecar's fallback when the embedder misses its latency budget,
and the second ranking of hybrid search.

Documents are addressed by their position in the sequence the index was built from, so doc id
``i`` is chunk ordinal ``i`` of the snapshot. Postings are stored in CSR form: the postings of
term ``t`` are ``doc_ids[indptr[t]:indptr[t + 1]]`` (ascending) with the matching ``tfs``. The
vocabulary is sorted, so term ``t`` is found by binary search: a snapshot's index is
memory-mapped and read in place (``LexicalIndex.open``), with no dictionary to build on load.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import snowballstemmer  # type: ignore[import-untyped,unused-ignore]

from index.mapped import ArraysFile, Parts, StringTable, arrays_parts, let_go

__all__ = [
    "ANALYZER",
    "DEFAULT_B",
    "DEFAULT_K1",
    "SPOKEN_STOPWORDS",
    "STOPWORDS",
    "Bm25",
    "LexicalIndex",
    "Scored",
    "analyze",
    "best",
    "convex_fusion",
    "reciprocal_rank_fusion",
]

# Names the analysis chain; it is written into every serialized index, and an index built by a
# different chain is refused at load time, because its terms would not match the query's.
ANALYZER: Final = "word-lower-stop33-snowball-english/1"

# Classic Robertson/Lucene defaults. On BEIR SciFact (bench/eval_lexical_scifact.py) they gave
# nDCG@10 0.686 against 0.680 for Anserini's k1=0.9, b=0.4.
DEFAULT_K1: Final = 1.2
# BM25's k1 is tuned in 0.5..2 (Lucene 1.2, Anserini 0.9): above 10 a term's tf barely
# saturates, and a k1 past float32's range (1e300) is inf and NaN weights; 0 is tf ignored
# and, with a tf of 0, 0/0. A file outside (0, MAX_K1] was not written by a build.
MAX_K1: Final = 10.0
_POSTINGS_BLOCK = 1 << 20  # postings checked at once: ~13 MB of temporaries
DEFAULT_B: Final = 0.75

# Lucene's (and so Anserini's) default English stopword set.
STOPWORDS: Final = frozenset(
    {
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "if",
        "in",
        "into",
        "is",
        "it",
        "no",
        "not",
        "of",
        "on",
        "or",
        "such",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "was",
        "will",
        "with",
    }
)

# Dropped from queries only, never from the index: the frames of a spoken question ("how do I",
# "can you tell me", "what's"), which otherwise rank the pages that happen to say them (an FAQ's
# "How do I ...?" headings). Dropping them at query time needs no rebuild: a term absent from the
# query adds nothing to any document's score. Wh-words, auxiliaries and modals, pronouns, request
# verbs, fillers, and the fragments ``\w+`` leaves of contractions ("what's" -> "what", "s").
# Words that are content in some bases ("like", "need", "get", "find", "show", "help") are kept.
SPOKEN_STOPWORDS: Final = frozenset(
    """
    how what when where which who whom whose why
    do does did doing done can could would should shall may might must
    am were been being have has had having
    i me my mine myself you your yours we us our he him his she her its them those
    tell know please want wanna wonder wondering
    hi hello hey um uh umm hmm ok okay so well just actually really basically
    s t m re ve ll d
    """.split()
)

_TOKEN_RE: Final = re.compile(r"\w+")
_STEMMER: Final = snowballstemmer.stemmer("english")

_KIND: Final = "voxrecall.lexical"
_VERSION: Final = 2  # 2: a memory-mapped arrays file (index/mapped.py), the vocabulary sorted
_TF_MAX: Final = int(np.iinfo(np.uint16).max)

IntArray = npt.NDArray[np.int32]
_NO_DOCS: Final[IntArray] = np.zeros(0, dtype=np.int32)
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float32]


@lru_cache(maxsize=1 << 18)
def _stem(word: str) -> str:
    if word.isdigit():  # Snowball English stems letters only: "1234" is itself (and quicker)
        return word
    stemmed: str = _STEMMER.stemWord(word)
    return stemmed


def analyze(text: str, drop: frozenset[str] = frozenset()) -> list[str]:
    """Lowercase, split into Unicode word tokens, drop stopwords (and the words in ``drop``),
    Snowball-stem (English)."""
    return [
        _stem(tok)
        for tok in _TOKEN_RE.findall(text.lower())
        if tok not in STOPWORDS and tok not in drop
    ]


class LexicalIndex:
    """An immutable BM25 index over documents ``0..n-1``.

    ``k1`` and ``b`` are scoring parameters, not part of the postings: an index can be loaded
    with other values than it was built with. The idf is Lucene's, ``log(1 + (N - df + 0.5) /
    (df + 0.5))``, which is always positive, so every matching document scores above 0.
    """

    __slots__ = (
        "_doc_ids",
        "_doc_len",
        "_idf",
        "_indptr",
        "_norm",
        "_terms",
        "_tfs",
        "avgdl",
        "b",
        "k1",
    )

    def __init__(
        self,
        terms: Sequence[str],
        indptr: npt.NDArray[np.int64],
        doc_ids: IntArray,
        tfs: npt.NDArray[np.uint16],
        doc_len: IntArray,
        *,
        k1: float = DEFAULT_K1,
        b: float = DEFAULT_B,
    ) -> None:
        """``terms`` sorted and unique, the arrays as a build writes them: those of a file are
        checked where the file is read (``_read``, ``_check_arrays``), those ``build`` makes are
        not checked again. The BM25 parameters, a caller's or a file's, are checked here."""
        if not (0.0 < k1 <= MAX_K1 and 0.0 <= b <= 1.0):  # NaN fails both
            raise ValueError(f"BM25 parameters out of range: k1={k1} (0..{MAX_K1}], b={b}")
        n_docs = len(doc_len)
        self._terms = terms
        self._indptr = indptr.astype(np.int64, copy=False)
        self._doc_ids = doc_ids.astype(np.int32, copy=False)
        self._tfs = tfs.astype(np.uint16, copy=False)
        self._doc_len = doc_len.astype(np.int32, copy=False)
        self.k1 = float(k1)
        self.b = float(b)
        self.avgdl = float(self._doc_len.mean()) if n_docs else 0.0
        # Per-document BM25 length normalisation, k1 * (1 - b + b * dl / avgdl), and per-term idf.
        avgdl = self.avgdl or 1.0
        self._norm = (self.k1 * (1.0 - self.b + self.b * self._doc_len / avgdl)).astype(np.float32)
        df = np.diff(self._indptr).astype(np.float64)
        self._idf = np.log1p((n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)

    def _term_id(self, term: str) -> int:
        """The id of ``term``, or -1 when the index does not hold it."""
        i = bisect.bisect_left(self._terms, term)
        return i if i < len(self._terms) and self._terms[i] == term else -1

    @classmethod
    def build(
        cls, texts: Iterable[str], *, k1: float = DEFAULT_K1, b: float = DEFAULT_B
    ) -> LexicalIndex:
        """Index ``texts``; the i-th text becomes doc id ``i``. The postings are gathered in
        typed arrays (4 bytes an entry, not a list's 8-byte pointer): at 1M chunks they hold
        about 100M entries until they are sorted."""
        vocab: dict[str, int] = {}
        term_ids = array("i")
        term_tfs = array("I")
        doc_terms = array("i")  # each document's number of distinct terms
        doc_len = array("i")
        for text in texts:
            tokens = analyze(text)
            doc_len.append(len(tokens))
            counts = Counter(tokens)
            for term, tf in counts.items():
                tid = vocab.get(term)
                if tid is None:
                    tid = vocab[term] = len(vocab)
                term_ids.append(tid)
                term_tfs.append(tf)
            doc_terms.append(len(counts))
        terms = sorted(vocab)
        rank = np.empty(len(vocab), dtype=np.int64)  # first-seen id -> id in sorted order
        rank[[vocab[t] for t in terms]] = np.arange(len(terms))
        del vocab
        tids = rank[np.frombuffer(term_ids, dtype=np.int32)]
        del term_ids
        # Stable sort by term keeps each term's doc ids ascending.
        order = np.argsort(tids, kind="stable")
        indptr = np.zeros(len(terms) + 1, dtype=np.int64)
        np.cumsum(np.bincount(tids, minlength=len(terms)), out=indptr[1:])
        del tids
        n_docs = len(doc_len)
        doc_of = np.repeat(np.arange(n_docs, dtype=np.int32), np.frombuffer(doc_terms, np.int32))
        doc_ids = doc_of[order]
        del doc_of
        tfs = np.minimum(np.frombuffer(term_tfs, dtype=np.uint32), _TF_MAX).astype(np.uint16)[order]
        lengths = np.frombuffer(doc_len, dtype=np.int32).copy()
        return cls(terms, indptr, doc_ids, tfs, lengths, k1=k1, b=b)

    def let_go(self) -> None:
        """Drop this process's pages of the mapped postings (``mapped.let_go``): opening the
        index read every doc id to check it; a query reads its terms' postings again."""
        let_go(self._doc_ids)

    def __len__(self) -> int:
        return len(self._doc_len)

    @property
    def vocab_size(self) -> int:
        return len(self._terms)

    def matching(self, query: str) -> IntArray:
        """The doc ids holding any of the query's terms, in no particular order: what
        ``search(query, len(self))`` returns (an idf is always positive, so every doc holding
        a term scores above 0), read from the postings without scoring."""
        return self._docs_of(t for t in map(self._term_id, analyze(query)) if t >= 0)

    def postings(self, words: Sequence[str]) -> list[IntArray]:
        """For each of ``words``, the doc ids holding any of its terms, sorted and unique (what
        ``matching`` returns, sorted): the vocabulary is read once into a dict, where one
        ``matching`` per word bisects the mapped vocabulary, decoding ~17 terms a word (a
        gazetteer looks up every word of 12,500 names at 100k chunks)."""
        ids = {term: tid for tid, term in enumerate(self._terms)}
        return [self._docs_of(ids[t] for t in analyze(word) if t in ids) for word in words]

    def _docs_of(self, term_ids: Iterable[int]) -> IntArray:
        """The doc ids holding any of the terms, sorted and unique (a term's postings are in
        ascending doc order, so one list is returned as it is)."""
        lists = [
            self._doc_ids[self._indptr[tid] : self._indptr[tid + 1]]
            for tid in dict.fromkeys(term_ids)
        ]
        if len(lists) == 1:
            return lists[0]
        return np.unique(np.concatenate(lists)) if lists else _NO_DOCS

    def search(
        self,
        query: str,
        k: int,
        allowed: BoolArray | None = None,
        *,
        drop: frozenset[str] = frozenset(),
    ) -> list[tuple[int, float]]:
        """The ``k`` best documents for ``query`` as ``(doc id, BM25 score)``, best first.

        Only documents scoring above 0 (matching at least one query term) are returned; ties
        are broken by doc id. ``allowed``, when given, is a bool mask over doc ids; documents
        where it is False are never returned. Words in ``drop`` are left out of the query
        (e.g. :data:`SPOKEN_STOPWORDS`).
        """
        return self.top(self.scores(query, drop=drop), k, allowed)

    def scores(self, query: str, *, drop: frozenset[str] = frozenset()) -> FloatArray:
        """The BM25 score of ``query`` for every document (0 where no term matches): what
        :meth:`top` ranks. A searcher scores only the matching documents (:class:`Bm25`)."""
        scores = np.zeros(len(self._doc_len), dtype=np.float32)
        for docs, weights in self.weighted(query, drop):
            # doc ids are unique within a posting list, so fancy += accumulates correctly
            scores[docs] += weights
        return scores

    def weighted(
        self, query: str, drop: frozenset[str] = frozenset()
    ) -> list[tuple[IntArray, FloatArray]]:
        """Each query term's postings and what the term adds to each of their documents' BM25
        score, in the query's term order: arrays the size of the postings, never of the base."""
        qtf = Counter(t for t in map(self._term_id, analyze(query, drop)) if t >= 0)
        k1p1 = np.float32(self.k1 + 1.0)
        out: list[tuple[IntArray, FloatArray]] = []
        for tid, count in qtf.items():
            lo, hi = int(self._indptr[tid]), int(self._indptr[tid + 1])
            docs = self._doc_ids[lo:hi]
            tf = self._tfs[lo:hi].astype(np.float32)
            weight = np.float32(self._idf[tid] * count) * k1p1
            out.append((docs, weight * tf / (tf + self._norm[docs])))
        return out

    def top(
        self, scores: FloatArray, k: int, allowed: BoolArray | None = None
    ) -> list[tuple[int, float]]:
        """The ``k`` best of ``scores`` (from :meth:`scores`) above 0, as :meth:`search`."""
        n_docs = len(self._doc_len)
        if scores.shape != (n_docs,):
            raise ValueError(f"scores must have shape ({n_docs},)")
        if allowed is not None and (allowed.dtype != np.bool_ or allowed.shape != (n_docs,)):
            raise ValueError(f"allowed must be a bool array of shape ({n_docs},)")
        cand = np.flatnonzero((scores > 0.0) if allowed is None else (scores > 0.0) & allowed)
        return best(cand, scores[cand], k)

    def to_bytes(self) -> bytes:
        """Serialize as an arrays file (``to_parts`` joined)."""
        return b"".join(self.to_parts())

    def to_parts(self) -> Parts:
        """Serialize as an arrays file (``index/mapped.py``) in pieces, as ``arrays_parts`` gives
        them: the sorted vocabulary as a string table, the postings, the document lengths; the
        analyzer and parameters in the header."""
        terms = self._terms if isinstance(self._terms, StringTable) else StringTable.of(self._terms)
        arrays = {
            **terms.arrays("vocab_"),
            "indptr": self._indptr,
            "doc_ids": self._doc_ids,
            "tfs": self._tfs,
            "doc_len": self._doc_len,
        }
        return arrays_parts(
            _KIND, arrays, version=_VERSION, analyzer=ANALYZER, k1=self.k1, b=self.b
        )

    @classmethod
    def open(cls, path: Path, *, k1: float | None = None, b: float | None = None) -> LexicalIndex:
        """Memory-map what :meth:`to_bytes` wrote and read it in place; ValueError if it is not
        that (OSError if it cannot be read)."""
        return cls._read(ArraysFile.open(path, _KIND), k1, b)

    @classmethod
    def from_bytes(
        cls, data: bytes, *, k1: float | None = None, b: float | None = None
    ) -> LexicalIndex:
        """Load what :meth:`to_bytes` wrote; ``k1``/``b`` override the stored parameters.
        ValueError for anything else (a cut or garbled file)."""
        return cls._read(ArraysFile(data, _KIND), k1, b)

    @classmethod
    def _read(cls, file: ArraysFile, k1: float | None, b: float | None) -> LexicalIndex:
        header = file.header
        if header.get("version") != _VERSION:
            raise ValueError(f"unsupported lexical index version {header.get('version')!r}")
        if header.get("analyzer") != ANALYZER:
            raise ValueError(
                f"lexical index built with analyzer {header.get('analyzer')!r}, "
                f"this code analyzes queries with {ANALYZER!r}"
            )
        stored_k1, stored_b = header.get("k1"), header.get("b")
        if type(stored_k1) is not float or type(stored_b) is not float:
            raise ValueError("lexical index parameters k1 and b are not numbers")
        terms = StringTable.read(file, "vocab_")
        indptr = file.array("indptr", "<i8")
        doc_ids = file.array("doc_ids", "<i4")
        tfs = file.array("tfs", "<u2")
        doc_len = file.array("doc_len", "<i4")
        _check_arrays(len(terms), indptr, doc_ids, tfs, doc_len)
        k1 = stored_k1 if k1 is None else k1
        return cls(terms, indptr, doc_ids, tfs, doc_len, k1=k1, b=stored_b if b is None else b)


def _check_arrays(
    n_terms: int,
    indptr: npt.NDArray[np.int64],
    doc_ids: IntArray,
    tfs: npt.NDArray[np.uint16],
    doc_len: IntArray,
) -> None:
    """A file's arrays, checked in numpy before they are trusted: no posting can index past a
    document, and no value a build never writes can leave BM25 silently empty
    (``_check_postings``). A mapped vocabulary out of order only makes lookups miss."""
    if indptr.shape != (n_terms + 1,) or int(indptr[0]) != 0:
        raise ValueError("indptr does not match the vocabulary")
    if doc_ids.shape != tfs.shape or doc_ids.shape != (int(indptr[-1]),):
        raise ValueError("postings do not match indptr")
    if np.any(np.diff(indptr) < 0):
        raise ValueError("indptr is not monotonic")
    n_docs = len(doc_len)
    if doc_ids.size and (int(doc_ids.min()) < 0 or int(doc_ids.max()) >= n_docs):
        raise ValueError("posting doc id out of range")
    _check_postings(indptr, doc_ids, tfs, doc_len)


def _check_postings(
    indptr: npt.NDArray[np.int64], doc_ids: IntArray, tfs: npt.NDArray[np.uint16], doc_len: IntArray
) -> None:
    """What a build writes and the scorer relies on, in numpy over the (mapped) arrays, a block
    of postings at a time: every tf at least 1 (a tf of 0 with k1 gives 0/0, NaN weights), every
    document with postings at least 1 long, doc ids strictly ascending within each posting list
    (``scores`` adds with fancy ``+=``, right only for unique ids; a list of duplicates has
    df > N and a negative idf). Each of these made the lexical fallback answer nothing, silently
    (s12's F8)."""
    if np.any(doc_len < 0):
        raise ValueError("a document length is negative")
    starts = np.zeros(len(doc_ids), dtype=np.bool_)  # True where a posting list begins
    firsts = indptr[:-1][np.diff(indptr) > 0]
    starts[firsts] = True
    for lo in range(0, len(doc_ids), _POSTINGS_BLOCK):
        hi = min(len(doc_ids), lo + _POSTINGS_BLOCK)
        docs = doc_ids[lo:hi]
        if int(tfs[lo:hi].min()) < 1:
            raise ValueError("a posting's term frequency is 0")
        if int(doc_len[docs].min()) < 1:
            raise ValueError("a document with postings has length 0")
        pairs = doc_ids[lo : hi + 1]  # the block and the posting after it
        rising = pairs[1:] > pairs[:-1]  # no temporary wider than the ids (np.diff: 40x slower)
        if not np.all(rising | starts[lo + 1 : lo + len(pairs)]):
            raise ValueError("doc ids are not strictly ascending within a posting list")


def best(
    docs: npt.NDArray[np.int64] | IntArray, scores: FloatArray, k: int
) -> list[tuple[int, float]]:
    """The ``k`` best ``(doc, score)`` of parallel arrays (docs unique), best first, ties broken
    by doc id."""
    if k <= 0:
        return []
    if docs.size > k:
        # keep everything tied with the k-th score so the tie-break by doc id is exact
        kth = np.partition(scores, docs.size - k)[docs.size - k]
        keep = scores >= kth
        docs, scores = docs[keep], scores[keep]
    order = np.lexsort((docs, -scores))[:k]
    return [(int(d), float(s)) for d, s in zip(docs[order], scores[order], strict=True)]


class Scored:
    """One query's BM25 scores, sparse: the documents matching a term (each once, in no
    particular order) and their scores, all above 0."""

    __slots__ = ("docs", "scores")

    def __init__(self, docs: IntArray, scores: FloatArray) -> None:
        self.docs = docs
        self.scores = scores

    def top(self, k: int, keep: BoolArray | None = None) -> list[tuple[int, float]]:
        """The ``k`` best, as :meth:`LexicalIndex.search`; ``keep`` (parallel to ``docs``)
        leaves out the documents where it is False."""
        if keep is None:
            return best(self.docs, self.scores, k)
        return best(self.docs[keep], self.scores[keep], k)


# Past postings of 1 / DENSE_POSTINGS of the base's documents, a query's matches are found by one
# scan of the buffer rather than by de-duplicating its postings (random access, several passes).
DENSE_POSTINGS = 4


class Bm25:
    """BM25 over one :class:`LexicalIndex` that never allocates or scans an array the size of
    the base per query: the scores accumulate in a buffer kept for the index's life, and only
    the matching documents are read back (and the buffer zeroed there again).

    One query at a time uses the buffers (a sidecar ranks on its event loop); a second one at
    the same moment (another thread) scores in buffers of its own rather than wait.
    """

    __slots__ = ("_lock", "_sums", "_where", "index")

    def __init__(self, index: LexicalIndex) -> None:
        self.index = index
        self._sums = np.zeros(len(index), dtype=np.float32)  # zero between queries
        self._where = np.zeros(len(index), dtype=np.int32)  # scratch: read only where written
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return int(self._sums.nbytes + self._where.nbytes)

    def score(
        self,
        query: str,
        *,
        drop: frozenset[str] = frozenset(),
        at: npt.NDArray[np.int64] | None = None,
    ) -> tuple[Scored, FloatArray]:
        """The matching documents' scores, and the scores of the documents ``at`` (0 where no
        term matches): what hybrid ranking reads for the dense side's candidates."""
        parts = self.index.weighted(query, drop)
        at = np.zeros(0, dtype=np.int64) if at is None else at
        if not self._lock.acquire(blocking=False):  # another thread is scoring: our own buffers
            n = len(self.index)
            sums, where = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.int32)
            return _accumulate(parts, sums, where, at)
        try:
            return _accumulate(parts, self._sums, self._where, at)
        finally:
            self._lock.release()


def _accumulate(
    parts: list[tuple[IntArray, FloatArray]],
    sums: FloatArray,
    where: IntArray,
    at: npt.NDArray[np.int64],
) -> tuple[Scored, FloatArray]:
    """Sum ``parts`` in ``sums`` (zero before and after), in the order ``LexicalIndex.scores``
    sums them, so the scores are the same to the bit."""
    for docs, weights in parts:
        sums[docs] += weights  # unique within a posting list
    postings = sum(d.size for d, _ in parts)
    dense = len(parts) > 1 and postings * DENSE_POSTINGS >= sums.size
    if not parts:
        docs = np.zeros(0, dtype=np.int32)
    elif len(parts) == 1:
        docs = parts[0][0]
    elif dense:  # the postings cover much of the base: one scan finds the matches faster
        docs = np.flatnonzero(sums).astype(np.int32)  # every match sums above 0
    else:
        docs = _distinct(np.concatenate([d for d, _ in parts]), where)
    scored = Scored(docs, sums[docs])
    at_scores = sums[at]
    if dense:
        sums.fill(0.0)
    else:
        sums[docs] = 0.0
    return scored, at_scores


def _distinct(docs: IntArray, where: IntArray) -> IntArray:
    """``docs`` with each repeated id once, in linear time: every occurrence writes its position
    into ``where`` and the one whose position stuck is kept (whichever numpy let win)."""
    positions = np.arange(docs.size, dtype=np.int32)
    where[docs] = positions
    kept: IntArray = docs[where[docs] == positions]
    return kept


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], k: int = 60, limit: int | None = None
) -> list[tuple[int, float]]:
    """Fuse rankings (doc ids, best first) by RRF: ``score(d) = sum 1 / (k + rank_d)``, rank from 1.

    A doc repeated within one ranking counts at its first position only. Ties are broken by the
    best single rank, then by doc id.
    """
    if k < 0:
        raise ValueError("k must be >= 0")
    if limit is not None and limit <= 0:
        return []
    scores: dict[int, float] = {}
    best: dict[int, int] = {}
    for ranking in rankings:
        seen: set[int] = set()
        for rank, doc in enumerate(ranking, start=1):
            if doc in seen:
                continue
            seen.add(doc)
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
            if rank < best.get(doc, math.inf):
                best[doc] = rank
    fused = sorted(scores.items(), key=lambda item: (-item[1], best[item[0]], item[0]))
    return fused if limit is None else fused[:limit]


def convex_fusion(
    runs: Sequence[Mapping[int, float]], weights: Sequence[float] | None = None
) -> list[tuple[int, float]]:
    """Fuse scored runs by a convex combination of min-max-normalised scores, best first.

    ``score(d) = sum_i w_i * (s_i(d) - min_i) / (max_i - min_i)`` (Bruch et al. 2023, "An
    Analysis of Fusion Functions for Hybrid Retrieval": it beats reciprocal rank fusion, which
    throws the scores' gaps away). Each run maps doc -> score; a doc missing from a run gets 0
    from it, as if it scored that run's minimum. A run whose scores are all equal cannot tell
    its docs apart: each gets 1. ``weights`` (default equal) are non-negative and sum to 1, so
    fused scores lie in [0, 1]. Ties keep the order of first appearance: the first run's
    insertion order, then the next run's new docs.
    """
    if weights is None:
        weights = [1.0 / len(runs)] * len(runs) if runs else []
    if len(weights) != len(runs):
        raise ValueError(f"{len(weights)} weights for {len(runs)} runs")
    if any(w < 0 or not math.isfinite(w) for w in weights) or (
        runs and not math.isclose(math.fsum(weights), 1.0)
    ):
        raise ValueError(f"weights must be non-negative and sum to 1: {list(weights)}")
    fused = {doc: 0.0 for run in runs for doc in run}
    for run, weight in zip(runs, weights, strict=True):
        if not run:
            continue
        if not all(math.isfinite(s) for s in run.values()):
            raise ValueError("scores must be finite")
        lo, hi = min(run.values()), max(run.values())
        for doc, s in run.items():
            fused[doc] += weight * ((s - lo) / (hi - lo) if hi > lo else 1.0)
    return sorted(fused.items(), key=lambda item: -item[1])  # stable: ties keep their order
