"""Sharded, checksummed, atomic checkpoints (DESIGN §3.6; docs/checkpoints.md).

A checkpoint is ``dir/<tag>/`` holding ``rank<r>-<n>.safetensors`` files (written
tensor by tensor, bounded size, 0600) and ``manifest.json`` (names, shapes,
dtypes, which file/byte range holds each tensor or tensor piece, world size, a
SHA-256 per file region, free-form JSON ``meta``). It is written under
``dir/.tmp-<tag>-<pid>``, fsynced and renamed into place; ``dir/latest`` is
replaced atomically last. Nothing is pickled; reading validates everything.

Protocol the engine implements::

    class Checkpointable(Protocol):
        def checkpoint_tensors(self) -> Iterator[tuple[str, Tensor] | tuple[str, Tensor, Piece]]
        def checkpoint_meta(self) -> dict                 # JSON-able
        def checkpoint_expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]
        def load_checkpoint_tensors(self, reader: CheckpointReader) -> None
        def load_checkpoint_meta(self, meta: dict) -> None

    save_checkpoint(obj, dir, tag=None, *, step=None, shard_bytes=1 << 30,
                    async_=False, max_host_bytes=1 << 30) -> SaveHandle
    load_checkpoint(obj, dir, tag=None, *, strict=True) -> meta dict
    delete_checkpoint(dir, tag, *, allow_latest=False)   # atomic disappearance
    export_model(dir, out, tag=None)        # weights (+ config.json when the meta records the model)
    model_meta(model, tokenizer=None)       # extra_meta= for save_checkpoint: the model's config
"""
from .api import (Checkpointable, SaveHandle, default_tag, load_checkpoint, save_checkpoint,
                  wait_pending)
from .errors import CheckpointError
from .export import export_model, model_meta
from .reader import CheckpointReader, list_tags, resolve_tag
from .rng import rng_state_from_json, rng_state_to_json
from .writer import Piece
from .writer import delete as delete_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "Checkpointable", "Piece", "SaveHandle",
           "default_tag", "delete_checkpoint", "export_model", "list_tags", "model_meta", "load_checkpoint", "resolve_tag",
           "rng_state_from_json", "rng_state_to_json", "save_checkpoint", "wait_pending"]
