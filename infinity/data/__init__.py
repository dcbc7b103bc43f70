"""Training data for `infinity finetune`: a byte-level tokenizer, the shipped
public-domain corpus, text/dir/.jsonl loading and token batching."""
from infinity.data.tokenizer import ByteTokenizer
from infinity.data.loading import DataError, load_texts, shipped_corpus_path
from infinity.data.batching import TokenBatcher
from infinity.data.hf_tokenizer import HFTokenizer, has_tokenizer, write_tokenizer

__all__ = ["ByteTokenizer", "DataError", "load_texts", "shipped_corpus_path", "TokenBatcher", "HFTokenizer",
           "has_tokenizer", "write_tokenizer"]
