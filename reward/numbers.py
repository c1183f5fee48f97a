"""Read the numeric answer out of a final answer, in any of lingo-rl's languages.

Which number is the answer:
    1. the content of the last ``\\boxed{…}``, if any;
    2. else the last ``**bold**`` span that holds a number;
    3. else the last number in the text;
    4. else, when the text has no digit at all, the last number written in words
       (``forty-two``, ``quarante-deux``, ``zweiundvierzig``, ``cuarenta y dos``,
       ``quarantadue``; integers up to the millions, no fractions or decimals in words).

How a number is read:
    * both ``.`` and ``,`` present: the later one is the decimal mark (``1,234.5``,
      ``1.234,5``); spaces, no-break spaces and ``'`` group thousands (``12 000``);
    * one mark, used once and followed by exactly three digits (``1,234`` / ``1.234``): it is
      ambiguous, so the answer language decides: in English ``,`` groups thousands and ``.`` is
      the decimal mark; in fr/de/es/it it is the other way round;
    * otherwise ``,`` and ``.`` are decimal marks (``3,5`` and ``3.5`` are both 3.5);
    * ``-`` or ``−`` before a number makes it negative; ``a/b`` is a fraction; ``%`` is ignored.

Only the last 8192 characters of the answer are read.
"""

from __future__ import annotations

import math
import re
import unicodedata

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")
_NUMBER = re.compile(
    r"(?<![\w.,])([-−–]?)"  # sign, only at a word start (not in "COVID-19")
    r"(\d{1,3}(?:[ \u00a0\u202f'’]\d{3})+(?:[.,]\d+)?"  # 12 000 / 1 234,5
    r"|\d+(?:[.,]\d+)*)"  # 42 / 3,5 / 1.234.567 / 1,234.5
    r"(?:\s*/\s*(\d+))?"  # fraction denominator
)
_WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)*")

# Number words, accents stripped and lowercased. Values >= 100 are multipliers.
_HUNDRED, _THOUSAND, _MILLION = 100, 1_000, 1_000_000
_NUMBER_WORDS: dict[str, dict[str, int]] = {
    "en": {
        "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
        "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
        "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
        "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
        "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "hundred": _HUNDRED,
        "thousand": _THOUSAND, "million": _MILLION, "millions": _MILLION,
    },
    "fr": {
        "zero": 0, "un": 1, "une": 1, "deux": 2, "trois": 3, "quatre": 4, "cinq": 5,
        "six": 6, "sept": 7, "huit": 8, "neuf": 9, "dix": 10, "onze": 11, "douze": 12,
        "treize": 13, "quatorze": 14, "quinze": 15, "seize": 16, "vingt": 20, "vingts": 20,
        "trente": 30, "quarante": 40, "cinquante": 50, "soixante": 60, "cent": _HUNDRED,
        "cents": _HUNDRED, "mille": _THOUSAND, "million": _MILLION, "millions": _MILLION,
    },
    "de": {
        "null": 0, "ein": 1, "eins": 1, "eine": 1, "zwei": 2, "drei": 3, "vier": 4,
        "funf": 5, "sechs": 6, "sieben": 7, "acht": 8, "neun": 9, "zehn": 10, "elf": 11,
        "zwolf": 12, "dreizehn": 13, "vierzehn": 14, "funfzehn": 15, "sechzehn": 16,
        "siebzehn": 17, "achtzehn": 18, "neunzehn": 19, "zwanzig": 20, "dreissig": 30,
        "dreißig": 30, "vierzig": 40, "funfzig": 50, "sechzig": 60, "siebzig": 70,
        "achtzig": 80, "neunzig": 90, "hundert": _HUNDRED, "tausend": _THOUSAND,
        "million": _MILLION, "millionen": _MILLION,
    },
    "es": {
        "cero": 0, "un": 1, "uno": 1, "una": 1, "dos": 2, "tres": 3, "cuatro": 4, "cinco": 5,
        "seis": 6, "siete": 7, "ocho": 8, "nueve": 9, "diez": 10, "once": 11, "doce": 12,
        "trece": 13, "catorce": 14, "quince": 15, "dieci": 10, "veinte": 20, "veinti": 20,
        "treinta": 30, "cuarenta": 40, "cincuenta": 50, "sesenta": 60, "setenta": 70,
        "ochenta": 80, "noventa": 90, "cien": 100, "ciento": 100, "doscientos": 200,
        "doscientas": 200, "trescientos": 300, "trescientas": 300, "cuatrocientos": 400,
        "cuatrocientas": 400, "quinientos": 500, "quinientas": 500, "seiscientos": 600,
        "seiscientas": 600, "setecientos": 700, "setecientas": 700, "ochocientos": 800,
        "ochocientas": 800, "novecientos": 900, "novecientas": 900, "mil": _THOUSAND,
        "millon": _MILLION, "millones": _MILLION,
    },
    "it": {
        "zero": 0, "un": 1, "uno": 1, "una": 1, "due": 2, "tre": 3, "quattro": 4,
        "cinque": 5, "sei": 6, "sette": 7, "otto": 8, "nove": 9, "dieci": 10, "undici": 11,
        "dodici": 12, "tredici": 13, "quattordici": 14, "quindici": 15, "sedici": 16,
        "diciassette": 17, "diciotto": 18, "diciannove": 19, "venti": 20, "vent": 20,
        "trenta": 30, "trent": 30, "quaranta": 40, "quarant": 40, "cinquanta": 50,
        "cinquant": 50, "sessanta": 60, "sessant": 60, "settanta": 70, "settant": 70,
        "ottanta": 80, "ottant": 80, "novanta": 90, "novant": 90, "cento": _HUNDRED,
        "mille": _THOUSAND, "mila": _THOUSAND, "milione": _MILLION, "milioni": _MILLION,
    },
}  # fmt: skip
# Words that join number words inside one number ("forty and two" is not a thing, but
# "two hundred and five", "soixante et onze", "zweiundvierzig", "treinta y dos" are).
_CONNECTORS: dict[str, frozenset[str]] = {
    "en": frozenset({"and"}),
    "fr": frozenset({"et"}),
    "de": frozenset({"und"}),
    "es": frozenset({"y"}),
    "it": frozenset({"e"}),
}
# A lone article is not read as "1" ("un nombre pair", "ein Apfel").
_ARTICLES = frozenset({"un", "une", "una", "uno", "ein", "eine", "a"})
_JOIN = -1  # value of a connector inside a compound word ("zweiundvierzig")
_MORPHEMES: dict[str, dict[str, int]] = {
    lang: {**words, "quatrevingt": 80, "quatrevingts": 80} if lang == "fr" else dict(words)
    for lang, words in _NUMBER_WORDS.items()
}
_MORPHEMES["de"]["und"] = _JOIN
_LONGEST_MORPHEME = max(len(w) for words in _MORPHEMES.values() for w in words)
_LONGEST_NUMBER_WORD = 60  # longer "words" are not number words; keeps the parse linear
_TAIL_CHARS = 8192  # the answer's number is read from its last 8192 characters


def _strip_accents(text: str) -> str:
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).replace("ß", "ss")


def _read_digits(body: str, language: str | None) -> float | None:
    """Read the digits-and-separators part of a number (no sign)."""
    body = re.sub(r"[ \u00a0\u202f'’]", "", body)
    commas, dots = body.count(","), body.count(".")
    if commas and dots:
        decimal = "," if body.rfind(",") > body.rfind(".") else "."
        thousands = "." if decimal == "," else ","
        integer, _, fraction = body.rpartition(decimal)
        if fraction == "" or thousands in fraction:
            return None
        body = integer.replace(thousands, "") + "." + fraction
    elif commas + dots > 1:
        mark = "," if commas else "."
        groups = body.split(mark)
        if all(len(g) == 3 for g in groups[1:]):
            body = "".join(groups)  # 1,234,567 / 1.234.567
        else:
            return None  # "1.2.3": a version or a list, not a number
    elif commas + dots == 1:
        mark = "," if commas else "."
        integer, fraction = body.split(mark)
        grouping = len(fraction) == 3 and not integer.startswith("0") and len(integer) <= 3
        if grouping and (mark == ",") == (language in (None, "en")):
            body = integer + fraction
        else:
            body = integer + "." + fraction
    try:
        return float(body)
    except ValueError:
        return None


def _numbers_in(text: str, language: str | None) -> list[float]:
    values: list[float] = []
    for match in _NUMBER.finditer(text):
        sign, body, denominator = match.groups()
        value = _read_digits(body, language)
        if value is None:
            continue
        if denominator is not None:
            if int(denominator) == 0:
                continue
            value /= int(denominator)
        values.append(-value if sign else value)
    return values


def _segment_word(word: str, vocabulary: dict[str, int]) -> list[int] | None:
    """Split a compound number word into known morphemes (longest match first)."""
    if word in vocabulary:
        return [vocabulary[word]]
    for cut in range(min(len(word) - 1, _LONGEST_MORPHEME), 0, -1):
        head = word[:cut]
        if head in vocabulary:
            rest = _segment_word(word[cut:], vocabulary)
            if rest is not None:
                return [vocabulary[head], *rest]
    return None


def _compound_parts(word: str, language: str) -> list[int] | None:
    """Values of the morphemes of one word (hyphens split it), or None if not a number."""
    if len(word) > _LONGEST_NUMBER_WORD:
        return None
    if language == "fr":
        word = word.replace("quatre-vingt", "quatrevingt")
    parts: list[int] = []
    for piece in word.split("-"):
        if piece in _CONNECTORS[language]:
            continue
        sub = _segment_word(piece, _MORPHEMES[language])
        if sub is None:
            return None
        parts.extend(v for v in sub if v != _JOIN)
    return parts


def _combine(parts: list[int]) -> int:
    total = current = 0
    for value in parts:
        if value == _HUNDRED:
            current = max(current, 1) * _HUNDRED
        elif value in (_THOUSAND, _MILLION):
            total += max(current, 1) * value
            current = 0
        else:
            current += value
    return total + current


def _number_words_in(text: str, language: str) -> list[float]:
    connectors = _CONNECTORS[language]
    values: list[float] = []
    run: list[int] = []
    run_words: list[str] = []

    def close_run() -> None:
        while run_words and run_words[-1] in connectors:
            run_words.pop()
        if run and not (len(run_words) == 1 and run_words[0] in _ARTICLES):
            values.append(float(_combine(run)))
        run.clear()
        run_words.clear()

    previous_end = 0
    folded = _strip_accents(text).lower()
    for match in _WORD.finditer(folded):
        word = match.group(0)
        if folded[previous_end : match.start()].strip():
            close_run()  # punctuation or symbols between two words end a number
        previous_end = match.end()
        if word in connectors and run:
            run_words.append(word)
            continue
        parts = _compound_parts(word, language)
        if parts:
            run.extend(parts)
            run_words.append(word)
        else:
            close_run()
    close_run()
    return values


def extract_numeric_answer(text: object, language: str | None = None) -> float | None:
    """The number a final answer gives, or ``None`` when it gives none.

    Args:
        text: The final answer.
        language: Its language (``"en"``, ``"fr"``, …): decides ambiguous separators and
            which number words are read; ``None`` reads separators the English way and
            reads no number words.
    """
    if not isinstance(text, str) or not text:
        return None
    text = text[-_TAIL_CHARS:]
    for pattern in (_BOXED, _BOLD):
        for span in reversed(pattern.findall(text)):
            numbers = _numbers_in(span, language)
            if numbers:
                return numbers[-1]
    numbers = _numbers_in(text, language)
    if numbers:
        return numbers[-1]
    if language in _NUMBER_WORDS and not any(c.isdigit() for c in text):
        words = _number_words_in(text, language)
        if words:
            return words[-1]
    return None


def numbers_match(value: float | None, expected: float, rel_tol: float = 1e-6) -> bool:
    """True when ``value`` equals ``expected`` up to ``rel_tol`` (absolute 1e-9 near zero)."""
    if value is None or not math.isfinite(value) or not math.isfinite(expected):
        return False
    return math.isclose(value, expected, rel_tol=rel_tol, abs_tol=1e-9)
