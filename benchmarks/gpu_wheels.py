"""Download the wheels of benchmarks/gpu_wheels.txt for the device machine
(CPython 3.12, manylinux x86-64) into .whl/ and check they fit the 64 MiB carry.

    python benchmarks/gpu_wheels.py [--dest .whl] [--check-only]

A package published only as a source archive (antlr4-python3-runtime) is built
into a pure-Python wheel here. Exits 2 with one line when a wheel cannot be had
or the set is too large.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT = 64 * 2**20
# the device tool carries the whole working tree within this; leave room for the repo itself
BUDGET = 56 * 2**20
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def requirements(path: Path = HERE / "gpu_wheels.txt") -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def fetch(req: str, dest: Path) -> None:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *plat, "-d", str(dest), req]
    if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
        return
    with tempfile.TemporaryDirectory() as d:  # sdist only: build a wheel (pure Python) here
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), req],
                               capture_output=True, text=True, cwd=d)
    if built.returncode != 0:
        tail = (built.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"gpu_wheels: cannot get a wheel for {req}: {tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(HERE.parent / ".whl"))
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for req in requirements():
        name = req.split("==")[0].replace("-", "_").lower()
        if not any(w.name.lower().startswith(name + "-") for w in dest.glob("*.whl")):
            fetch(req, dest)
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest} (carry limit {LIMIT / 2**20:.0f} MiB)")
    if total > BUDGET:
        print(f"gpu_wheels: {total / 2**20:.1f} MiB leaves too little of the 64 MiB carry for the repository",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
