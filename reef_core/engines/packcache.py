"""The local engine's packed weights kept on disk, so that a start with a model already seen maps them in instead of
packing them again.

Why: packing SmolLM2-135M's 211 weights for the C kernel (checking each for bf16 exactness, then reordering it:
:class:`reef_core.engines.kernels.PackedMatrix`) took 0.3-0.65 s of every ``reef serve`` start-up (issue #23). The
packed copies follow from the model directory's weight files and the kernel's layout alone, so the engine writes them
once, after its first warm-up, and later starts read them back through safetensors' memory mapping (the pages are
read by the warm-up's generation). They live beside the compiled kernel (``REEF_KERNEL_CACHE``, default
``~/.cache/reef/kernels``, under ``packed/``), one file per model directory, and never inside the model directory,
whose files define the base model's digest.

A file is used only when its key matches: the kernel's source (which defines the layout), every weight file of the
directory (name, size, modification time, inode) and the name, shape and dtype of every weight packed; else the
weights are packed afresh and the file rewritten. Models whose packed weights are under :data:`MIN_BYTES` are not
cached: packing them costs less than reading a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from reef_core.engines import kernels
from reef_core.engines.decode import Packed

log = logging.getLogger(__name__)

#: the smallest total of packed bytes worth a file (SmolLM2-135M: ~270 MB; the tiny test model: ~0.2 MB)
MIN_BYTES = 16 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def cache_dir() -> Path:
    """The directory of the packed-weight files (``packed/`` beside the compiled kernel)."""
    return kernels.cache_dir() / "packed"


def cache_path(model_dir: Path) -> Path:
    """Where the packed weights of ``model_dir`` are kept."""
    name = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
    return cache_dir() / f"{name}.safetensors"


def _key(model_dir: Path, weights: dict[str, torch.Tensor]) -> str:
    files = []
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix in _WEIGHT_SUFFIXES and path.is_file():
            st = path.stat()
            files.append([path.name, st.st_size, st.st_mtime_ns, st.st_ino])
    shapes = sorted([name, list(w.shape), str(w.dtype)] for name, w in weights.items())
    blob = json.dumps([kernels.SOURCE_DIGEST, files, shapes])
    return hashlib.sha256(blob.encode()).hexdigest()


def _named(model) -> dict[str, torch.Tensor]:
    """The model's 2-D parameters by name (a tied weight once, under its first name)."""
    return {name: p for name, p in model.named_parameters() if p.dim() == 2}


def load(model_dir: Path, model, packed: Packed) -> int:
    """Put the cached packed copies of ``model``'s weights into ``packed``, when a file for exactly these weights
    exists; returns how many (0: none, pack as usual). ``model`` must hold the directory's weights as loaded."""
    if packed.fn is None:
        return 0
    path = cache_path(model_dir)
    if not path.is_file():
        return 0
    weights = _named(model)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            if (fh.metadata() or {}).get("key") != _key(model_dir, weights):
                return 0
            found = {name: kernels.PackedMatrix.adopt(fh.get_tensor(name), *weights[name].shape, packed.fn)
                     for name in fh.keys() if name in weights}
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: pack afresh (and rewrite it)
        log.warning("packed weights in %s unreadable (%s): packing afresh", path, exc)
        return 0
    for name, mat in found.items():
        packed.put(weights[name], mat)
    return len(found)


def save(model_dir: Path, model, packed: Packed) -> bool:
    """Write the packed copies in ``packed`` of ``model``'s weights for later starts (atomically; a failure is
    logged, not raised: the cache only saves time). ``model`` must hold the directory's weights as loaded. True when
    written."""
    weights = _named(model)
    names = {id(w): name for name, w in weights.items()}
    tensors = {names[id(w)]: mat.w for w, mat in packed.items() if id(w) in names}
    if not tensors or sum(t.numel() * t.element_size() for t in tensors.values()) < MIN_BYTES:
        return False
    path = cache_path(model_dir)
    try:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"key": _key(model_dir, weights), "model_dir": str(model_dir)})
            os.replace(tmp, path)  # a concurrent reader finds the whole old file or the whole new one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.info("packed weights not cached (%s): later starts pack them again", exc)
        return False
    return True
