"""Build the x86-64 wheel again from the sdist in `--dist` and compare it with the wheel
built from the checkout: the same files, and the same bytes in each but the compiled core
(whose build paths differ), RECORD (which holds the core's hash) and the SBOM's per-build
serial number, timestamp and build folder. Exits 1 on a difference.

    python scripts/sdist_roundtrip.py --dist dist     # `make check-sdist`
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# Members whose bytes may differ between two builds of the same source.
BUILD_DEPENDENT = ("sessiongate/_core.abi3.so", ".dist-info/RECORD")


# maturin's software bill of materials gets a new serial number and timestamp per build and
# names the folder it was built in; the rest (components, versions) must be the same.
SBOM = ".cyclonedx.json"
BUILD_FOLDER = re.compile(r'path\+file://[^#"]*#')


def content(name: str, data: bytes) -> bytes:
    if not name.endswith(SBOM):
        return data
    sbom = json.loads(data)
    sbom.pop("serialNumber", None)
    sbom.get("metadata", {}).pop("timestamp", None)
    return BUILD_FOLDER.sub("path+file://SOURCE#", json.dumps(sbom, sort_keys=True)).encode()


def digests(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: hashlib.sha256(content(name, archive.read(name))).hexdigest()
            for name in archive.namelist()
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, default=Path("dist"))
    parser.add_argument("--policy", default="manylinux_2_28")
    args = parser.parse_args()
    [sdist] = sorted(args.dist.glob("sessiongate-*.tar.gz"))
    [wheel] = sorted(args.dist.glob("sessiongate-*manylinux*_x86_64.whl"))
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        [source] = list(Path(tmp).iterdir())
        out = Path(tmp) / "out"
        build = [sys.executable, "-m", "maturin", "build", "--release", "--zig"]
        build += ["--compatibility", args.policy, "--target", "x86_64-unknown-linux-gnu"]
        subprocess.run([*build, "--out", str(out)], cwd=source, check=True)
        [rebuilt] = list(out.glob("*.whl"))
        if rebuilt.name != wheel.name:
            print(f"different wheel names: {rebuilt.name} vs {wheel.name}")
            return 1
        ours, theirs = digests(wheel), digests(rebuilt)
    if sorted(ours) != sorted(theirs):
        print(
            f"different files: only in checkout's {sorted(set(ours) - set(theirs))}, "
            f"only in sdist's {sorted(set(theirs) - set(ours))}"
        )
        return 1
    differ = [n for n in ours if ours[n] != theirs[n] and not n.endswith(BUILD_DEPENDENT)]
    if differ:
        print(f"different bytes: {differ}")
        return 1
    print(
        f"{rebuilt.name} from {sdist.name}: the same {len(ours)} files, identical bytes "
        "but the compiled core, RECORD and the SBOM's serial number, timestamp and build folder"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
