"""Checkpoints of a fine-tuning run: ``--save DIR``, ``--save-every N``,
``--keep-last K``, ``--resume``.

Saving and loading go through ``engine.save_checkpoint(dir, tag)`` /
``engine.load_checkpoint(dir)`` (sharded, atomic, ``latest`` pointer: see
``infinity.checkpoint``). Tags are ``step-<8 digits>``, so the step to resume
from is read from the tag ``latest`` names — and the data stream continues at
that step (batches are a pure function of seed and index). Each checkpoint's meta
records the model's config and the tokenizer's source
(:func:`infinity.checkpoint.model_meta`), so ``infinity export`` writes a directory
``from_pretrained`` loads.
"""
import logging
import os
import re

from infinity.checkpoint import delete_checkpoint

log = logging.getLogger("infinity.finetune")

TAG_RE = re.compile(r"^step-(\d{8})$")


class CheckpointUnavailable(RuntimeError):
    """The engine in this build cannot save/load checkpoints."""


def _require(engine, method):
    fn = getattr(engine, method, None)
    if fn is None:
        raise CheckpointUnavailable(
            f"checkpointing is not available yet in this build (engine has no {method}()); "
            "run without --save/--resume")
    return fn


class Checkpointer:
    def __init__(self, root, *, keep_last=0, is_rank0=True, extra_meta=None):
        self.root = os.fspath(root)
        self.extra_meta = extra_meta or None   # the model's config + tokenizer source
        self.keep_last = keep_last
        self.is_rank0 = is_rank0

    @staticmethod
    def tag_for(step):
        return f"step-{step:08d}"

    def save(self, engine, step):
        tag = self.tag_for(step)
        save = _require(engine, "save_checkpoint")
        if self.extra_meta:
            save(self.root, tag=tag, extra_meta=self.extra_meta)
        else:
            save(self.root, tag=tag)
        log.info("saved checkpoint %s", os.path.join(self.root, tag))
        self._prune()
        return tag

    def latest_tag(self):
        path = os.path.join(self.root, "latest")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(1024).strip() or None
        except FileNotFoundError:
            return None

    def step_tags(self):
        """Committed ``step-*`` tags, oldest first."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        tags = [n for n in names if TAG_RE.match(n)
                and os.path.isfile(os.path.join(self.root, n, "manifest.json"))]
        return sorted(tags)

    def _prune(self):
        if not self.keep_last or not self.is_rank0:
            return
        latest = self.latest_tag()
        tags = self.step_tags()
        for tag in tags[:-self.keep_last]:
            if tag == latest:
                continue
            path = os.path.join(self.root, tag)
            try:
                # rename-then-remove: an interrupted prune never leaves a half-deleted tag
                delete_checkpoint(self.root, tag)
                log.info("removed old checkpoint %s (--keep-last %d)", path, self.keep_last)
            except OSError as e:
                log.warning("could not remove old checkpoint %s: %s", path, e)

    def resume(self, engine):
        """Load ``latest``; returns the step it was saved at (0 when there is none)."""
        tag = self.latest_tag()
        if tag is None:
            log.warning("--resume: no checkpoint under %s yet, starting from step 0", self.root)
            return 0
        m = TAG_RE.match(tag)
        if not m:
            raise CheckpointUnavailable(
                f"--resume: {self.root}/latest names {tag!r}, not a finetune checkpoint "
                "(step-NNNNNNNN); load it with engine.load_checkpoint in Python instead")
        _require(engine, "load_checkpoint")(self.root)
        step = int(m.group(1))
        log.info("resumed from %s (step %d)", os.path.join(self.root, tag), step)
        return step
