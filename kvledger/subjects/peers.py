"""Where the source checkouts of mini-sglang and nano-vllm come from.

A subject spec names a path (`minisgl:PATH`, `nanovllm:PATH`): a checkout directory, or a
`.tar.gz` snapshot of one (the shipped peers are snapshots). Without a path, `$KVLEDGER_PEERS`,
then `../shared/peers` beside the repository, are searched for `<name>-<commit>` (a directory or
a `.tar.gz`). A snapshot is unpacked once under `$KVLEDGER_CACHE/peers/<file hash>/`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import List

from kvledger.properties.subject import SubjectUnavailable

REPO = Path(__file__).resolve().parents[2]
SPEC_NAMES = {"mini-sglang": "minisgl", "nano-vllm": "nanovllm"}


def search_dirs() -> List[Path]:
    dirs = []
    if os.environ.get("KVLEDGER_PEERS"):
        dirs.append(Path(os.environ["KVLEDGER_PEERS"]))
    dirs += [REPO.parent / "shared" / "peers", Path.cwd().parent / "shared" / "peers"]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def cache_dir() -> Path:
    return Path(os.environ.get("KVLEDGER_CACHE", Path.home() / ".cache" / "kvledger")) / "peers"


def unpack(path: Path) -> Path:
    """A checkout directory as is; a .tar.gz unpacked once. Returns the checkout's root: the
    directory holding its sources (a snapshot's single top folder)."""
    if path.is_dir():
        return path
    if not path.is_file() or not path.name.endswith((".tar.gz", ".tgz")):
        raise SubjectUnavailable(f"{path}: not a checkout directory or a .tar.gz snapshot")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    target = cache_dir() / digest
    if not target.exists():  # unpacked aside, then renamed: a parallel worker sees all of it or none
        cache_dir().mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=f".{digest}-"))
        with tarfile.open(path) as tar:
            tar.extractall(staging, filter="data")
        try:
            staging.rename(target)
        except OSError:  # another worker renamed its copy first
            shutil.rmtree(staging, ignore_errors=True)
    tops = [p for p in target.iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else target


def peer_path(name: str, commit: str | None = None) -> Path | None:
    """The shipped snapshot or checkout `<name>-<commit>` (any commit when None), or None."""
    pattern = f"{name}-{commit}*" if commit else f"{name}-*"
    for d in search_dirs():
        if not d.is_dir():
            continue
        for found in sorted(d.glob(pattern)):
            if found.is_dir() or found.name.endswith((".tar.gz", ".tgz")):
                return found
    return None


def checkout(name: str, path: str | None, commit: str | None = None) -> Path:
    """The checkout root for a spec's path (or the shipped peer), unpacked; SubjectUnavailable
    naming where it looked when there is none."""
    spec = SPEC_NAMES.get(name, name)
    if path:
        given = Path(path).expanduser()
        if not given.exists():
            raise SubjectUnavailable(f"{spec}:{path}: no such checkout or snapshot")
        return unpack(given)
    found = peer_path(name, commit)
    if found is None:
        where = ", ".join(str(d) for d in search_dirs())
        raise SubjectUnavailable(
            f"{name}: no checkout given and none found (looked for {name}-{commit or '*'} "
            f"in {where}); pass {spec}:PATH or set KVLEDGER_PEERS"
        )
    return unpack(found)


def commit_of(root: Path) -> str:
    """The snapshot's COMMIT file, else the git HEAD, else 'unknown'."""
    marker = root / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()[:12]
    head = root / ".git" / "HEAD"
    if head.exists():
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref_file = root / ".git" / ref[5:]
            return ref_file.read_text().strip()[:12] if ref_file.exists() else "unknown"
        return ref[:12]
    return "unknown"
