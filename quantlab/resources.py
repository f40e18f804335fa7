"""Where quantlab's data directories are: ``conf/`` (Hydra presets),
``calibration/`` (calibration-set specs) and ``evaluation/`` (lm-eval task
templates).

They live at the top level of the repository. A wheel (``pip install .``,
``pip install git+...``) carries copies inside the package, under
``quantlab/_data/`` (``setup.py``'s ``build_py`` writes them); an editable
install or a checkout on ``PYTHONPATH`` reads the repository's own. The
packaged copy wins where both exist, so an installed quantlab never reads a
directory it happens to sit beside.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

NAMES = ("conf", "calibration", "evaluation")


def data_dir(name: str) -> Path:
    """The directory ``name`` (one of NAMES) on disk. Raises FileNotFoundError
    naming both places looked in when neither holds it (a broken install)."""
    if name not in NAMES:
        raise ValueError(f"unknown data directory {name!r}; valid: {', '.join(NAMES)}")
    packaged = Path(str(resources.files("quantlab"))) / "_data" / name
    checkout = Path(__file__).resolve().parent.parent / name
    for path in (packaged, checkout):
        if path.is_dir():
            return path
    raise FileNotFoundError(f"quantlab's {name}/ directory is missing: looked in {packaged} and {checkout} "
                            "(reinstall quantlab: pip install .)")
