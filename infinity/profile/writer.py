"""Write a timeline's outputs into a directory: trace.json, timeline.png, summary.json/.txt."""
import json
import logging
import os

from .chrome_trace import trace_dict
from .summary import format_summary, summarize
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.profile")


def output_names(rank=0):
    """File names used for ``rank`` (rank 0 unsuffixed, others ``-rank<r>``)."""
    sfx = "" if rank == 0 else f"-rank{rank}"
    return {"trace": f"trace{sfx}.json", "plot": f"timeline{sfx}.png",
            "summary_json": f"summary{sfx}.json", "summary_txt": f"summary{sfx}.txt"}


def _atomic_write(path, data, mode="w"):
    """Write ``path`` through a temp sibling renamed into place; no temp file is left
    behind when writing fails (the error propagates)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, **({"encoding": "utf-8"} if "b" not in mode else {})) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_outputs(timeline, dir, *, ceilings=None, counters=None, plot=True, note=None):
    """See :meth:`infinity.profile.Timeline.write`."""
    dir = os.fspath(dir)
    try:
        makedirs(dir)
    except OSError as e:
        raise OSError(e.errno, f"cannot create the profile directory {dir!r}: {e.strerror}; "
                      "pass a writable directory") from e
    names = output_names(timeline.rank)
    paths = {k: os.path.join(dir, v) for k, v in names.items()}
    summary = summarize(timeline, ceilings=ceilings, counters=counters, note=note)
    _atomic_write(paths["trace"], json.dumps(trace_dict(timeline), separators=(",", ":")))
    _atomic_write(paths["summary_json"], json.dumps(summary, indent=1, default=_jsonable))
    _atomic_write(paths["summary_txt"], format_summary(summary))
    if plot:
        from .plot import plot_timeline
        tmp = paths["plot"] + f".tmp{os.getpid()}"
        plot_timeline(timeline, tmp, title=summary["bottleneck"]["sentence"])
        os.replace(tmp, paths["plot"])
    else:
        paths["plot"] = None
    log.info("profile written to %s: %s", dir, summary["bottleneck"]["sentence"])
    paths["summary"] = summary
    return paths


def _jsonable(o):
    if isinstance(o, tuple):
        return list(o)
    return str(o)
