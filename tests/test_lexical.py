from __future__ import annotations

import numpy as np
import pytest

from index.lexical import (
    ANALYZER,
    LexicalIndex,
    analyze,
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
