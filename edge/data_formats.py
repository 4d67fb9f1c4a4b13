"""What the file readers share: which feature of an example is its text, and the error they give.

TFF's text datasets name their text feature differently (StackOverflow `tokens`, Shakespeare
`snippets`); a reader takes the one the config names, else the first of `TEXT_FEATURES` present,
and refuses anything that is not one UTF-8 string, naming the file, the row and what it expected.
"""

from __future__ import annotations

from collections.abc import Mapping

from dpfleet.errors import DpfleetError

TEXT_FEATURES = ("tokens", "snippets", "text")


def pick_feature(names: list[str] | tuple[str, ...], feature: str, where: str) -> str:
    """The text feature among `names`: `feature` if given, else the first of TEXT_FEATURES."""
    if feature:
        if feature not in names:
            raise DpfleetError(f"{where}: no feature {feature!r}; expected one of "
                               f"{', '.join(sorted(names)) or '(none)'}")
        return feature
    for name in TEXT_FEATURES:
        if name in names:
            return name
    raise DpfleetError(f"{where}: expected a text feature ({', '.join(TEXT_FEATURES)}), found "
                       f"{', '.join(sorted(names)) or 'none'} (data.feature, or --feature)")


def decode_text(value: object, name: str, where: str) -> str:
    """One UTF-8 string from a bytes value (TFF stores `tf.string` as bytes)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes | bytearray):
        raise DpfleetError(f"{where}: feature {name!r} is {type(value).__name__}; expected bytes (text)")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DpfleetError(f"{where}: feature {name!r} is not UTF-8 text ({exc.reason})") from exc


def example_text(features: Mapping[str, list], feature: str, where: str) -> str:
    """The text of one decoded `tf.train.Example`: its one bytes value of the text feature."""
    name = pick_feature(tuple(features), feature, where)
    values = features[name]
    if len(values) != 1:
        raise DpfleetError(f"{where}: feature {name!r} holds {len(values)} values; expected one string")
    return decode_text(values[0], name, where)
