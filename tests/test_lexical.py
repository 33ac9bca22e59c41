from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import index.lexical as index_lexical
from index.lexical import (
    ANALYZER,
    SPOKEN_STOPWORDS,
    LexicalIndex,
    analyze,
    convex_fusion,
    reciprocal_rank_fusion,
)

DOCS = [
    "The cat runs across the garden every morning.",  # 0
    "Dogs are loyal companions and love long walks.",  # 1
    "Our refund policy allows returns within 30 days of purchase.",  # 2
    "The runner was running a marathon in Berlin.",  # 3
    "Cats and dogs: a guide to the common household pets.",  # 4
    "Shipping takes 5 business days; express shipping costs extra.",  # 5
]


@pytest.fixture(scope="module")
def index() -> LexicalIndex:
    return LexicalIndex.build(DOCS)


def ids(hits: list[tuple[int, float]]) -> list[int]:
    return [doc for doc, _ in hits]


def test_analyze_lowercases_stems_and_drops_stopwords() -> None:
    assert analyze("The Cats are RUNNING to the garden") == ["cat", "run", "garden"]
    assert analyze("running") == analyze("runs") == ["run"]
    assert analyze("30 days, 2024-05") == ["30", "day", "2024", "05"]
    assert analyze("Café naïve Straße") == ["café", "naïv", "straße"]
    assert analyze("") == []
    assert analyze("the of and to") == []


def test_stemming_matches_inflections(index: LexicalIndex) -> None:
    # "running" is stemmed to "run" and finds doc 0 ("runs") as well as doc 3 ("running")
    found = ids(index.search("running", 10))
    assert set(found) == {0, 3}
    assert set(ids(index.search("returned purchases", 10))) == {2}


def test_stopwords_are_ignored(index: LexicalIndex) -> None:
    assert index.search("the and a of", 10) == []
    # adding stopwords to a query changes nothing
    assert index.search("the refund of a purchase", 10) == index.search("refund purchase", 10)


def test_spoken_stopwords_leave_the_query_only() -> None:
    faq = [
        "How do I reset my password? Can you tell me what to do?",  # 0: a page of question frames
        "Password reset: open Settings, then Security.",  # 1: the answer
    ]
    idx = LexicalIndex.build(faq)
    question = "Um, can you tell me how do I reset my password?"
    # the frames outweigh the content words with Lucene's stopwords alone
    assert ids(idx.search(question, 2)) == [0, 1]
    spoken = idx.search(question, 2, drop=SPOKEN_STOPWORDS)
    assert spoken == idx.search("reset password", 2)
    assert ids(spoken) == [1, 0]  # the same content words, in the shorter page
    # never at index time: the frames stay searchable, the analyzer (and snapshots) unchanged
    assert ids(idx.search("what to do", 2)) == [0]
    assert analyze("what's it about", SPOKEN_STOPWORDS) == ["about"]
    assert idx.search("what is it", 2, drop=SPOKEN_STOPWORDS) == []


def test_scores_and_top_are_search_in_two_steps(index: LexicalIndex) -> None:
    allowed = np.array([True, False, True, True, True, True])
    for query in ["running", "cats dogs", "refund 30 days", "nothing here", ""]:
        scores = index.scores(query)
        assert scores.shape == (len(index),)
        assert index.top(scores, 10) == index.search(query, 10)
        assert index.top(scores, 10, allowed) == index.search(query, 10, allowed)
        found = dict(index.search(query, 10))
        assert all(scores[d] == pytest.approx(found.get(d, 0.0)) for d in range(len(index)))
    with pytest.raises(ValueError, match="shape"):
        index.top(np.zeros(len(index) + 1, dtype=np.float32), 3)


@pytest.mark.parametrize("query", ["cats", "running dogs", "the cats and the dogs", "zebra", ""])
def test_matching_is_every_doc_search_scores(index: LexicalIndex, query: str) -> None:
    found = {label for label, _ in index.search(query, len(index))}
    assert set(index.matching(query).tolist()) == found


def test_postings_are_each_words_matching_docs_sorted(index: LexicalIndex) -> None:
    words = ["cats", "running", "the", "zebra", "wi-fi", "2024", "dogs"]
    mapped = LexicalIndex.from_bytes(index.to_bytes())  # the vocabulary read from a mapped table
    for idx in (index, mapped):
        found = idx.postings(words)
        assert [f.tolist() for f in found] == [sorted(set(idx.matching(w).tolist())) for w in words]
    assert found[0].size
    assert not found[3].size  # a word no doc holds


def test_a_number_stems_to_itself() -> None:
    assert analyze("room 1204 and 42nd street") == ["room", "1204", "42nd", "street"]


def test_bm25_prefers_the_rarer_term() -> None:
    docs = [
        "apple banana",
        "apple cherry",
        "apple durian",
        "apple elderberry",
    ]
    idx = LexicalIndex.build(docs)
    hits = idx.search("apple cherry", 4)
    # every doc has "apple", only doc 1 has the rare "cherry"
    assert hits[0][0] == 1
    assert hits[0][1] > hits[1][1]
    assert set(ids(hits)) == {0, 1, 2, 3}
    assert all(score > 0 for _, score in hits)


def test_scores_are_sorted_and_k_limits(index: LexicalIndex) -> None:
    hits = index.search("cats dogs running", 10)
    scores = [s for _, s in hits]
    assert scores == sorted(scores, reverse=True)
    assert ids(index.search("cats dogs running", 2)) == ids(hits)[:2]
    assert index.search("cats", 0) == []


def test_bm25_score_matches_formula() -> None:
    docs = ["alpha beta beta", "gamma", "alpha gamma delta epsilon"]
    idx = LexicalIndex.build(docs, k1=1.2, b=0.75)
    n, avgdl = 3, (3 + 1 + 4) / 3

    def term(tf: float, df: int, dl: int) -> float:
        idf = np.log(1 + (n - df + 0.5) / (df + 0.5))
        return float(idf * tf * 2.2 / (tf + 1.2 * (1 - 0.75 + 0.75 * dl / avgdl)))

    hits = dict(idx.search("beta alpha", 3))
    assert hits[0] == pytest.approx(term(2, 1, 3) + term(1, 2, 3), rel=1e-5)
    assert hits[2] == pytest.approx(term(1, 2, 4), rel=1e-5)
    assert 1 not in hits


def test_allowed_mask_excludes_docs(index: LexicalIndex) -> None:
    allowed = np.ones(len(index), dtype=np.bool_)
    allowed[3] = False
    assert ids(index.search("running", 10, allowed)) == [0]
    assert index.search("running", 10, np.zeros(len(index), dtype=np.bool_)) == []
    with pytest.raises(ValueError, match="bool array"):
        index.search("running", 10, np.ones(len(index) + 1, dtype=np.bool_))
    with pytest.raises(ValueError, match="bool array"):
        index.search("running", 10, np.ones(len(index), dtype=np.int8))


def test_empty_and_unknown_queries_return_nothing(index: LexicalIndex) -> None:
    assert index.search("", 5) == []
    assert index.search("   ,;!  ", 5) == []
    assert index.search("zyzzyva quokka", 5) == []
    # unknown terms do not disturb the known ones
    assert index.search("zyzzyva refund", 5) == index.search("refund", 5)


def test_empty_index() -> None:
    idx = LexicalIndex.build([])
    assert len(idx) == 0
    assert idx.search("anything", 5) == []
    again = LexicalIndex.from_bytes(idx.to_bytes())
    assert len(again) == 0
    assert again.search("anything", 5) == []


def test_len_counts_docs_including_empty_ones() -> None:
    idx = LexicalIndex.build(["", "the of", "real words"])
    assert len(idx) == 3
    assert ids(idx.search("words", 5)) == [2]


def test_round_trip_gives_identical_results(index: LexicalIndex) -> None:
    data = index.to_bytes()
    again = LexicalIndex.from_bytes(data)
    assert len(again) == len(index)
    assert again.vocab_size == index.vocab_size
    assert (again.k1, again.b, again.avgdl) == (index.k1, index.b, index.avgdl)
    allowed = np.array([True, False, True, True, True, True])
    for query in ["running", "cats dogs", "shipping days", "refund 30 days", "nothing here"]:
        assert again.search(query, 10) == index.search(query, 10)
        assert again.search(query, 10, allowed) == index.search(query, 10, allowed)
    assert again.to_bytes() == data


def test_from_bytes_can_override_parameters(index: LexicalIndex) -> None:
    other = LexicalIndex.from_bytes(index.to_bytes(), k1=0.9, b=0.4)
    assert (other.k1, other.b) == (0.9, 0.4)
    assert other.search("cats dogs", 5) == LexicalIndex.build(DOCS, k1=0.9, b=0.4).search(
        "cats dogs", 5
    )
    assert other.search("cats dogs", 5) != index.search("cats dogs", 5)


def test_from_bytes_rejects_garbage_and_other_analyzers(index: LexicalIndex) -> None:
    with pytest.raises(ValueError, match="not a voxrecall"):
        LexicalIndex.from_bytes(b"PK\x03\x04 something else")
    data = index.to_bytes()
    tampered = data.replace(ANALYZER.encode(), ANALYZER.encode()[:-1] + b"9")
    with pytest.raises(ValueError, match="analyzer"):
        LexicalIndex.from_bytes(tampered)


def test_rrf_orders_by_fused_rank() -> None:
    fused = reciprocal_rank_fusion([[1, 2, 3], [3, 2, 4]], k=60)
    # 3 is first and third (1/61 + 1/63 edges out 2/62), 2 is second in both,
    # 1 is only first once, 4 only third once
    assert ids(fused) == [3, 2, 1, 4]
    scores = dict(fused)
    assert scores[3] == pytest.approx(1 / 61 + 1 / 63)
    assert scores[2] == pytest.approx(2 / 62)
    assert scores[1] == pytest.approx(1 / 61)
    assert ids(reciprocal_rank_fusion([[1, 2, 3], [3, 2, 4]], limit=2)) == [3, 2]
    # agreement between rankings beats a single first place
    assert ids(reciprocal_rank_fusion([[10, 20, 30], [30, 40, 20], [20, 50]]))[0] == 20
    # a small k rewards top ranks more: with k=0, 1's single first place (1/1) ties 2's 1/2 + 1/2
    # and wins the tie on its better single rank
    assert ids(reciprocal_rank_fusion([[1, 2, 3], [3, 2, 4]], k=0)) == [3, 1, 2, 4]


def test_rrf_edge_cases() -> None:
    assert reciprocal_rank_fusion([]) == []
    assert reciprocal_rank_fusion([[], []]) == []
    assert reciprocal_rank_fusion([[5, 6]], limit=0) == []
    # a single ranking keeps its order; duplicates count once at their first position
    assert ids(reciprocal_rank_fusion([[7, 5, 7, 6]])) == [7, 5, 6]
    # a tie is broken by the better single rank: 8 and 9 both score 1/61 + 1/62
    assert ids(reciprocal_rank_fusion([[8, 9], [9, 8]])) == [8, 9]


# -- convex fusion ---------------------------------------------------------------------------


def test_convex_fusion_min_max_normalises_each_run() -> None:
    dense = {1: 0.9, 2: 0.5, 3: 0.1}  # normalised: 1, 0.5, 0
    bm25 = {3: 20.0, 4: 10.0, 1: 0.0}  # normalised: 1, 0.5, 0
    fused = dict(convex_fusion([dense, bm25]))
    assert fused == pytest.approx({1: 0.5, 2: 0.25, 3: 0.5, 4: 0.25})
    assert ids(convex_fusion([dense, bm25])) == [1, 3, 2, 4]  # ties: order of first appearance
    weighted = dict(convex_fusion([dense, bm25], [0.25, 0.75]))
    assert weighted[3] == pytest.approx(0.75)
    assert weighted[1] == pytest.approx(0.25)
    # the gaps count, not only the ranks: dense is sure of 1, BM25 barely prefers 2 to it
    runs = [{1: 0.9, 2: 0.2, 3: 0.1}, {2: 5.0, 3: 4.9, 1: 4.8, 4: 0.0}]
    assert ids(convex_fusion(runs))[0] == 1
    assert ids(reciprocal_rank_fusion([list(run) for run in runs]))[0] == 2


def test_convex_fusion_degenerate_inputs() -> None:
    assert convex_fusion([]) == []
    assert convex_fusion([{}, {}]) == []
    # one run empty: the other decides, every doc kept
    assert ids(convex_fusion([{7: 0.2, 8: 0.9}, {}])) == [8, 7]
    # a run of equal scores cannot tell its docs apart: 1 each, so the other run decides
    assert ids(convex_fusion([{1: 0.5, 2: 0.5, 3: 0.5}, {3: 2.0, 2: 1.0, 1: 0.0}])) == [3, 2, 1]
    assert convex_fusion([{4: -3.0}]) == [(4, 1.0)]
    # a doc one run lacks gets 0 from it, below that run's present docs
    assert ids(convex_fusion([{1: 0.5, 2: 0.5}, {2: 1.0}])) == [2, 1]
    for bad in ([0.7, 0.7], [1.5, -0.5], [1.0]):
        with pytest.raises(ValueError, match="weights"):
            convex_fusion([{1: 1.0}, {1: 1.0}], bad)
    with pytest.raises(ValueError, match="finite"):
        convex_fusion([{1: float("nan"), 2: 0.0}])


_runs = st.lists(
    st.dictionaries(
        st.integers(0, 12),
        st.floats(-50, 50, allow_nan=False, allow_infinity=False, width=32),
        min_size=1,
        max_size=10,
    ),
    min_size=1,
    max_size=3,
)


@given(runs=_runs, data=st.data())
def test_convex_fusion_is_monotone_and_bounded(
    runs: list[dict[int, float]], data: st.DataObject
) -> None:
    fused = convex_fusion(runs)
    assert sorted(ids(fused)) == sorted({d for run in runs for d in run})
    assert all(-1e-9 <= s <= 1 + 1e-9 for _, s in fused)
    assert [s for _, s in fused] == sorted((s for _, s in fused), reverse=True)
    # raising one doc's score in one run never lowers it against any other doc
    i = data.draw(st.integers(0, len(runs) - 1))
    doc = data.draw(st.sampled_from(sorted(runs[i])))
    raised = [dict(run) for run in runs]
    raised[i][doc] += data.draw(st.floats(0.0, 100.0, width=32))
    before, after = dict(fused), dict(convex_fusion(raised))
    for other in before:
        assert after[doc] - after[other] >= before[doc] - before[other] - 1e-9


def _arrays(index: LexicalIndex) -> dict[str, Any]:
    return {
        "terms": [index._terms[i] for i in range(len(index._terms))],
        "indptr": np.array(index._indptr),
        "doc_ids": np.array(index._doc_ids),
        "tfs": np.array(index._tfs),
        "doc_len": np.array(index._doc_len),
    }


def _doubled(arrays: dict[str, Any]) -> dict[str, Any]:
    """Every posting listed twice in its own list (df > N: a negative idf)."""
    indptr = arrays["indptr"]
    spans = list(itertools.pairwise(indptr.tolist()))
    return {
        **arrays,
        "indptr": np.concatenate([[0], np.cumsum(np.diff(indptr) * 2)]).astype(np.int64),
        "doc_ids": np.concatenate([np.tile(arrays["doc_ids"][a:z], 2) for a, z in spans]),
        "tfs": np.concatenate([np.tile(arrays["tfs"][a:z], 2) for a, z in spans]),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "k1": 0.0}, "k1=0.0"),
        (lambda a: {**a, "k1": 1e300}, "k1=1e"),
        (lambda a: {**a, "k1": float("nan")}, "k1=nan"),
        (lambda a: {**a, "tfs": np.zeros_like(a["tfs"])}, "term frequency is 0"),
        (lambda a: {**a, "doc_len": np.zeros_like(a["doc_len"])}, "has length 0"),
        (lambda a: {**a, "doc_len": -a["doc_len"]}, "negative"),
        (_doubled, "strictly ascending"),
    ],
)
def test_values_that_leave_bm25_silently_empty_are_refused_by_name(
    index: LexicalIndex, change: Any, message: str
) -> None:
    """s12's F8: each loaded, then NaN or negative weights made the lexical fallback answer []."""
    arrays = change({**_arrays(index), "k1": index.k1})
    k1 = arrays.pop("k1")
    with pytest.raises(ValueError, match=message):
        _loaded(arrays, k1=k1, b=index.b)
    built = _loaded(_arrays(index), k1=index.k1, b=index.b)  # the unchanged ones load
    assert built.search("cats dogs", 5) == index.search("cats dogs", 5)


def _loaded(arrays: dict[str, Any], **parameters: float) -> LexicalIndex:
    """``arrays`` written to a file and read back: where a snapshot's are checked."""
    return LexicalIndex.from_bytes(LexicalIndex(**arrays, **parameters).to_bytes())


def test_a_build_does_not_check_again_the_postings_it_wrote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checks are where a file's arrays come in, not in ``build``, which made them."""
    monkeypatch.setattr(index_lexical, "_check_postings", lambda *_: pytest.fail("checked"))
    built = LexicalIndex.build(["cats and dogs", "dogs chase cats"])
    assert built.search("cats", 2)
    with pytest.raises(pytest.fail.Exception, match="checked"):
        LexicalIndex.from_bytes(built.to_bytes())


def test_duplicate_doc_ids_are_found_across_a_block_boundary(
    index: LexicalIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The postings are checked a block at a time: a pair split by a block's edge is seen."""
    arrays = _doubled(_arrays(index))
    monkeypatch.setattr(index_lexical, "_POSTINGS_BLOCK", 1)
    with pytest.raises(ValueError, match="strictly ascending"):
        _loaded(arrays, k1=index.k1, b=index.b)
    _loaded(_arrays(index), k1=index.k1, b=index.b)
