"""Groups kept resident from forward for backward at ZeRO stage 3 across ranks (Note [Reuse
within a micro-step] in infinity/runtime/prefetch.py): backward's all-gather (and NVMe read
of the shard) of a kept group is skipped.

* parity: losses and gathered final parameters within 1e-5 of single-process torch AdamW
  (``test_stages.check_run``), reuse on (the default), bounded by a budget smaller than the
  model (some groups kept, some evicted) and off, homes cpu / nvme, with accumulation and
  clipping; the same run with reuse on and off gives bit-identical losses.  Staleness
  (kept values surviving an optimizer step) would differ from the reference after the
  first step: every step's loss is compared.
* it is really used: ``reused_fetches`` > 0 and fewer all-gathered bytes (and NVMe read
  bytes for the nvme home) than the same run with reuse off; with reuse off the counter
  stays 0.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_stages import BATCH, STEPS, base_config, run_and_check  # noqa: E402


def _runs(tmp_path):
    runs = []
    for home, extra in (("cpu", {"gradient_accumulation_steps": 2}),
                        ("nvme", {"gradient_clipping": 3.0})):
        for reuse in ("auto", "small", "off"):
            name = f"s3-{home}-{reuse}"
            cfg = base_config(3, home, str(tmp_path / f"swap-{name}"), **extra)
            if reuse == "small":      # below the model's bytes: keep some, evict others
                cfg["prefetch"]["reuse_gb"] = 2e-5
            elif reuse == "off":
                cfg["prefetch"]["reuse_gb"] = 0
            runs.append({"name": name, "model": "awkward", "steps": STEPS, "batch": BATCH,
                         "config": cfg, "env": {"INFINITY_SIMULATE_DEVICE": "0"}})
    return runs


def test_reuse_parity_and_savings_2_ranks(tmp_path):
    runs = _runs(tmp_path)
    res = run_and_check(tmp_path, runs)
    for home in ("cpu", "nvme"):
        for r in res:
            got = {k: r.result["runs"][f"s3-{home}-{k}"] for k in ("auto", "small", "off")}
            assert got["off"]["reused_fetches"] == 0, (home, r.rank, got["off"])
            assert got["auto"]["reused_fetches"] > 0, (home, r.rank, got["auto"])
            assert 0 < got["small"]["reused_fetches"] < got["auto"]["reused_fetches"], \
                (home, r.rank, got["small"], got["auto"])
            assert got["auto"]["losses"] == got["off"]["losses"], (home, r.rank)
            assert got["small"]["losses"] == got["off"]["losses"], (home, r.rank)
            # each reuse is one all-gather less (the gathered output is the full group)
            saved = got["off"]["allgather_bytes"] - got["auto"]["allgather_bytes"]
            assert saved == got["auto"]["reused_bytes"] > 0, (home, r.rank, got)
            if home == "nvme":
                assert got["auto"]["nvme_read_bytes"] < got["off"]["nvme_read_bytes"], \
                    (r.rank, got["auto"]["nvme_read_bytes"], got["off"]["nvme_read_bytes"])
