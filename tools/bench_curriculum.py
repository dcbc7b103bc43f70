"""Sequence-length warm-up against full-length training at a learning rate where the
full-length run spikes: the built-in model (`infinity finetune` defaults: tiny-llama on the
shipped corpus, 16 x 256 tokens per step), the same lr, seed and data order, compared at the
same number of tokens seen (the warm-up's early steps are shorter, so it runs more steps).

    .venv/bin/python tools/bench_curriculum.py --workdir /tmp/bc [--lr 3e-2] [--steps 60]

Prints, per run, the worst loss in the first third of the token budget (the spike), the mean
loss over the last 10 % of the budget, and writes ``curriculum.png`` (loss against tokens
seen) into the working directory (``--png`` to put it elsewhere).  ``--reuse`` reads the
runs' ``*.jsonl`` already in the working directory instead of running them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUNS = (("full length", None), ("warm-up linear 32 -> 256 over 30 steps", "seqlen:32:30"),
        ("warm-up root 32 -> 256 over 30 steps", "seqlen:32:30:root"))


def _name(spec):
    return "base" if spec is None else "cur-" + spec.replace(":", "_")


def run(workdir, spec, lr, steps):
    """One ``infinity finetune --json`` run; its per-step records."""
    path = os.path.join(workdir, _name(spec) + ".jsonl")
    cmd = [sys.executable, "-m", "infinity", "finetune", "--steps", str(steps), "--lr", str(lr),
           "--json", "--nvme-path", os.path.join(workdir, "swap")]
    if spec is not None:
        cmd += ["--curriculum", spec]
    with open(path, "w") as out:
        subprocess.run(cmd, stdout=out, stderr=subprocess.DEVNULL, check=True, cwd=workdir)
    return load(path)


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def curve(records):
    """(tokens seen after each step, loss of that step)."""
    seen, xs, ys = 0, [], []
    for r in records:
        seen += int(r["tokens"])
        xs.append(seen)
        ys.append(float(r["loss"]))
    return xs, ys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--steps", type=int, default=60, help="steps of the full-length run")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    curves = {}
    for label, spec in RUNS:
        path = os.path.join(a.workdir, _name(spec) + ".jsonl")
        if a.reuse:
            recs = load(path)
        else:   # the warm-up sees fewer tokens per early step: 1.5x the steps covers the budget
            recs = run(a.workdir, spec, a.lr, a.steps if spec is None else int(a.steps * 1.5))
        curves[label] = curve(recs)
    budget = curves["full length"][0][-1]
    print(f"lr {a.lr:g}, token budget {budget:,} (the full-length run's {a.steps} steps)")
    print(f"{'run':44s} {'steps':>5s} {'worst loss, first third':>24s} {'mean loss, last 10 %':>21s}")
    rows = {}
    for label, (xs, ys) in curves.items():
        if xs[-1] < budget:
            raise SystemExit(f"{label}: saw {xs[-1]:,} tokens < the budget {budget:,}: run it longer")
        n = next(i for i, x in enumerate(xs) if x >= budget) + 1
        first = [y for x, y in zip(xs[:n], ys[:n]) if x <= budget / 3]
        last = [y for x, y in zip(xs[:n], ys[:n]) if x >= 0.9 * budget]
        rows[label] = (n, max(first), sum(last) / len(last))
        print(f"{label:44s} {n:5d} {max(first):24.3f} {sum(last) / len(last):21.3f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in curves.items():
        n = rows[label][0]
        ax.plot(xs[:n], ys[:n], label=label)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("training loss")
    ax.set_title(f"tiny-llama, lr {a.lr:g}: sequence-length warm-up vs full length")
    ax.legend()
    fig.tight_layout()
    png = a.png or os.path.join(a.workdir, "curriculum.png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
