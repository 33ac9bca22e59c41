"""The character encodings a web page may name (``<meta charset>``, ``Content-Type: ...;
charset=``): the one place ``html`` and ``url`` pages are decoded.

Only the encodings of the WHATWG Encoding Standard (https://encoding.spec.whatwg.org/) are
read, by their labels there, each with the Python codec that decodes it as a browser does. A page
naming anything else (``punycode``, ``unicode_escape``, ``utf-7``, the standard's
``replacement`` labels, a name Python does not know) is skipped with the charset it named: every
Python codec decodes, and some decode hostile bytes into text no page holds (lone surrogates,
which stopped the whole build) or in time quadratic in the page (``punycode``: hours for 8 MiB).
Every codec below reads a page in linear time.
"""

from __future__ import annotations

import codecs

__all__ = ["CharsetError", "decode_web", "web_codec"]

# Python codec -> the WHATWG labels of the encoding it decodes (the standard's "replacement"
# labels and x-user-defined are left out: they have no text to give).
_LABELS = {
    "utf-8": "unicode-1-1-utf-8 unicode11utf8 unicode20utf8 utf-8 utf8 x-unicode20utf8",
    "cp866": "866 cp866 csibm866 ibm866",
    "iso8859_2": "csisolatin2 iso-8859-2 iso-ir-101 iso8859-2 iso88592 iso_8859-2 "
    "iso_8859-2:1987 l2 latin2",
    "iso8859_3": "csisolatin3 iso-8859-3 iso-ir-109 iso8859-3 iso88593 iso_8859-3 "
    "iso_8859-3:1988 l3 latin3",
    "iso8859_4": "csisolatin4 iso-8859-4 iso-ir-110 iso8859-4 iso88594 iso_8859-4 "
    "iso_8859-4:1988 l4 latin4",
    "iso8859_5": "csisolatincyrillic cyrillic iso-8859-5 iso-ir-144 iso8859-5 iso88595 "
    "iso_8859-5 iso_8859-5:1988",
    "iso8859_6": "arabic asmo-708 csiso88596e csiso88596i csisolatinarabic ecma-114 iso-8859-6 "
    "iso-8859-6-e iso-8859-6-i iso-ir-127 iso8859-6 iso88596 iso_8859-6 iso_8859-6:1987",
    "iso8859_7": "csisolatingreek ecma-118 elot_928 greek greek8 iso-8859-7 iso-ir-126 "
    "iso8859-7 iso88597 iso_8859-7 iso_8859-7:1987 sun_eu_greek",
    "iso8859_8": "csiso88598e csisolatinhebrew hebrew iso-8859-8 iso-8859-8-e iso-ir-138 "
    "iso8859-8 iso88598 iso_8859-8 iso_8859-8:1988 visual csiso88598i iso-8859-8-i logical",
    "iso8859_10": "csisolatin6 iso-8859-10 iso-ir-157 iso8859-10 iso885910 l6 latin6",
    "iso8859_13": "iso-8859-13 iso8859-13 iso885913",
    "iso8859_14": "iso-8859-14 iso8859-14 iso885914",
    "iso8859_15": "csisolatin9 iso-8859-15 iso8859-15 iso885915 iso_8859-15 l9",
    "iso8859_16": "iso-8859-16",
    "koi8_r": "cskoi8r koi koi8 koi8-r koi8_r",
    "koi8_u": "koi8-ru koi8-u",
    "mac_roman": "csmacintosh mac macintosh x-mac-roman",
    "cp874": "dos-874 iso-8859-11 iso8859-11 iso885911 tis-620 windows-874",
    "cp1250": "cp1250 windows-1250 x-cp1250",
    "cp1251": "cp1251 windows-1251 x-cp1251",
    "cp1252": "ansi_x3.4-1968 ascii cp1252 cp819 csisolatin1 ibm819 iso-8859-1 iso-ir-100 "
    "iso8859-1 iso88591 iso_8859-1 iso_8859-1:1987 l1 latin1 us-ascii windows-1252 x-cp1252",
    "cp1253": "cp1253 windows-1253 x-cp1253",
    "cp1254": "cp1254 csisolatin5 iso-8859-9 iso-ir-148 iso8859-9 iso88599 iso_8859-9 "
    "iso_8859-9:1989 l5 latin5 windows-1254 x-cp1254",
    "cp1255": "cp1255 windows-1255 x-cp1255",
    "cp1256": "cp1256 windows-1256 x-cp1256",
    "cp1257": "cp1257 windows-1257 x-cp1257",
    "cp1258": "cp1258 windows-1258 x-cp1258",
    "mac_cyrillic": "x-mac-cyrillic x-mac-ukrainian",
    # the standard decodes gbk as gb18030, big5 as Big5-HKSCS, shift_jis as windows-31j and
    # euc-kr as windows-949
    "gb18030": "chinese csgb2312 csiso58gb231280 gb2312 gb_2312 gb_2312-80 gbk iso-ir-58 x-gbk "
    "gb18030",
    "big5hkscs": "big5 big5-hkscs cn-big5 csbig5 x-x-big5",
    "euc_jp": "cseucpkdfmtjapanese euc-jp x-euc-jp",
    "iso2022_jp": "csiso2022jp iso-2022-jp",
    "cp932": "csshiftjis ms932 ms_kanji shift-jis shift_jis sjis windows-31j x-sjis",
    "cp949": "cseuckr csksc56011987 euc-kr iso-ir-149 korean ks_c_5601-1987 ks_c_5601-1989 "
    "ksc5601 ksc_5601 windows-949",
    "utf_16_be": "unicodefffe utf-16be",
    "utf_16_le": "csunicode iso-10646-ucs-2 ucs-2 unicode unicodefeff utf-16 utf-16le",
}
_CODECS = {label: codec for codec, labels in _LABELS.items() for label in labels.split()}
# a label is a few ASCII characters; a longer one is quoted only that far in a skip's reason
_QUOTED_CHARS = 40


# windows-1252 (every latin1/ascii label) leaves five bytes undefined, which Python's cp1252
# refuses; the standard decodes each as the C1 control character of its value (0x81 -> U+0081),
# as latin-1 did before this module: such a page is read, not skipped
_C1 = "voxrecall-whatwg-c1"


def _c1(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):
        raise error
    return error.object[error.start : error.end].decode("latin-1"), error.end


codecs.register_error(_C1, _c1)


class CharsetError(ValueError):
    """A page that cannot be decoded; the message says why (for the build report)."""


def web_codec(label: str) -> str | None:
    """The Python codec that decodes the web encoding ``label`` names, or None."""
    return _CODECS.get(label.strip(" \t\n\f\r").lower())


def decode_web(data: bytes, charset: str) -> str:
    """``data`` decoded by its byte-order mark, else as the web encoding ``charset`` names.
    Raises CharsetError for a label that is not a web encoding's, or bytes not in it."""
    if data.startswith(b"\xef\xbb\xbf"):
        codec, data = "utf-8", data[3:]
    elif data.startswith((b"\xff\xfe", b"\xfe\xff")):
        codec = "utf-16"  # reads the mark, and drops it
    else:
        found = web_codec(charset)
        if found is None:
            raise CharsetError(
                f"unsupported charset {charset[:_QUOTED_CHARS]!r} (not a web encoding; "
                "save the page as UTF-8)"
            )
        codec = found
    try:
        return data.decode(codec, _C1 if codec == "cp1252" else "strict")
    except UnicodeDecodeError as exc:
        raise CharsetError(f"not valid {exc.encoding}: {exc.reason} at byte {exc.start}") from None
