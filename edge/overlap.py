"""Public means public: refuse public data that overlaps the private dataset.

Public training, a public tokenizer corpus and the distribution-matching pool are outside the DP
guarantee: that is only sound when none of their records is also a private record. Two checks:

* By name (cheap, at config time): a public source equal to the private dataset, or one the
  other contains. `shakespeare` is exactly `shakespeare-solo` + `shakespeare-collab` (verified:
  all 3,508 collab records are `shakespeare` records, solo and collab share no (play, speaker)
  and no record), so `shakespeare-collab` is public only next to a private `shakespeare-solo`.
* By text (when the pool is built): the SHA-256 of each normalised text (NFKC, case-folded,
  whitespace collapsed). This catches a user's own `jsonl` file that holds public text, or
  public text pasted into it. Only texts of at least `MIN_CHARS` normalised characters are
  compared: short stock phrases recur in independent texts (76 collab records equal a solo
  record, e.g. "What mean you, sir?", all shorter than 40 characters) and are not a leak.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable

from dpfleet.errors import DpfleetError

MIN_CHARS = 40
# part -> the dataset that contains it
CONTAINED_IN = {"shakespeare-collab": "shakespeare", "shakespeare-solo": "shakespeare"}


def sources_overlap(public: str, private: str) -> str | None:
    """Why named dataset `public` shares records with `private`, or None if it does not."""
    if public == private and public != "jsonl":  # two jsonl files are compared by text
        return "it is the private dataset itself"
    if CONTAINED_IN.get(public) == private:
        return f"every {public} record is also a {private} record"
    if CONTAINED_IN.get(private) == public:
        return f"it contains every record of {private}"
    return None


def check_public_sources(public: Iterable[str], private: str, what: str) -> None:
    """Refuse named public sources that overlap the private dataset (one clear error)."""
    for source in public:
        reason = sources_overlap(source, private)
        if reason:
            hint = (" (use data.dataset = \"shakespeare-solo\" as the private data next to a "
                    "\"shakespeare-collab\" pool)" if "shakespeare" in source + private else "")
            raise DpfleetError(f"{what} {source!r} is not public next to the private dataset "
                               f"{private!r}: {reason}{hint}")


def normalised_digest(text: str) -> bytes | None:
    """SHA-256 of the normalised text, or None when it is too short to compare."""
    norm = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()
    if len(norm) < MIN_CHARS:
        return None
    return hashlib.sha256(norm.encode()).digest()


def check_public_texts(public: Iterable[tuple[str, str]], private_texts: Iterable[str],
                       private: str) -> None:
    """Refuse public (source, text) records whose normalised text is also a private record."""
    seen = {d for t in private_texts if (d := normalised_digest(t)) is not None}
    hits: dict[str, list[str]] = {}
    for source, text in public:
        if normalised_digest(text) in seen:
            hits.setdefault(source, []).append(text)
    if hits:
        parts = ", ".join(f"{s}: {len(t)} records (e.g. {t[0][:60]!r})" for s, t in hits.items())
        raise DpfleetError(f"public data repeats private records of {private!r}, so it is not "
                           f"public: {parts}")
