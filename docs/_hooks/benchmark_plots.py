"""MkDocs hook: the benchmarks' plots (benchmarks/results/*.png) served by the site, at the same path.

Why a hook: mkdocs serves only files under docs/, and the plots are generated artifacts the
benchmark scripts write next to their JSON. A copy under docs/ would be committed twice and go
stale at the next run; instead each PNG joins the site's files at build time as
`benchmarks/results/NAME.png` (its path in the repository), so a page links it relatively, e.g.
`![...](results/mechanisms.png)` from docs/benchmarks/, and `--strict` checks every such link.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

RESULTS = "benchmarks/results"


def plots(root: Path) -> list[str]:
    """The plots under `root`'s benchmarks/results/, as paths relative to `root`, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in (root / RESULTS).glob("*.png"))


def on_files(files: Any, config: Any) -> Any:
    root = Path(config.config_file_path).resolve().parent
    for path in plots(root):
        files.append(File(path, src_dir=str(root), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """`mkdocs serve` rebuilds when a benchmark redraws a plot."""
    server.watch(str(Path(config.config_file_path).resolve().parent / RESULTS))
    return server
