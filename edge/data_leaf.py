"""LEAF's JSON files (TalwalkarLab/leaf), streamed one user at a time with ijson.

A LEAF file is one JSON object `{"users": [...], "num_samples": [...], "user_data": {user:
{"x": [...], "y": [...]}}}` (a split is a folder of such files, `all_data_0.json`, ...). One
object per file would mean reading a file whole with `json`; ijson walks it instead, so a reader
holds the user list and one user's samples at a time.

The text of a sample, by LEAF's own writers:

* Shakespeare (`shake_utils.py`): each line of a speaker is left-padded with 80 spaces and cut
  into sliding windows, x = 80 characters and y = the next one. Consecutive windows are joined
  back into the line (x of the next sample is the last 80 characters of x + y), so a user's
  records are their lines, not 80 overlapping copies of each character.
* Sent140 (`data_to_json.py`): x = [id, date, query, user, text]; the text is the last field.
* Any other string x is taken as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from dpfleet.errors import DpfleetError

EXPECTED = 'LEAF\'s {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}'


def _ijson():
    try:
        import ijson
    except ImportError as exc:
        raise DpfleetError("reading LEAF's JSON needs ijson: pip install 'dpfleet[data]'") from exc
    return ijson


def leaf_files(path: Path) -> list[Path]:
    """The file, or a split folder's `*.json` files in name order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise DpfleetError(f"{path}: no *.json files; expected a LEAF split folder")
        return files
    if not path.is_file():
        raise DpfleetError(f"LEAF JSON file not found: {path}")
    return [path]


def _is_windows(x: list, y: list) -> bool:
    return bool(x) and all(isinstance(a, str) and isinstance(b, str) and len(b) == 1
                           for a, b in zip(x, y, strict=True))


def sample_texts(x: list, y: list, where: str) -> list[str]:
    """A user's texts from LEAF's x / y (see the module docstring)."""
    if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y):
        raise DpfleetError(f"{where}: expected lists x and y of the same length")
    if _is_windows(x, y):
        texts, line = [], ""
        for window, nxt in zip(x, y, strict=True):
            if not line or line[-len(window):] != window:
                texts.append(line)
                line = window
            line += nxt
        texts.append(line)
        return [t.strip() for t in texts if t.strip()]
    texts = []
    for i, sample in enumerate(x):
        if isinstance(sample, list) and sample and isinstance(sample[-1], str):
            texts.append(sample[-1])  # Sent140: [id, date, query, user, text]
        elif isinstance(sample, str):
            texts.append(sample)
        else:
            raise DpfleetError(f"{where}, sample {i}: x is {type(sample).__name__}; expected text "
                               "(a string, or a list ending in one as in Sent140)")
    return texts


def _users(ijson, file: Path) -> tuple[list[str], list[int]]:
    """`users` and `num_samples`, read up to where both end (before `user_data` in LEAF's files)."""
    with file.open("rb") as fh:
        users, counts, ended = [], [], set()
        for prefix, event, value in ijson.parse(fh):
            if prefix == "users.item":
                users.append(str(value))
            elif prefix == "num_samples.item" and event == "number":
                counts.append(int(value))
            elif event == "end_array" and prefix in ("users", "num_samples"):
                ended.add(prefix)
                if len(ended) == 2:
                    break
    return users, counts


def _reason(exc: Exception) -> str:
    """The first line of a parser's message (yajl's spans lines, pointing at the column)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def client_ids(path: Path, split: str = "") -> list[str]:
    """Every file's `users` list, read without its samples."""
    ijson = _ijson()
    ids = []
    for file in leaf_files(path):
        try:
            ids += _users(ijson, file)[0]
        except ijson.JSONError as exc:
            raise DpfleetError(f"{file}: not valid JSON ({_reason(exc)}); expected {EXPECTED}") from exc
    return ids


def iter_clients(path: Path, split: str = "", feature: str = "") -> Iterator[tuple[str, list[str]]]:
    """(user, their texts) per user of each file in turn; `split` and `feature` are unused (a
    LEAF split is its own folder; x is the text)."""
    ijson = _ijson()
    for file in leaf_files(path):
        user_index = -1
        try:
            users, counts = _users(ijson, file)
            if not users or len(counts) != len(users):
                raise DpfleetError(f"{file}: {len(users)} users and {len(counts)} num_samples; "
                                   f"expected {EXPECTED}")
            with file.open("rb") as fh:
                for user_index, (user, data) in enumerate(ijson.kvitems(fh, "user_data", use_float=True)):
                    where = f"{file}: user_data[{user!r}]"
                    if user_index >= len(users) or user != users[user_index]:
                        raise DpfleetError(f"{where}: user #{user_index} of user_data is not "
                                           f"users[{user_index}]; expected {EXPECTED}")
                    if not isinstance(data, dict) or "x" not in data or "y" not in data:
                        raise DpfleetError(f"{where}: expected {{\"x\": [...], \"y\": [...]}}")
                    if len(data["x"]) != counts[user_index]:
                        raise DpfleetError(f"{where}: {len(data['x'])} samples, num_samples says "
                                           f"{counts[user_index]}")
                    yield user, sample_texts(data["x"], data["y"], where)
            if user_index + 1 != len(users):
                raise DpfleetError(f"{file}: user_data holds {user_index + 1} users, users lists "
                                   f"{len(users)}; expected {EXPECTED}")
        except ijson.JSONError as exc:
            where = "" if user_index < 0 else f" after {user_index + 1} users of user_data"
            raise DpfleetError(f"{file}: not valid JSON{where} ({_reason(exc)}); the file is truncated or "
                               f"malformed; expected {EXPECTED}") from exc
