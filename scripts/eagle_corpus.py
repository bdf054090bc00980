"""Collect local text for teacher-forcing the default model when training EAGLE heads: text that
ships on this machine, so that nothing is downloaded.

Kinds (``--kinds``, each sampled to ``--limit`` documents with ``--seed``):

- ``man``: English manual pages (``/usr/share/man/man{1,5,7,8}``, at most ``PAGES_PER_FAMILY``
  per command family), rendered by ``man`` at 80 columns;
- ``pydoc``: the Python standard library's modules as ``pydoc`` renders them (docstrings and
  signatures);
- ``pkgdoc``: the long descriptions of the installed Python packages (``METADATA`` of each
  distribution: their READMEs) and the READMEs under ``/usr/share/doc``.

Each line of the output is a JSON document ``{"source", "kind", "sha256", "held_out", "text"}``;
one in ``HELD_OUT_EVERY`` documents, chosen by a hash of its source, is held out of training
(``train_eagle.py`` scores the heads on it). The documents keep their packages' licences; only
the heads trained on them ship, with the list of sources in their README.

    python scripts/eagle_corpus.py --out /work/eagle/corpus.jsonl [--kinds man,pydoc,pkgdoc --limit 1500]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import os
import pydoc
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

HELD_OUT_EVERY = 20
MIN_CHARS, MAX_CHARS = 400, 60_000
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
PAGES_PER_FAMILY = 8
"""Manual pages kept per command family (the name before its first ``_``, ``-`` or ``.``): one
installed tool can bring thousands of near-identical pages (``gcloud_*``)."""


def clean(text: str) -> str:
    """Trailing spaces dropped, runs of blank lines collapsed to one."""
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def man_sources() -> list[str]:
    families: dict[str, list[str]] = {}
    for section in MAN_SECTIONS:
        for path in sorted(Path("/usr/share/man", section).glob("*")):
            families.setdefault(re.split(r"[_.-]", path.name)[0], []).append(str(path))
    return sorted(path for paths in families.values() for path in paths[:PAGES_PER_FAMILY])


def man_text(path: str) -> str:
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="", LANG="C.UTF-8")
    out = subprocess.run(["man", "-l", path], capture_output=True, text=True, env=env, timeout=30).stdout
    return re.sub(r".\x08", "", out)


def pydoc_sources() -> list[str]:
    return sorted(name for name in sys.stdlib_module_names if not name.startswith("_") and name not in ("antigravity", "this"))


def pydoc_text(name: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pydoc.render_doc(name, renderer=pydoc.plaintext)


def pkgdoc_sources() -> list[str]:
    names = sorted({f"dist:{d.metadata['Name']}" for d in importlib.metadata.distributions() if d.metadata["Name"]})
    readmes = sorted(str(p) for p in Path("/usr/share/doc").glob("*/README*") if p.is_file())
    return names + readmes


def pkgdoc_text(source: str) -> str:
    if source.startswith("dist:"):
        return importlib.metadata.metadata(source[5:]).get_payload() or ""  # type: ignore[attr-defined]
    opener = gzip.open if source.endswith(".gz") else open
    with opener(source, "rt", errors="replace") as f:
        return f.read()


KINDS: dict[str, tuple[Callable[[], list[str]], Callable[[str], str]]] = {
    "man": (man_sources, man_text),
    "pydoc": (pydoc_sources, pydoc_text),
    "pkgdoc": (pkgdoc_sources, pkgdoc_text),
}
"""Kind -> (its sources, the text of one source)."""


def held_out(source: str) -> bool:
    return int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0


def documents(kind: str, limit: int, seed: int) -> Iterator[dict[str, object]]:
    """Up to ``limit`` documents of ``kind``, sources sampled with ``seed``; a source that fails to
    render, or whose text is shorter than ``MIN_CHARS``, is skipped."""
    list_sources, read = KINDS[kind]
    sources = list_sources()
    random.Random(seed).shuffle(sources)
    taken = 0
    for source in sources:
        if taken == limit:
            break
        try:
            text = clean(read(source))[:MAX_CHARS]
        except Exception:  # a page that does not render is not part of the corpus
            continue
        if len(text) < MIN_CHARS:
            continue
        taken += 1
        digest = hashlib.sha256(text.encode()).hexdigest()
        yield {"source": f"{kind}:{source}", "kind": kind, "sha256": digest, "held_out": held_out(source), "text": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--limit", type=int, default=1500, help="documents per kind")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for kind in args.kinds.split(","):
            n = chars = 0
            for doc in documents(kind, args.limit, args.seed):
                f.write(json.dumps(doc) + "\n")
                n += 1
                chars += len(doc["text"])  # type: ignore[arg-type]
            print(f"{kind}: {n} documents, {chars / 1e6:.1f} M characters", flush=True)


if __name__ == "__main__":
    main()
