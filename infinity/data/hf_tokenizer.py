"""A Hugging Face tokenizer saved next to a local model (``tokenizer.json`` etc.),
loaded with ``local_files_only`` (never downloads), behind the small interface the
batcher uses: ``vocab_size``, ``eos_token_id``, ``encode_array``, ``decode``."""
import os

import numpy as np

from infinity.data.loading import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(model_dir):
    return os.path.isdir(model_dir) and any(
        os.path.exists(os.path.join(model_dir, f)) for f in TOKENIZER_FILES)


class HFTokenizer:
    def __init__(self, model_dir):
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot load the tokenizer saved in {model_dir}: {e}; "
                            "pass --tokenizer byte to use the byte-level tokenizer") from e
        self.path = model_dir
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id

    def describe(self):
        """Where the tokenizer comes from, as recorded in checkpoints."""
        return {"kind": "hf", "path": os.path.abspath(self.path)}

    def save_pretrained(self, directory):
        """The tokenizer's Hugging Face files, written to ``directory``."""
        return list(self.tok.save_pretrained(directory))

    def encode_array(self, text):
        ids = self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def encode(self, text):
        return self.encode_array(text).tolist()

    def decode(self, ids):
        return self.tok.decode(list(ids))

    def __repr__(self):
        return f"HFTokenizer({self.path!r}, vocab {self.vocab_size})"


def write_tokenizer(source, directory):
    """Write the tokenizer a checkpoint's meta records (``{"kind": "byte"}`` or
    ``{"kind": "hf", "path": DIR}``) to ``directory`` as Hugging Face files. Returns the
    files written; raises :class:`DataError` when the source is gone or unreadable."""
    from infinity.data.tokenizer import ByteTokenizer

    kind = source.get("kind") if isinstance(source, dict) else None
    if kind == "byte":
        return ByteTokenizer().save_pretrained(directory)
    if kind == "hf":
        path = source.get("path")
        if not (isinstance(path, str) and has_tokenizer(path)):
            raise DataError(f"the tokenizer was loaded from {path}, which holds no tokenizer "
                            "files any more; copy them into the export directory by hand")
        return HFTokenizer(path).save_pretrained(directory)
    raise DataError(f"unknown tokenizer source {source!r}")
