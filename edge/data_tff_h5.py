"""TFF's older HDF5 `ClientData` files (`examples/<client_id>/<feature>`), one client at a time.

TFF's `HDF5ClientData` keeps one group per client under `examples`, holding one dataset per
feature with one entry per example (StackOverflow's `tokens`, Shakespeare's `snippets`); each
split is its own file (`shakespeare_train.h5`, `shakespeare_test.h5`), so there is no split to
choose. h5py reads one client's datasets when asked, so the file is never loaded whole. h5py is
the optional `dpfleet[data]` extra.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from dpfleet.edge.data_formats import decode_text, pick_feature
from dpfleet.errors import DpfleetError


def _open(path: Path):
    try:
        import h5py
    except ImportError as exc:
        raise DpfleetError("reading TFF's HDF5 files needs h5py: pip install 'dpfleet[data]'") from exc
    if not path.is_file():
        raise DpfleetError(f"TFF HDF5 file not found: {path}")
    try:
        h5 = h5py.File(path, "r")
    except OSError as exc:
        raise DpfleetError(f"{path}: not a readable HDF5 file ({exc}); expected TFF's "
                           "HDF5ClientData file") from exc
    if not isinstance(h5.get("examples"), h5py.Group):
        h5.close()
        raise DpfleetError(f"{path}: no group 'examples'; expected TFF's layout "
                           "examples/<client_id>/<feature>")
    return h5


def client_ids(path: Path, split: str = "") -> list[str]:
    """The client groups' names, sorted (TFF's `HDF5ClientData.client_ids`)."""
    h5 = _open(Path(path))
    try:
        return sorted(h5["examples"])
    finally:
        h5.close()


def iter_clients(path: Path, split: str = "", feature: str = "") -> Iterator[tuple[str, list[str]]]:
    """(client_id, its texts) per client, sorted by client id (as TFF lists them); `split` is
    unused (one file per split)."""
    path = Path(path)
    h5 = _open(path)
    try:
        examples = h5["examples"]
        for client in sorted(examples):
            where = f"{path}: client {client!r}"
            group = examples[client]
            if not hasattr(group, "keys"):
                raise DpfleetError(f"{where}: expected a group of feature datasets, found a dataset")
            name = pick_feature(tuple(group.keys()), feature, where)
            try:
                values = group[name][()]
            except (OSError, KeyError) as exc:
                raise DpfleetError(f"{where}: feature {name!r} is unreadable ({exc}); the file is "
                                   "truncated or corrupt") from exc
            if getattr(values, "ndim", 0) != 1:
                raise DpfleetError(f"{where}: feature {name!r} has shape {getattr(values, 'shape', ())}; "
                                   "expected one string per example")
            yield client, [decode_text(v, name, f"{where}, example {i}") for i, v in enumerate(values)]
    except OSError as exc:
        raise DpfleetError(f"{path}: reading failed ({exc}); the file is truncated or corrupt") from exc
    finally:
        h5.close()
