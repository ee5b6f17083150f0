"""Build the offline-install wheelhouses: every wheel the hospital agent needs, and separately the aggregator's.

Run on a connected machine with the same Python minor version and platform as the target (``make wheelhouse``)::

    python scripts/wheelhouse.py --out dist/wheelhouse [--constraints constraints.txt] [--role agent --role aggregator]

For each role it writes ``OUT/ROLE/``, a self-contained folder:

- fedclinic's own wheel, built from a clean copy of this source tree (the files git tracks or does not ignore),
  and every wheel it needs at the versions ``constraints.txt`` pins, resolved by ``pip wheel`` (a dependency
  published only as a source release is built into a wheel here, so the target needs no compiler or index);
  the agent's set holds the training stack (``fedclinic[agent]``: torch included), the aggregator's only the base
  install (no torch);
- ``SHA256SUMS``: one ``<sha256>  <file>`` line per wheel, for ``sha256sum -c SHA256SUMS`` on the target;
- ``requirements.txt``: every wheel as ``name==version --hash=sha256:...``, for
  ``pip install --no-index --find-links DIR --require-hashes -r DIR/requirements.txt`` (pip refuses any wheel
  whose hash differs, and any package not listed);
- ``manifest.json``: the role, the fedclinic version, the interpreter and platform it was built for, the sha256
  of the constraints file and, per wheel, its file, name, version, size and sha256.

A folder is written under a temporary name and renamed when complete, so a failed build never leaves a partial
wheelhouse behind under the final name. The build uses the pip configuration of the machine it runs on (index,
find-links: e.g. a local CPU torch wheel); the folder it writes needs none of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: role -> the requirement of fedclinic's wheel that role installs (pyproject.toml: base = aggregator)
ROLE_EXTRAS: dict[str, str] = {"agent": "[agent]", "aggregator": ""}

#: names (any path component) never copied into the clean build tree when git cannot list the files
_UNTRACKED_NAMES = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "demo-out",
                    "node_modules"}

_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


@dataclass(frozen=True)
class Wheel:
    """One wheel of a wheelhouse: its file name, distribution name and version (from the file name), sha256."""

    file: str
    name: str
    version: str
    sha256: str
    size: int


def canonical_name(name: str) -> str:
    """PEP 503 normalised distribution name (``Foo_bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_wheel(path: Path) -> Wheel:
    """A :class:`Wheel` from a wheel file (name and version from its PEP 427 file name)."""
    m = _WHEEL_NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a wheel file name (name-version-[build-]python-abi-platform.whl)")
    return Wheel(file=path.name, name=canonical_name(m["name"]), version=m["version"], sha256=sha256_file(path),
                 size=path.stat().st_size)


def read_sha256sums(folder: Path) -> dict[str, str]:
    """``SHA256SUMS`` of a wheelhouse as {file: sha256}."""
    sums: dict[str, str] = {}
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, _, name = line.partition("  ")
        sums[name] = digest
    return sums


def _source_files(root: Path) -> list[Path]:
    """The files of the source tree to build from: what git tracks or does not ignore, else all but build output."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout
        return [Path(p) for p in out.decode().split("\0") if p and (root / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p.relative_to(root) for p in root.rglob("*")
                if p.is_file() and not _UNTRACKED_NAMES.intersection(p.relative_to(root).parts)
                and not any(part.endswith(".egg-info") for part in p.relative_to(root).parts)]


def build_own_wheel(root: Path, dest: Path) -> Path:
    """Build fedclinic's wheel from a clean copy of ``root`` (no stale ``build/`` or egg-info) into ``dest``."""
    with tempfile.TemporaryDirectory(prefix="fedclinic-src-") as tmp:
        src = Path(tmp) / "src"
        for rel in _source_files(root):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, src / rel)
        _pip("wheel", "--no-deps", "--wheel-dir", str(dest), str(src))
    wheels = sorted(dest.glob("fedclinic-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one fedclinic wheel in {dest}, found {[w.name for w in wheels]}")
    return wheels[0]


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def build_role(own_wheel: Path, role: str, out: Path, constraints: Path) -> list[Wheel]:
    """Write the wheelhouse of one role into ``out`` (replaced when complete); return its wheels."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _pip("wheel", "--wheel-dir", str(partial), "--constraint", str(constraints), f"{own_wheel}{ROLE_EXTRAS[role]}")
    stray = sorted(p.name for p in partial.iterdir() if p.suffix != ".whl")
    if stray:
        raise RuntimeError(f"pip left files that are not wheels in the wheelhouse: {stray}")
    wheels = sorted((parse_wheel(p) for p in partial.glob("*.whl")), key=lambda w: w.name)
    own = canonical_name("fedclinic")
    (partial / "SHA256SUMS").write_text("".join(f"{w.sha256}  {w.file}\n" for w in wheels))
    (partial / "requirements.txt").write_text(
        f"# fedclinic {role}: every wheel of this folder, pinned by hash. Install with\n"
        f"#   pip install --no-index --find-links . --require-hashes -r requirements.txt\n"
        + "".join(f"{w.name}{ROLE_EXTRAS[role] if w.name == own else ''}=={w.version} --hash=sha256:{w.sha256}\n"
                  for w in wheels))
    manifest = {
        "role": role,
        "install": f"fedclinic{ROLE_EXTRAS[role]}",
        "fedclinic_version": next(w.version for w in wheels if w.name == own),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "implementation": platform.python_implementation(),
        "platform": sysconfig.get_platform(),
        "constraints_sha256": sha256_file(constraints),
        "wheels": [w.__dict__ for w in wheels],
    }
    (partial / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return wheels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist" / "wheelhouse", help="writes OUT/ROLE/ per role")
    ap.add_argument("--constraints", type=Path, default=ROOT / "constraints.txt")
    ap.add_argument("--role", action="append", choices=sorted(ROLE_EXTRAS), help="default: both")
    ap.add_argument("--source", type=Path, default=ROOT, help="the fedclinic source tree (default: this one)")
    args = ap.parse_args(argv)
    roles = args.role or sorted(ROLE_EXTRAS)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedclinic-wheel-") as tmp:
        own = build_own_wheel(args.source.resolve(), Path(tmp))
        for role in roles:
            wheels = build_role(own, role, args.out / role, args.constraints.resolve())
            total = sum(w.size for w in wheels)
            sums = sha256_file(args.out / role / "SHA256SUMS")
            print(f"wheelhouse {args.out / role}: {len(wheels)} wheels, {total / 2**20:.1f} MiB; "
                  f"sha256 of SHA256SUMS {sums} (send it to the site by another channel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
