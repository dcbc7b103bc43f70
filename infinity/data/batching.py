"""Token batching: documents -> one token stream -> (batch, seq_len) windows.

Each document is encoded (``tokenizer.encode_array``) and followed by the
tokenizer's ``<eos>`` (when it has one); the stream is cut into
non-overlapping windows of ``seq_len`` tokens. Every epoch visits the windows
in a fresh seeded order; global batch ``b`` takes ``batch_size * world_size``
consecutive windows of that order and rank ``r`` keeps its own
``batch_size`` of them, so ranks see disjoint data and the union over ranks
is exactly what a single process with ``world_size`` times the batch would
see. Small corpora simply cycle.
"""
import numpy as np
import torch

from infinity.data.loading import DataError


class TokenBatcher:
    def __init__(self, texts, tokenizer, *, seq_len, batch_size, rank=0, world_size=1, seed=0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        chunks = []
        eos = getattr(tokenizer, "eos_token_id", None)
        for t in texts:
            chunks.append(tokenizer.encode_array(t))
            if eos is not None:  # documents are separated by <eos>
                chunks.append(np.array([eos], dtype=np.int64))
        stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        n_windows = len(stream) // seq_len
        if n_windows < 1:
            raise DataError(f"the data has {len(stream)} tokens, fewer than one sequence of "
                            f"{seq_len}; give more text or a smaller --seq-len")
        self.tokens = torch.from_numpy(stream[: n_windows * seq_len].copy()).view(n_windows, seq_len)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self._orders = {}

    @property
    def num_windows(self):
        return self.tokens.shape[0]

    @property
    def num_tokens(self):
        return self.tokens.numel()

    def _window_index(self, k):
        epoch, pos = divmod(k, self.num_windows)
        order = self._orders.get(epoch)
        if order is None:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            order = torch.randperm(self.num_windows, generator=g)
            self._orders = {epoch: order}  # keep only the current epoch
        return int(order[pos])

    def batch(self, index):
        """Batch number ``index`` (0-based) for this rank: int64 tensor ``(batch_size, seq_len)``.
        Deterministic in (seed, index), so resuming at step ``s`` continues the stream."""
        per_step = self.batch_size * self.world_size
        first = index * per_step + self.rank * self.batch_size
        rows = [self._window_index(first + j) for j in range(self.batch_size)]
        return self.tokens[rows].clone()

    def __iter__(self):
        i = 0
        while True:
            yield self.batch(i)
            i += 1
