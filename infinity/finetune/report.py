"""Progress, JSON lines and the final summary of `infinity finetune`.

- stdout is reserved for ``--json``: exactly one JSON object per step, nothing else.
- everything human-readable goes to stderr: a tqdm bar on a terminal, one plain
  line per step otherwise (logs, CI), and the final summary table.
- only rank 0 reports (other ranks get a silent reporter).

``params_text`` / ``frozen_base_text`` are the summary's ``params`` and ``frozen base``
rows: trainable (LoRA adapter) parameters against the total, and the format and bytes of
the frozen base.
"""
import json
import math
import sys
import time

LINKS = ("nvme_read", "nvme_write", "h2d", "d2h", "allgather", "reduce_scatter")
_LINK_LABEL = {"nvme_read": "nvme rd", "nvme_write": "nvme wr", "h2d": "h2d", "d2h": "d2h",
               "allgather": "allgather", "reduce_scatter": "red-scat"}


def link_bytes(stats):
    """Cumulative bytes moved per link from ``engine.stats()``.

    Accepts the shapes the engine may report: ``{"links": {name: {"bytes": n}}}``,
    ``{"links": {name: n}}``, ``{"bytes_moved": {name: n}}`` or flat ``"<name>_bytes"``.
    Links the engine does not report are 0.
    """
    out = {k: 0 for k in LINKS}
    if not isinstance(stats, dict):
        return out
    for container_key in ("links", "bytes_moved", "link_bytes"):
        c = stats.get(container_key)
        if isinstance(c, dict):
            for k in LINKS:
                v = c.get(k)
                if isinstance(v, dict):
                    v = v.get("bytes", v.get("nbytes", 0))
                if isinstance(v, (int, float)):
                    out[k] = int(v)
            return out
    for k in LINKS:
        v = stats.get(f"{k}_bytes")
        if isinstance(v, (int, float)):
            out[k] = int(v)
    return out


def _fmt_bytes(n):
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _finite(x):
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def wear_text(written_per_step: float, tokens_per_step: float, drive_tbw=None) -> str:
    """NVMe TB written per step and per million tokens; with the drives' rating (total TB
    written), their life in steps and tokens at this rate."""
    tb = written_per_step / 1e12
    out = f"{tb:.4g} TB written per step, {tb * 1e6 / max(1, tokens_per_step):.4g} TB per million tokens"
    if drive_tbw and tb > 0:
        steps = drive_tbw / tb
        out += (f"; rated {drive_tbw:g} TB written: {steps:,.0f} steps, "
                f"{steps * tokens_per_step / 1e9:,.3g} B tokens")
    return out


def _count(n):
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def params_text(trainable, total, lora=None):
    """``trainable 8,704 of 5.13 M (0.17 %): LoRA rank 8, ...`` (full fine-tuning: all)."""
    pct = 100.0 * trainable / total if total else 0.0
    head = f"trainable {_count(trainable)} of {_count(total)} ({pct:.3g} %)"
    if lora is None:
        return f"{head}: full fine-tuning"
    return f"{head}: {lora}"


def frozen_base_text(fmt, *, working, read_bytes=None):
    """The frozen base: its stored format (``fmt`` from
    :func:`infinity.finetune.lora.frozen_format`, None: the working precision ``working``)
    and the bytes it was read over the run."""
    if fmt is None:
        out = (f"{working}, the working precision (--frozen-dtype nf4|int8|int4 keeps it "
               "quantized at its home)")
    else:
        opts = f"group size {fmt['group_size']}" + (", double quant" if fmt["double_quant"]
                                                    else "")
        out = (f"{fmt['dtype']} ({opts}): {_fmt_bytes(fmt['home_bytes'])} at its home instead "
               f"of {_fmt_bytes(fmt['bytes'])} in {working}")
    if read_bytes is not None:
        out += f"; {_fmt_bytes(read_bytes)} read over the run"
    return out


class Reporter:
    """Collects per-step records; prints them as the mode asks."""

    def __init__(self, *, total_steps, json_lines=False, enabled=True, stdout=None, stderr=None,
                 progress=None, drive_tbw=None):
        self.total_steps = total_steps
        self.drive_tbw = drive_tbw      # the drives' rated TB written (None: not given)
        self.json_lines = json_lines
        self.enabled = enabled
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.records = []
        self.stdout_broken = False
        self._bar = None
        self._redirect = None
        self._t_start = time.perf_counter()
        if progress is None:
            progress = enabled and hasattr(self.stderr, "isatty") and self.stderr.isatty()
        self._progress = progress
        self._initial = 0
        self.run_info = {}      # constant fields of every --json line (params, frozen base)

    def _ensure_bar(self):
        """Created at the first step, so setup time and setup logs stay off the bar."""
        if self._bar is not None or not self._progress:
            return
        import os
        import shutil

        from tqdm import tqdm

        try:  # the width of the terminal stderr is on (0 on a size-less pty: fall back)
            cols = os.get_terminal_size(self.stderr.fileno()).columns
        except (OSError, ValueError, AttributeError):
            cols = 0
        cols = cols or shutil.get_terminal_size((120, 24)).columns or 120
        self._bar = tqdm(total=self.total_steps, initial=self._initial, file=self.stderr,
                         unit="step", ncols=cols, leave=True)
        try:  # library log lines print above the bar instead of through it
            import logging

            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger("infinity")])
            self._redirect.__enter__()
        except ImportError:
            self._redirect = None

    def info(self, msg):
        if self.enabled:
            if self._bar is not None:
                self._bar.write(msg, file=self.stderr)
            else:
                print(msg, file=self.stderr, flush=True)

    def start(self):
        """Training begins (shows the progress bar on a terminal)."""
        self._ensure_bar()

    def set_run_info(self, info):
        """Fields every ``--json`` line carries (``trainable_params``, ``total_params``, and
        ``frozen_dtype`` when the frozen base is kept quantized)."""
        self.run_info = dict(info or {})

    def set_initial(self, step):
        """Steps already done (resume): the bar starts there."""
        self._initial = step

    def step(self, rec):
        """``rec``: step, loss, lr, grad_norm, tokens, tokens_per_s, step_time_s,
        bytes (dict per link, this step), gbps (dict per link, this step)."""
        self.records.append(rec)
        if not self.enabled:
            return
        if self.json_lines:
            flat = {k: v for k, v in rec.items() if k not in ("bytes", "gbps")}
            flat.update(self.run_info)
            for k in LINKS:
                flat[f"{k}_bytes"] = rec["bytes"].get(k, 0)
                flat[f"{k}_gbps"] = round(rec["gbps"].get(k, 0.0), 4)
            try:
                print(json.dumps(flat), file=self.stdout, flush=True)
            except BrokenPipeError:
                self._stdout_closed()
        self._ensure_bar()
        links = " ".join(f"{_LINK_LABEL[k]} {rec['gbps'][k]:.3g} GB/s" for k in LINKS
                         if rec["bytes"].get(k))
        gn = rec.get("grad_norm")
        gn_s = f"{gn:.3f}" if _finite(gn) else "n/a"
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {rec['loss']:.4f} | "
                                      + (f"seqlen {rec['seqlen']} | " if rec.get("seqlen") else "")
                                      + f"{rec['tokens_per_s']:.0f} tok/s | "
                                      f"{rec['step_time_s']:.2f}s/step | gnorm {gn_s}"
                                      + (f" | {links}" if links else ""), refresh=False)
            self._bar.update(1)
        else:
            seq = f" seqlen {rec['seqlen']}" if rec.get("seqlen") is not None else ""
            print(f"step {rec['step']}/{self.total_steps} loss {rec['loss']:.4f} lr {rec['lr']:.3g} "
                  f"gnorm {gn_s}{seq} {rec['tokens_per_s']:.0f} tok/s {rec['step_time_s']:.2f} s"
                  + (f" | {links}" if links else ""), file=self.stderr, flush=True)

    def _stdout_closed(self):
        """The reader of ``--json`` went away (e.g. ``| head``): stop writing, ask the
        loop to stop cleanly, and keep Python's exit-time flush from failing."""
        import os

        self.json_lines = False
        self.stdout_broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        print("stdout was closed: stopping at the next step boundary", file=self.stderr, flush=True)

    def close(self):
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def summary(self, *, stop_reason=None, extra=None):
        """The final table as a string (and printed to stderr)."""
        self.close()
        recs = self.records
        rows = []
        if recs:
            n = len(recs)
            k = max(1, min(3, n // 2))
            first = sum(r["loss"] for r in recs[:k]) / k
            last = sum(r["loss"] for r in recs[-k:]) / k
            wall = sum(r["step_time_s"] for r in recs)
            tokens = sum(r["tokens"] for r in recs)
            rows += [("steps", f"{recs[0]['step']}..{recs[-1]['step']} ({n} run)"),
                     ("loss", f"{recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f}"),
                     (f"loss mean first {k} -> last {k}",
                      f"{first:.4f} -> {last:.4f} ({(last - first) / first * 100:+.1f} %)"
                      if first else "n/a"),
                     ("tokens", f"{tokens:,}"),
                     ("step time (mean)", f"{wall / n:.3f} s"),
                     ("throughput", f"{tokens / wall:,.0f} tokens/s" if wall > 0 else "n/a")]
            for link in LINKS:
                b = sum(r["bytes"].get(link, 0) for r in recs)
                if b:
                    rows.append((f"{link}", f"{_fmt_bytes(b)} total, {b / wall / 1e9:.3f} GB/s "
                                 "over step time"))
            written = sum(r["bytes"].get("nvme_write", 0) for r in recs)
            if written:
                rows.append(("drive wear", wear_text(written / n, tokens / n, self.drive_tbw)))
        else:
            rows.append(("steps", "none completed"))
        for key, val in (extra or {}).items():
            rows.append((key, str(val)))
        if stop_reason:
            rows.append(("stopped", stop_reason))
        width = max(len(r[0]) for r in rows)
        lines = ["", "infinity finetune summary", "-" * (width + 40)]
        lines += [f"{name.ljust(width)}  {val}" for name, val in rows]
        text = "\n".join(lines)
        if self.enabled:
            print(text, file=self.stderr, flush=True)
        return text
