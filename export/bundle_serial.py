"""The serial number a bundle's signed manifest carries, so a device can refuse an older bundle.

Why: a signature says who made a bundle, not when. Without a serial, anyone who kept an older
bundle signed with the same key (a known bad model, a higher learning rate, a weaker clip) can
hand it to a device that already runs a newer one, and the device accepts it. Each export signs
`bundle_serial` into the manifest; devices remember the highest serial they accepted per key and
refuse lower ones (`edge/bundle_format.check_serial`).

The next serial comes from a counter beside the signing key (`<key file>.serial`), and is never
below the export's unix time in seconds, so a key copied to another machine without its counter
still signs increasing serials while that machine's clock is right.
"""

from __future__ import annotations

import time
from pathlib import Path

from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write


def serial_file(key_path: Path) -> Path:
    return Path(key_path).with_name(Path(key_path).name + ".serial")


def last_serial(key_path: Path) -> int:
    """The highest serial this key's counter recorded (0: none yet)."""
    path = serial_file(key_path)
    if not path.exists():
        return 0
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError) as exc:
        raise DpfleetError(f"{path}: unreadable bundle serial counter ({exc}); write the last "
                           "serial this key signed into it (or delete it to start from the "
                           "current unix time)") from exc
    if value < 0:
        raise DpfleetError(f"{path}: a bundle serial counter cannot be negative ({value})")
    return value


def next_serial(key_path: Path, requested: int | None = None) -> int:
    """Reserve the serial of the next bundle signed with `key_path` and record it.

    Default: max(last + 1, unix seconds). A `requested` serial must lie above the last one (a
    release pipeline numbering its own bundles)."""
    last = last_serial(key_path)
    if requested is None:
        serial = max(last + 1, int(time.time()))
    elif type(requested) is not int or requested <= last:
        raise DpfleetError(f"bundle serial {requested!r} is not above {last}, the last one signed "
                           f"with {key_path}: devices that accepted it would refuse this bundle")
    else:
        serial = requested
    atomic_write(serial_file(key_path), f"{serial}\n")
    return serial
