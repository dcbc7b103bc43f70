"""Byte-level tokenizer: token ids 0..255 are the UTF-8 bytes, then specials.

No vocabulary file, no network, round-trips any text exactly. Models that use
it need ``vocab_size >= ByteTokenizer.vocab_size`` (the shipped configs use a
multiple of 8 above it).

:meth:`ByteTokenizer.save_pretrained` writes the same tokenizer as Hugging Face
files (``tokenizer.json`` for the ``tokenizers`` library: a byte-level BPE with the
256 bytes as its vocabulary, in id order, no merges, plus the three specials;
``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``), so
``AutoTokenizer.from_pretrained(dir)`` gives the same ids for any text (text that
spells a special token, e.g. ``"<eos>"``, is that token there, bytes here).
"""


class ByteTokenizer:
    """UTF-8 bytes as tokens plus ``<pad>``, ``<bos>``, ``<eos>``."""

    NUM_BYTES = 256
    PAD = 256
    BOS = 257
    EOS = 258
    SPECIALS = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS}
    vocab_size = 259

    pad_token_id = PAD
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text, *, add_bos=False, add_eos=False):
        """Text -> list of ints. ``text`` must be a ``str``."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.BOS)
        if add_eos:
            ids.append(self.EOS)
        return ids

    def describe(self):
        """Where the tokenizer comes from, as recorded in checkpoints."""
        return {"kind": "byte"}

    def save_pretrained(self, directory):
        """Write Hugging Face tokenizer files for this tokenizer to ``directory``; returns
        the paths written. ``AutoTokenizer.from_pretrained(directory)`` loads them (a
        ``PreTrainedTokenizerFast``) and encodes any text to the same ids as :meth:`encode`."""
        import os

        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        b2u = _bytes_to_unicode()
        vocab = {b2u[b]: b for b in range(self.NUM_BYTES)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        by_id = sorted(self.SPECIALS.items(), key=lambda kv: kv[1])
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)
                                for name, _ in by_id])
        for name, i in by_id:
            if tok.token_to_id(name) != i:
                raise RuntimeError(f"byte tokenizer export: {name} got id {tok.token_to_id(name)}, "
                                   f"expected {i}")
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                       eos_token="<eos>", clean_up_tokenization_spaces=False)
        os.makedirs(directory, exist_ok=True)
        files = [str(f) for f in fast.save_pretrained(directory)]
        # transformers 5 names its class TokenizersBackend; PreTrainedTokenizerFast is what
        # transformers 4 knows, and 5 still loads it (an alias)
        import json
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            if cfg.get("tokenizer_class") != "PreTrainedTokenizerFast":
                cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
                with open(cfg_path, "w", encoding="utf-8") as f:
                    json.dump(cfg, f, indent=2, sort_keys=True)
                    f.write("\n")
        return files

    def encode_bytes(self, text):
        """Text -> ``bytes`` (the token ids of the byte range, compactly)."""
        return text.encode("utf-8")

    def encode_array(self, text):
        """Text -> int64 numpy array of byte ids (what the batcher consumes)."""
        import numpy as np

        return np.frombuffer(self.encode_bytes(text), dtype=np.uint8).astype(np.int64)

    def decode(self, ids, *, skip_special=True):
        """Ids -> text. Invalid UTF-8 (e.g. a cut multi-byte char) is replaced,
        specials are dropped (or rendered as their names)."""
        out = bytearray()
        names = {v: k for k, v in self.SPECIALS.items()}
        parts = []
        for i in ids:
            i = int(i)
            if 0 <= i < self.NUM_BYTES:
                out.append(i)
            elif i in names:
                if not skip_special:
                    parts.append(out.decode("utf-8", errors="replace"))
                    parts.append(names[i])
                    out = bytearray()
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)


def _bytes_to_unicode():
    """GPT-2's byte -> printable unicode character map (what the ``tokenizers``
    ByteLevel pre-tokenizer turns each byte into), indexed by byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    m = dict(zip(bs, (chr(c) for c in cs)))
    return [m[b] for b in range(256)]
