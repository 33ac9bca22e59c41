"""An agent's naming heard through a recogniser: a name said by one of its words, the rest
misheard ("sala find" of Sala Thong), is tracked where that word is the name's alone; an
ordinary word of a name, a street's name, or a word beside a name said whole is not
(``sidecar.turn.followups.NameWords``); a name run into the short word before it
("thegardenia") is heard as the name, and a partial name after a street word ("clifton way
cherry hinton") is an address's area, not a name. Each through ``run_turns`` on a base built here."""

from __future__ import annotations

from pathlib import Path

from sidecar.turn.followups import Source
from tests.turns import run_turns

PLACES = {
    "SALA THONG": [
        "Sala Thong serves Thai food by the river, with a long list of beers.",
        "Sala Thong is an expensive restaurant in the west of town.",
    ],
    "BANGKOK CITY": [
        "Bangkok City serves Thai curries in the centre, next to the tram stop.",
        "Bangkok City has a small garden and no beer.",
    ],
    "CITY STOP RESTAURANT": [
        "City Stop Restaurant serves European food in the north.",
        "City Stop Restaurant has a wine list and a terrace.",
    ],
    "HARBOR GRILL": [
        "Harbor Grill is a short walk from the bus stop, with fish on the menu.",
        "Harbor Grill takes reservations online.",
    ],
    "THE GARDENIA": [
        "The Gardenia serves Mediterranean food and falafel.",
        "The Gardenia is a cheap restaurant in the centre.",
    ],
    "FRANKIE AND BENNYS": [
        "Frankie and Bennys serves Italian food in the south, with a view of the park.",
        "Frankie and Bennys is expensive.",
    ],
    "PIZZA HUT CHERRY HINTON": [
        "Pizza Hut Cherry Hinton serves pizza in the south.",
        "Pizza Hut Cherry Hinton has a salad bar.",
    ],
    "PIZZA HUT CITY CENTRE": [
        "Pizza Hut City Centre serves pizza in the centre.",
        "Pizza Hut City Centre is cheap.",
    ],
    "SAINT JOHNS CHOP HOUSE": [
        "Saint Johns Chop House serves British food and steaks.",
        "Saint Johns Chop House has a quiet dining room upstairs.",
    ],
}


async def test_an_agents_naming_with_one_word_misheard_is_tracked(tmp_path: Path) -> None:
    results = await run_turns(
        PLACES,
        [
            ("user", "is there a thai restaurant in the west"),
            ("agent", "hmm yes there is sala find which is an expensive restaurant"),
            ("user", "do they have a big beer selection there"),
        ],
        tmp_path,
    )
    assert results[-1].followup.source == Source.ENTITY
    assert results[-1].followup.used == "SALA THONG"
    assert results[-1].query == "SALA THONG: do they have a big beer selection there"


async def test_an_agents_naming_run_into_the_word_before_is_tracked(tmp_path: Path) -> None:
    results = await run_turns(
        PLACES,
        [
            ("user", "a cheap mediterranean restaurant please"),
            ("agent", "thegardenia is located in the centre"),
            ("user", "do they serve falafel"),
        ],
        tmp_path,
    )
    assert results[-1].followup.used == "THE GARDENIA"


async def test_an_ordinary_word_of_a_name_is_not_a_naming(tmp_path: Path) -> None:
    # "stop" is City Stop Restaurant's alone among the names, but other places' chunks say it
    results = await run_turns(
        PLACES,
        [
            ("user", "i would like european food in the north"),
            ("agent", "the ci two stop place is in that area"),
            ("user", "do they serve alcohol"),
        ],
        tmp_path,
    )
    assert results[-1].followup.used != "CITY STOP RESTAURANT"


async def test_a_streets_name_and_a_word_beside_a_whole_name_name_nothing(tmp_path: Path) -> None:
    results = await run_turns(
        PLACES,
        [
            ("user", "where is the harbor grill"),
            ("agent", "harbor grill is at fifty six saint barnabas road"),
            ("user", "do they take reservations"),
            ("agent", "sala find is full tonight but harbor grill takes reservations online"),
            ("user", "is it open late"),
        ],
        tmp_path,
    )
    assert results[2].followup.used == "HARBOR GRILL"  # "saint ... road" is an address
    assert results[4].followup.used == "HARBOR GRILL"  # a name said whole wins over a word


async def test_an_area_after_a_street_is_an_address(tmp_path: Path) -> None:
    # "cherry hinton" names Pizza Hut Cherry Hinton where two Pizza Huts share the rest; after
    # "clifton way" it is the area of an address, and "frankie" names the place offered
    results = await run_turns(
        PLACES,
        [
            ("user", "an expensive italian restaurant in the south please"),
            (
                "agent",
                "frankie and time nys is at cambridge leisure park clifton way cherry hinton",
            ),
            ("user", "do they have a nice view"),
        ],
        tmp_path,
    )
    assert results[-1].followup.used == "FRANKIE AND BENNYS"


async def test_a_name_too_long_to_be_one_is_not_named_by_its_words(tmp_path: Path) -> None:
    """A name of more than WORD_NAME_TOKENS tokens (a hostile snapshot's 10 MB of names took
    29 s and 400 MB to rate) is not looked up by its words; the same word in a real name is."""
    filler = " ".join(f"word{i}" for i in range(30))
    places = {
        **PLACES,
        f"ZANZIBARQUE {filler}": ["Zanzibarque serves grilled fish by the harbour."],
        "QUETZALCOATL CANTINA": ["Quetzalcoatl Cantina serves Mexican food."],
    }
    for word, tracked in (("zanzibarque", False), ("quetzalcoatl", True)):
        results = await run_turns(
            places,
            [
                ("user", "somewhere for dinner"),
                ("agent", f"hmm yes there is {word} tinna which is near the harbour"),
                ("user", "do they take reservations"),
            ],
            tmp_path / word,
        )
        assert (results[-1].followup.source == Source.ENTITY) is tracked, word


async def test_an_agents_naming_with_a_hesitation_inside_is_tracked(tmp_path: Path) -> None:
    # every word of Pizza Hut City Centre is another name's too: only the whole name names it
    results = await run_turns(
        PLACES,
        [
            ("user", "somewhere cheap for pizza"),
            ("agent", "pizza hut city uh centre is cheap"),
            ("user", "is it busy at lunch"),
        ],
        tmp_path,
    )
    assert results[-1].followup.used == "PIZZA HUT CITY CENTRE"


async def test_a_names_words_in_an_address_name_nothing_alone(tmp_path: Path) -> None:
    # "cherry" is Pizza Hut Cherry Hinton's alone, but after "clifton way" it is an address's
    results = await run_turns(
        PLACES,
        [
            ("user", "an expensive italian restaurant in the south please"),
            ("agent", "frankie and bennys is in the south"),
            ("user", "what is the address"),
            ("agent", "the address is cambridge leisure park clifton way cherry hinton"),
            ("user", "do they have a nice view"),
        ],
        tmp_path,
    )
    assert results[-1].followup.used == "FRANKIE AND BENNYS"


async def test_a_whole_name_a_longer_name_holds_is_a_naming(tmp_path: Path) -> None:
    """NANDOS said whole by the agent names it, though NANDOS CITY CENTRE's chunks say "nandos"
    more often than its own do: they say it as their own name."""
    places = {
        **PLACES,
        "NANDOS": [
            "Nandos serves Portuguese chicken in the south.",
            "Nandos is cheap and has a terrace.",
        ],
        "NANDOS CITY CENTRE": [
            "Nandos City Centre serves Portuguese chicken in the centre.",
            "Nandos City Centre is cheap.",
            "Nandos City Centre has no terrace.",
            "Nandos City Centre opens at noon.",
        ],
    }
    results = await run_turns(
        places,
        [
            ("user", "a cheap portuguese restaurant in the south"),
            ("agent", "nandos is a cheap portuguese restaurant in the south"),
            ("user", "do they have good beer"),
        ],
        tmp_path,
    )
    assert results[-1].followup.used == "NANDOS"


async def test_an_agents_naming_without_its_inner_function_words_is_tracked(
    tmp_path: Path,
) -> None:
    # "and" unheard: "a b guesthouse" is A and B Guest House, "guest house" two names' words
    places = {
        **PLACES,
        "A AND B GUEST HOUSE": [
            "A and B Guest House is a moderately priced guesthouse in the east.",
            "A and B Guest House has free wifi.",
        ],
        "BRIDGE GUEST HOUSE": [
            "Bridge Guest House is a guesthouse in the south.",
            "Bridge Guest House has free parking.",
        ],
    }
    results = await run_turns(
        places,
        [
            ("user", "a moderately priced place to stay with wifi"),
            ("agent", "i have the a b guesthouse that has wifi and is moderately priced"),
            ("user", "do they have a good view"),
        ],
        tmp_path,
    )
    assert results[-1].followup.used == "A AND B GUEST HOUSE"
