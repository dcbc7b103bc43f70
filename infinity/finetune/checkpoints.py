"""Checkpoints of a fine-tuning run: ``--save DIR``, ``--save-every N``,
``--keep-last K``, resume by default, ``--restart``.

Saving and loading go through ``engine.save_checkpoint(dir, tag)`` /
``engine.load_checkpoint(dir)`` (sharded, atomic, ``latest`` pointer: see
``infinity.checkpoint``). Tags are ``step-<8 digits>``, so the step to resume
from is read from the tag ``latest`` names — and the data stream continues at
that step (batches are a pure function of seed and index). Each checkpoint's meta
records the model's config and the tokenizer's source
(:func:`infinity.checkpoint.model_meta`), so ``infinity export`` writes a directory
``from_pretrained`` loads. It also records which run wrote it (model, data, training keys:
:mod:`infinity.finetune.identity`), so a later ``finetune`` with the same ``--save``
resumes the same run and refuses another one (:func:`check_save_dir`); ``--restart``
moves the old checkpoints into ``DIR/previous-<UTC time>/`` (:func:`move_aside`).
"""
import logging
import os
import re
import time
from dataclasses import dataclass

from infinity.checkpoint import delete_checkpoint

log = logging.getLogger("infinity.finetune")

TAG_RE = re.compile(r"^step-(\d{8})$")
PREVIOUS_PREFIX = "previous-"


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
    def __init__(self, root, *, keep_last=0, is_rank0=True, extra_meta=None, step_meta=None):
        self.root = os.fspath(root)
        self.extra_meta = extra_meta or None   # the model's config + tokenizer source
        self.step_meta = step_meta             # step -> more meta (the curriculum's state)
        self.loaded_meta = None                # the meta of the checkpoint resume() loaded
        self.keep_last = keep_last
        self.is_rank0 = is_rank0

    @staticmethod
    def tag_for(step):
        return f"step-{step:08d}"

    def save(self, engine, step):
        tag = self.tag_for(step)
        save = _require(engine, "save_checkpoint")
        meta = dict(self.extra_meta or {}, **(self.step_meta(step) if self.step_meta else {}))
        if meta:
            save(self.root, tag=tag, extra_meta=meta)
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
        self.loaded_meta = _require(engine, "load_checkpoint")(self.root)
        step = int(m.group(1))
        # the run printed "resuming from step N" already (finetune.run._check_save_dir)
        log.debug("resumed from %s (step %d)", os.path.join(self.root, tag), step)
        return step


@dataclass
class SaveDirState:
    """What ``--save DIR`` holds before the run starts."""
    tag: str = None          # the checkpoint ``latest`` names (None: nothing to resume)
    step: int = 0
    run: dict = None         # the identity recorded in its meta (None: an older checkpoint)
    error: str = None        # why the latest checkpoint cannot be read


def inspect_save_dir(root):
    """Read ``root/latest``'s manifest (validated, no tensor read) without an engine."""
    from infinity.checkpoint import CheckpointError, CheckpointReader

    if not os.path.exists(os.path.join(root, "latest")):
        return SaveDirState()
    try:
        with CheckpointReader(root) as r:
            tag, meta = r.tag, r.meta
    except CheckpointError as e:
        return SaveDirState(tag="latest", error=str(e))
    m = TAG_RE.match(tag or "")
    if not m:
        return SaveDirState(tag=tag, error=f"{root}/latest names {tag!r}, not a finetune "
                                           "checkpoint (step-NNNNNNNN)")
    from infinity.finetune.identity import META_KEY

    run = meta.get(META_KEY) if isinstance(meta, dict) else None
    return SaveDirState(tag=tag, step=int(m.group(1)), run=run if isinstance(run, dict) else None)


def move_aside(root, now=None):
    """Move everything in ``root`` except earlier ``previous-*`` folders into
    ``root/previous-<UTC time>/`` (never deletes); returns that folder, or None when there
    was nothing to move."""
    try:
        names = [n for n in os.listdir(root) if not n.startswith(PREVIOUS_PREFIX)]
    except FileNotFoundError:
        return None
    if not names:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    dest = os.path.join(root, PREVIOUS_PREFIX + stamp)
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(root, f"{PREVIOUS_PREFIX}{stamp}-{n}")
    os.mkdir(dest, 0o700)
    # ``latest`` last: an interruption leaves it naming a moved tag, which the next run
    # refuses (and ``--restart`` again finishes the move), never a silent fresh start
    for name in sorted(names, key=lambda x: x == "latest"):
        os.rename(os.path.join(root, name), os.path.join(dest, name))
    return dest
