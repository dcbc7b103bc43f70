"""Extent allocator: aligned ranges of a linear swap address space.

First fit over a sorted free list with coalescing; the space grows at the end
when nothing fits (the caller then grows the backing files).  Its methods change two
structures in several statements: a signal's exception raised half-way (Ctrl-C inside
the engine's interruptible boundary step) would leave a free range in one and not the
other, so a signal landing in their frames (:data:`ExtentAllocator.UNSPLIT`) is held to
the next safe point (Note [held interrupts] in infinity/runtime/interrupts.py, which
registers them).
"""
import bisect
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Extent:
    """A range of swap space: `nbytes` usable bytes at virtual offset `start`.

    `span` is `nbytes` rounded up to the allocator's alignment.
    """
    start: int
    nbytes: int
    span: int

    @property
    def end(self):
        return self.start + self.span


class ExtentAllocator:
    #: methods a signal's exception must not split (held: infinity.runtime.interrupts)
    UNSPLIT = ("allocate", "undo_grow", "free", "_insert_free")

    def __init__(self, alignment=4096):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self._starts = []   # sorted starts of free ranges
        self._sizes = {}    # start -> size
        self._live = {}     # start -> Extent
        self.end = 0        # high-water mark of the address space
        self.allocated = 0  # bytes in live extents (spans)
        self._lock = threading.Lock()

    def round_up(self, n):
        a = self.alignment
        return (n + a - 1) // a * a

    def allocate(self, nbytes):
        """Returns (extent, new_end): new_end > old end when the space had to grow."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        span = max(self.alignment, self.round_up(nbytes))
        with self._lock:
            for i, s in enumerate(self._starts):
                size = self._sizes[s]
                if size >= span:
                    del self._starts[i]
                    del self._sizes[s]
                    if size > span:
                        self._insert_free(s + span, size - span)
                    ext = Extent(s, nbytes, span)
                    self._live[s] = ext
                    self.allocated += span
                    return ext
            # Grow at the end, absorbing a free range that touches the end.
            start = self.end
            if self._starts and self._starts[-1] + self._sizes[self._starts[-1]] == self.end:
                start = self._starts.pop()
                del self._sizes[start]
            ext = Extent(start, nbytes, span)
            self.end = start + span
            self._live[start] = ext
            self.allocated += span
            return ext

    def undo_grow(self, ext, old_end):
        """Rolls back an allocate() whose backing growth failed."""
        with self._lock:
            self._live.pop(ext.start, None)
            self.allocated -= ext.span
            self.end = old_end
            if ext.start < old_end:
                self._insert_free(ext.start, old_end - ext.start)

    def free(self, ext):
        with self._lock:
            live = self._live.get(ext.start)
            if live is None or live != ext:
                raise ValueError(f"extent {ext} is not allocated here (double free?)")
            del self._live[ext.start]
            self.allocated -= ext.span
            start, size = ext.start, ext.span
            i = bisect.bisect_left(self._starts, start)
            if i > 0:  # merge with the previous free range
                p = self._starts[i - 1]
                if p + self._sizes[p] == start:
                    start, size = p, size + self._sizes[p]
                    del self._starts[i - 1]
                    del self._sizes[p]
                    i -= 1
            if i < len(self._starts) and self._starts[i] == start + size:  # and the next
                n = self._starts[i]
                size += self._sizes.pop(n)
                del self._starts[i]
            self._insert_free(start, size)

    def is_live(self, ext):
        return self._live.get(ext.start) == ext

    def _insert_free(self, start, size):
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._sizes[start] = size

