"""Write the CycloneDX SBOM of a wheelhouse (``make sbom``): exactly the wheels ``scripts/wheelhouse.py`` put there.

    python scripts/sbom.py --wheelhouse dist/wheelhouse/agent --out dist/sbom/fedclinic-agent.cdx.json

How: every wheel is first checked against the folder's ``SHA256SUMS`` (a wheel that does not match stops it);
the ``*.dist-info`` folder of each wheel (its METADATA, licence files, entry points: what ``pip install`` writes
there, less pip's own RECORD/INSTALLER) is unpacked into the site-packages of an empty virtual environment
(created ``--without-pip``, so nothing else is in it), and CycloneDX's own generator, ``cyclonedx-py environment``
(cyclonedx-bom, pinned in constraints.txt), reads that environment as it would an installed one: one component per
wheel with its version, licences, PURL and dependency graph, fedclinic (this pyproject.toml) as the main component.
Each component then gets the SHA-256 of the wheel it came from (the hash ``SHA256SUMS`` and ``requirements.txt``
hold), and the document is validated against the CycloneDX JSON schema (cyclonedx-python-lib's strict validator:
structure, types, required fields, enumerations, SPDX licence ids, no unknown properties) before it is written.
The syntax of the links (IRIs) is not checked: jsonschema checks it only with rfc3987-syntax installed (the
``json-validation`` extra of cyclonedx-python-lib), whose parser takes about half a second per link, minutes for the
agent's SBOM, so constraints.txt does not install it. Unpacking metadata only takes a second where installing torch takes minutes;
tests/integration/test_offline_install.py checks that the components are exactly what an offline install of the
same folder puts into a fresh environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheelhouse import ROOT, canonical_name, parse_wheel, read_sha256sums  # noqa: E402

#: CycloneDX specification version written (cyclonedx-py supports 1.0-1.7; 1.6 is what most SBOM tools read)
SPEC_VERSION = "1.6"


class SbomError(RuntimeError):
    """The wheelhouse does not match its SHA256SUMS, or the SBOM does not validate."""


def _dist_info_members(wheel: zipfile.ZipFile) -> list[str]:
    tops = {PurePosixPath(n).parts[0] for n in wheel.namelist() if n.count("/") >= 1}
    dist_info = [t for t in tops if t.endswith(".dist-info")]
    if len(dist_info) != 1:
        raise SbomError(f"{wheel.filename}: expected one .dist-info folder, found {sorted(dist_info)}")
    return [n for n in wheel.namelist() if n.startswith(dist_info[0] + "/") and not n.endswith("/")
            and PurePosixPath(n).name != "RECORD"]


def metadata_environment(wheelhouse: Path, env: Path) -> dict[str, str]:
    """Create ``env``, a virtual environment holding the metadata of every wheel of ``wheelhouse``.

    Returns {canonical name: sha256 of its wheel}. Raises :class:`SbomError` when a wheel's hash differs from
    ``SHA256SUMS``, a wheel is missing, or the folder holds a wheel ``SHA256SUMS`` does not list."""
    sums = read_sha256sums(wheelhouse)
    on_disk = {p.name for p in wheelhouse.glob("*.whl")}
    if on_disk != set(sums):
        raise SbomError(f"{wheelhouse}: wheels and SHA256SUMS differ: not listed {sorted(on_disk - set(sums))}, "
                        f"missing {sorted(set(sums) - on_disk)}")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = Path(subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    hashes: dict[str, str] = {}
    for name, digest in sorted(sums.items()):
        wheel = parse_wheel(wheelhouse / name)
        if wheel.sha256 != digest:
            raise SbomError(f"{wheelhouse / name}: sha256 {wheel.sha256} is not the {digest} of SHA256SUMS; "
                            "rebuild the wheelhouse (make wheelhouse) or fetch the file again")
        with zipfile.ZipFile(wheelhouse / name) as zf:
            for member in _dist_info_members(zf):
                target = site / member
                if site not in target.resolve().parents:
                    raise SbomError(f"{name}: member {member!r} would be written outside the environment")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
        hashes[wheel.name] = digest
    return hashes


def add_wheel_hashes(bom: dict, hashes: dict[str, str]) -> None:
    """Give each component (and the main component) the SHA-256 of its wheel; every wheel must be a component."""
    components = list(bom.get("components", [])) + [bom["metadata"]["component"]]
    seen = set()
    for comp in components:
        key = canonical_name(comp["name"])
        if key in hashes:
            comp["hashes"] = [{"alg": "SHA-256", "content": hashes[key]}]
            seen.add(key)
    missing = sorted(set(hashes) - seen)
    if missing:
        raise SbomError(f"the generator left out wheels of the wheelhouse: {missing}")


def validate(text: str) -> None:
    """Raise :class:`SbomError` unless ``text`` is a valid CycloneDX JSON document of :data:`SPEC_VERSION`."""
    from cyclonedx.schema import OutputFormat, SchemaVersion
    from cyclonedx.validation import make_schemabased_validator

    version = SchemaVersion.from_version(SPEC_VERSION)
    error = make_schemabased_validator(OutputFormat.JSON, version).validate_str(text)
    if error is not None:
        raise SbomError(f"the SBOM is not valid CycloneDX {SPEC_VERSION} JSON: {error}")


def write_sbom(wheelhouse: Path, out: Path, pyproject: Path = ROOT / "pyproject.toml") -> dict:
    """Write the validated SBOM of ``wheelhouse`` to ``out`` (atomically); return the document."""
    with tempfile.TemporaryDirectory(prefix="fedclinic-sbom-") as tmp:
        hashes = metadata_environment(wheelhouse, Path(tmp) / "env")
        raw = Path(tmp) / "bom.json"
        generator = Path(sys.executable).with_name("cyclonedx-py")
        cmd = [str(generator) if generator.exists() else "cyclonedx-py", "environment", "--sv", SPEC_VERSION,
               "--of", "JSON", "--no-validate", "--output-reproducible", "--mc-type", "application", "--pyproject", str(pyproject),
               "-o", str(raw), str(Path(tmp) / "env")]
        # validated below, after the wheel hashes are added (its own check would only say "Validation skipped")
        gen = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ""}, capture_output=True, text=True)
        if gen.returncode != 0:
            raise SbomError(f"cyclonedx-py failed (exit {gen.returncode}): {gen.stderr.strip()[-2000:]}")
        bom = json.loads(raw.read_text())
    add_wheel_hashes(bom, hashes)
    text = json.dumps(bom, indent=2) + "\n"
    validate(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(text)
    os.replace(tmp_out, out)
    return bom


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheelhouse", type=Path, required=True, help="a folder written by scripts/wheelhouse.py")
    ap.add_argument("--out", type=Path, required=True, help="the CycloneDX JSON file to write")
    args = ap.parse_args(argv)
    try:
        bom = write_sbom(args.wheelhouse, args.out)
    except SbomError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"SBOM {args.out}: CycloneDX {SPEC_VERSION}, {len(bom.get('components', []))} components, valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
