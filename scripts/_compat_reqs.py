"""Requirements for a CPU venv of an SGLang release that has no file of its
own in requirements/: the nearest older release's file, with every package
SGLang's own metadata pins (``name==X``) at SGLang's pin and the other
versions left to pip (an older file's transitive pins may not fit a newer
release's pins).

    VENV/bin/python scripts/_compat_reqs.py REQUIREMENTS_DIR > out.txt

Run by the venv's python once SGLang is installed in it (--no-deps): its
metadata is read from there.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version


def sglang_pins() -> dict[str, str]:
    pins = {}
    for line in requires("sglang") or []:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[canon(req.name)] = f"{req.name}=={exact[0]}"
    return pins


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_file(release: str, folder: Path) -> Path:
    known = sorted(
        (Version(p.stem.removeprefix("sglang-cpu-")), p) for p in folder.glob("sglang-cpu-*.txt")
    )
    older = [p for v, p in known if v <= Version(release)]
    if not older:
        raise SystemExit(f"no requirements file at or below sglang {release} in {folder}")
    return older[-1]


def cpu_safe_names(folder: Path) -> set[str]:
    """Every package some requirements file lists: known to install on a CPU."""
    names = set()
    for path in folder.glob("sglang-cpu-*.txt"):
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if line:
                names.add(canon(Requirement(line).name))
    return names


def sglang_needs() -> dict[str, str]:
    """This release's own requirements (no extras), canonical name -> the name."""
    out = {}
    for line in requires("sglang") or []:
        req = Requirement(line)
        if req.marker is None or "extra" not in str(req.marker):
            out[canon(req.name)] = req.name
    return out


def main(folder: str) -> None:
    release = version("sglang")
    base = base_file(release, Path(folder))
    pins = sglang_pins()
    print(f"# derived for sglang=={release} from {base.name}: SGLang's own == pins, other versions left to pip")
    seen: set[str] = set()
    for raw in base.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = canon(Requirement(line).name)
        if name in ("torch", "torchvision", "triton"):
            print(line)  # torch's own family stays at the venv's torch
        else:
            print(pins.get(name, Requirement(line).name))
        seen.add(name)
    # what this release requires beyond the older file, among the packages
    # known to install on a CPU (einops: 0.5.12 imports it on the HiCache path)
    for name, spelled in sorted(sglang_needs().items()):
        if name not in seen and name in cpu_safe_names(Path(folder)):
            print(pins.get(name, spelled))


if __name__ == "__main__":
    main(sys.argv[1])
