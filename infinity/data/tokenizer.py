"""Byte-level tokenizer: token ids 0..255 are the UTF-8 bytes, then specials.

No vocabulary file, no network, round-trips any text exactly. Models that use
it need ``vocab_size >= ByteTokenizer.vocab_size`` (the shipped configs use a
multiple of 8 above it).
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
