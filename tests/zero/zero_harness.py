"""Spawn N ranks of a child script as ``torchrun`` would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK in the environment), each with a hard timeout; always kill
what is left on the way out."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def child_entry(main) -> None:
    """``if __name__ == "__main__": child_entry(main)`` in a rank child: any failure prints
    its traceback and exits 3 at once (``os._exit``: no atexit hook may hang on a dead peer)."""
    import traceback
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankResult:
    def __init__(self, rank, returncode, stdout, stderr, seconds, result):
        self.rank = rank
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.seconds = seconds
        self.result = result

    def __repr__(self):
        return (f"RankResult(rank={self.rank}, rc={self.returncode}, {self.seconds:.1f}s, "
                f"stderr tail={self.stderr[-2000:]!r})")


def run_ranks(script: str, spec: dict, tmp_path, *, world_size: int = 2,
              timeout: float = 120.0, local_world_size: int | None = None) -> list[RankResult]:
    """Run ``script`` (a file in tests/zero) on ``world_size`` ranks with ``spec`` (JSON).
    Each rank writes ``<out>/rank<r>.json``; returns one RankResult per rank.
    ``local_world_size``: ranks per (pretend) node: ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK``
    as torchrun sets them on each node."""
    out = Path(tmp_path) / f"ranks-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs = []
    t0 = time.monotonic()
    try:
        for r in range(world_size):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            if local_world_size:
                env.update(LOCAL_RANK=str(r % local_world_size),
                           LOCAL_WORLD_SIZE=str(local_world_size))
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / script), str(spec_path), str(out / f"rank{r}.json")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for r, p in enumerate(procs):
            left = max(1.0, timeout - (time.monotonic() - t0))
            try:
                so, se = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                p.kill()
                so, se = p.communicate()
                se += f"\n[harness] rank {r} killed after the {timeout}s test timeout"
            res_file = out / f"rank{r}.json"
            res = json.loads(res_file.read_text()) if res_file.exists() else None
            results.append(RankResult(r, p.returncode, so, se, time.monotonic() - t0, res))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()



def rank0_prefix(tmp_path) -> str:
    """Where rank 0 of the (single) :func:`run_ranks` spawn under ``tmp_path`` wrote its
    result; its per-run files (``dist_child.py``) are ``<prefix>.<run name>.*``."""
    ranks = [d for d in os.listdir(tmp_path) if d.startswith("ranks-")]
    return str(Path(tmp_path) / ranks[0] / "rank0.json")


def run_ranks_ok(script: str, spec: dict, tmp_path, **kw) -> list[RankResult]:
    """:func:`run_ranks`, asserting that every rank exited 0 and wrote its result (the
    first failure may be on any rank: all are shown)."""
    res = run_ranks(script, spec, tmp_path, **kw)
    bad = [r for r in res if r.returncode != 0 or r.result is None]
    assert not bad, "\n".join(repr(r) for r in res)
    return res

def store_snapshot(eng) -> dict:
    """Every optimizer-state tensor of this rank (master, exp_avg, exp_avg_sq per key), read
    from its home: what a failed step must leave unchanged."""
    import torch
    st = eng.opt.store
    out = {}
    for k in st.keys():
        n = st.numel(k)
        for what in ("master", "exp_avg", "exp_avg_sq"):
            t = torch.empty(n)
            st.read_master(k, t) if what == "master" else st.read_state(k, what, t)
            out[f"{k}.{what}"] = t
    return out


def attempt_step(eng, xs, ys) -> dict:
    """One training step (MSE) that may fail on some rank: what it raised (None: nothing)
    and whether this rank's optimizer states and ``global_steps`` came out unchanged."""
    import torch
    snap, steps = store_snapshot(eng), eng.global_steps
    try:
        eng.backward(torch.nn.functional.mse_loss(eng(xs), ys))
        eng.step()
        raised = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        raised = f"{type(e).__name__}: {e}"
    after = store_snapshot(eng)
    return {"raised": raised, "unchanged": all(torch.equal(snap[k], after[k]) for k in snap),
            "global_steps_unchanged": eng.global_steps == steps}


def report_and_exit(result: dict, path: str) -> None:
    """Write a rank child's result and leave at once: after a failed collective the process
    group is broken, so there is no clean teardown."""
    import json
    with open(path, "w") as f:
        json.dump(result, f)
    os._exit(0)
