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

    def encode_array(self, text):
        ids = self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def encode(self, text):
        return self.encode_array(text).tolist()

    def decode(self, ids):
        return self.tok.decode(list(ids))

    def __repr__(self):
        return f"HFTokenizer({self.path!r}, vocab {self.vocab_size})"
