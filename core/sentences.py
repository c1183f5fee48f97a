"""Sentence splitting for en/fr/de/es/it model output.

Used twice by the reward: to count the sentences of the final answer (the brevity rule) and
to cut long texts into pieces for per-sentence language identification.

Rules, in order:
    * a line break ends a sentence; list markers (``1.``, ``2)``, ``a.``, ``-``, ``*``, ``•``,
      ``#``) at the start of a line are dropped, so a list of three items is three sentences
      and the marker ``1.`` is never a sentence of its own;
    * inside a line, a run of ``.``, ``!``, ``?`` or ``…`` followed by whitespace ends a
      sentence only when the next word does not start with a lowercase letter (so ``e.g. the``,
      ``Hmm... let me`` and ``etc. and`` do not split);
    * a period after a known abbreviation (``Dr.``, ``z.B.``, ``p. ex.``, ``Sr.``, ``ecc.``) or
      after a single capital letter (an initial: ``J. K. Rowling``) does not end a sentence;
    * a period between digits (``3.14``, ``1.000``) is never a boundary, since it is not followed
      by whitespace.
"""

from __future__ import annotations

import re

import numpy as np

ABBREVIATIONS: frozenset[str] = frozenset(
    {
        # English
        "mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "e.g", "i.e", "approx", "fig",
        "eq", "cf", "jr", "sr", "inc", "ltd", "dept", "est", "al", "resp",
        # French
        "mme", "mlle", "mm", "env", "p.ex", "ex", "c.-à-d", "c-à-d", "av", "bd", "éd", "chap",
        "vol", "pp", "n°", "réf",
        # German
        "z.b", "bzw", "usw", "ca", "d.h", "u.a", "evtl", "ggf", "inkl", "nr", "str", "vgl",
        "sog", "u.ä", "z.t", "zzgl", "bspw", "hr", "fr",
        # Spanish
        "sra", "srta", "dra", "ud", "uds", "p.ej", "aprox", "núm", "pág", "ej", "dña",
        # Italian
        "sig", "sig.ra", "dott", "ing", "avv", "ecc", "pag", "cfr", "p.es", "sigg",
    }
)  # fmt: skip
"""Lowercase abbreviations (without their final period) after which a period does not end a
sentence. Words that are also common sentence-final words (``no``, ``es``, ``min``) are left
out on purpose."""

_LINE_BREAK = re.compile(r"\s*\n\s*")
_LIST_MARKER = re.compile(
    r"^(?:[-*•+>]\s+|#{1,6}\s+)?(?:(?:\d{1,3}|[a-z]|[ivx]{1,4})[.)]\s+|[A-Z][)]\s+|\(\d{1,3}\)\s+)?"
)
_BOUNDARY = re.compile(r"([.!?…]+)[\"'»”’)\]*_]*\s+")
_HAS_CONTENT = re.compile(r"[^\W_]")
# Rough boundaries for language profiling: any end punctuation or line break + whitespace.
# It starts with a character class, so the regex engine scans for it fast.
_ROUGH_BOUNDARY = re.compile(r"[.!?…\n][.!?…\n]*[\"'»”’)\]*_]*\s+")
_ASCII_LETTERS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _ends_with_abbreviation(head: str) -> bool:
    """True when ``head`` (text up to, not including, a single final period) ends in an
    abbreviation or an initial."""
    parts = head.rsplit(None, 1)
    if not parts:
        return False
    word = parts[-1].lstrip("([{\"'«“‘¿¡")
    if len(word) == 1 and word.isupper():
        return True
    return word.lower() in ABBREVIATIONS


def _split_line(line: str) -> list[str]:
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(line):
        end = match.end()
        if end >= len(line):
            break  # the line's own end closes the last sentence
        next_char = line[end]
        if next_char.islower():
            continue
        punctuation = match.group(1)
        if punctuation == "." and _ends_with_abbreviation(line[start : match.start(1)]):
            continue
        sentences.append(line[start:end].strip())
        start = end
    sentences.append(line[start:].strip())
    return sentences


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences.

    Args:
        text: Any text; non-strings and empty strings give ``[]``.

    Returns:
        The sentences, stripped, in order. List markers are removed, and pieces without any
        letter or digit (``"..."``, ``"—"``, ``"**"``) are dropped.
    """
    if not isinstance(text, str) or not text:
        return []
    sentences: list[str] = []
    for raw_line in _LINE_BREAK.split(text):
        line = _LIST_MARKER.sub("", raw_line.strip())
        if not line:
            continue
        sentences.extend(s for s in _split_line(line) if _HAS_CONTENT.search(s))
    return sentences


def count_sentences(text: str) -> int:
    """Number of sentences in ``text`` as :func:`split_sentences` finds them."""
    return len(split_sentences(text))


def rough_segments(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` spans covering ``text``, cut after end punctuation or line breaks.

    Cheaper than :func:`split_sentences` (no abbreviation or list rules): used to cut long
    texts into pieces for language identification, where a wrong cut only makes a piece
    shorter (and short pieces are joined to their neighbours anyway).
    """
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _ROUGH_BOUNDARY.finditer(text):
        end = match.end()
        spans.append((start, end))
        start = end
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def rough_segment_ends(text: str) -> list[int]:
    """Where the spans of :func:`rough_segments` end, except the end of ``text``."""
    return [match.end() for match in _ROUGH_BOUNDARY.finditer(text)]


def letter_mask(text: str) -> np.ndarray:
    """For each character of ``text``, whether :func:`count_letters` counts it."""
    codes = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), np.uint32)
    return (codes >= 0x80) | ((codes | 0x20) - ord("a") < 26)


def count_letters(text: str) -> int:
    """Letters in ``text``: ASCII letters plus every non-ASCII character.

    Counting every non-ASCII character as a letter (accented letters, Cyrillic, CJK…) is
    exact for words and slightly generous for symbols such as ``«`` or ``→``; it runs at C
    speed, which matters because the reward counts the letters of every sentence.
    """
    ascii_bytes = text.encode("ascii", errors="ignore")
    non_ascii = len(text) - len(ascii_bytes)
    return non_ascii + len(ascii_bytes) - len(ascii_bytes.translate(None, _ASCII_LETTERS))
