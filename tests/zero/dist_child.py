"""One rank of a ZeRO test run (spawned by harness.run_ranks). Spec (JSON):

    {"runs": [{"name", "config", "steps", "batch", "model", "env", "overlap",
               "overlap_predict"}...], "fail_rank": int|None, "fail_after_steps": int}

``overlap: false`` turns the optimizer step overlapped with backward off for the run;
``overlap_predict: false`` makes it speculate in every window under clipping.

For each run: build the seeded model, train ``steps`` steps with this rank's slice of a
seeded global batch, record the global mean loss per step and the gathered final
parameters (written to ``<out>.<name>.safetensors``).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import child_entry  # noqa: E402
from zero_models import make_model, make_batches  # noqa: E402


def main():
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(1)
    import torch.distributed as dist
    import infinity
    from safetensors.torch import save_file
    from infinity.zero.distributed import gathered_state_dict
    from infinity.zero.comm import ensure_process_group
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])
    result = {"rank": rank, "runs": {}}
    sizes = {}                # run name -> host sizes of its engine (cap_from)
    for run in spec["runs"]:
        cfg = run["config"]
        if "cap_from" in run:     # a host cap relative to an earlier run's plan
            cfg = cap_from(cfg, sizes[run["cap_from"]["run"]], run["cap_from"]["fraction"])
        had_pg = dist.is_initialized()
        if not (spec.get("pg_by_initialize") and not run.get("init")):
            ensure_process_group(cfg.get("dist_timeout_s", 60))
        # else: infinity.initialize creates the group from RANK/WORLD_SIZE/MASTER_* itself
        torch.manual_seed(1234)
        if run.get("init"):
            from infinity.zero.init import Init, is_managed
            with Init(cfg):
                model = make_model(run["model"])
            assert all(is_managed(p) for p in model.parameters())
        else:
            model = make_model(run["model"])
        saved_env = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))       # e.g. INFINITY_SIMULATE_DEVICE per run
        try:
            eng = make_engine(model, cfg, force_spill=run.get("spill", False))
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        sizes[run["name"]] = host_sizes(eng)
        device_kind = eng.mm.dev.kind
        shm_used = eng.zero is not None and eng.zero.comm.shm is not None
        from infinity.zero.distributed import SLOTS_LINE
        shm_plan = eng.placement.host.get(SLOTS_LINE, 0)
        shard_numel = sum(-eng.opt.shard(g)[0] + eng.opt.shard(g)[1]
                          for g in eng.opt.groups if g.trainable)
        grad_full_bytes = sum(4 * g.padded_numel for g in eng.grouping.groups if g.trainable)
        trainable_elems = sum(s.numel for g in eng.grouping.groups for s in g.slots
                              if s.trainable)
        bucketed = eng.opt.grads.grad_buckets is not None
        param_homes = sorted({g.home for g in eng.grouping.groups})
        planned_device = eng.placement.device_total
        param_bytes = {"trainable": sum(g.nbytes for g in eng.grouping.groups if g.trainable),
                       "frozen": sum(g.nbytes for g in eng.grouping.groups
                                     if not g.trainable)}
        if "overlap_predict" in run:       # False: speculate in every window (clip redos)
            if eng.overlap is None:
                raise AssertionError("the run asks for the overlapped step but it is off")
            eng.overlap.predict = run["overlap_predict"]
        if run.get("overlap") is False:
            eng.overlap_optimizer_step = False
        if run.get("spill") and not eng.zero.spill:
            raise AssertionError("gradient spill was requested but not taken")
        losses, per_step = [], []     # PER_STEP counters per optimizer step
        gas = cfg.get("gradient_accumulation_steps", 1)
        try:
            for step, micro in enumerate(make_batches(run["model"], run["steps"] * gas,
                                                      run["batch"])):
                if spec.get("fail_rank") == rank and step >= spec.get("fail_after_steps", 0):
                    raise RuntimeError(f"injected failure on rank {rank} at step {step}")
                if spec.get("stall_rank") == rank and step >= spec.get("fail_after_steps", 0):
                    import time
                    time.sleep(spec["stall_seconds"])     # alive but not participating
                    os._exit(4)
                x, y = micro
                n = x.shape[0] // ws
                xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
                before = eng.stats()
                out = eng(xs)
                loss = torch.nn.functional.mse_loss(out.float(), ys.to(out.device))
                eng.backward(loss)
                eng.step()
                after = eng.stats()
                if step % gas == 0:
                    per_step.append({})
                for k in PER_STEP:
                    per_step[-1][k] = per_step[-1].get(k, 0) + after.get(k, 0) - before.get(k, 0)
                t = loss.detach().clone().reshape(1)
                dist.all_reduce(t)
                losses.append(float(t) / ws)
            sd = gathered_state_dict(eng)
            stats = eng.stats()
            cached_groups = sum(1 for g in eng.mm.groups if eng.mm.cached(g))
            if spec.get("check_state_dict"):
                check_engine_weights(eng, sd, f"{out_path}.{run['name']}.pretrained", rank)
        finally:
            eng.close()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in sd.items()}, f"{out_path}.{run['name']}.safetensors")
        # every rank has closed before anyone looks (a rank that closes first would
        # otherwise see the other's private dir); the rank that created the shared user
        # dir removes it once empty, possibly while another rank is listing it
        dist.barrier()
        swap_left = []
        for p in cfg.get("offload", {}).get("nvme_paths", []):
            try:
                swap_left += os.listdir(p)
            except FileNotFoundError:
                pass
        result["runs"][run["name"]] = {"losses": losses, "swap_left": swap_left,
                                       "had_pg_before": had_pg,
                                       "nvme_read_bytes": stats.get("nvme_read_bytes", 0),
                                       "allgather_bytes": stats.get("allgather_bytes", 0),
                                       "reduce_scatter_bytes": stats.get("reduce_scatter_bytes", 0),
                                       "prefetched_fetches": stats.get("prefetched_fetches", 0),
                                       "on_demand_fetches": stats.get("on_demand_fetches", 0),
                                       **{k: stats.get(k, 0) for k in (
                                           "optimizer_groups_overlapped", "optimizer_clip_redos",
                                           "optimizer_groups_redone",
                                           "optimizer_master_handoffs", "reused_fetches",
                                           "reused_bytes", "param_cache_admitted",
                                           "param_cache_evicted", "param_cache_gathers",
                                           "optimizer_master_read_bytes_saved")},
                                       "cached_groups": cached_groups,
                                       "nvme_groups": sum(1 for g in eng.grouping.groups
                                                          if g.home == "nvme"),
                                       "host_cap_bytes": stats.get("host_cap_bytes"),
                                       "host_peak_bytes": stats.get("host_peak_bytes", 0),
                                       "param_cache_budget": eng.placement.param_cache_budget,
                                       "host_sizes": sizes[run["name"]],
                                       **{k: stats.get(k, 0) for k in (
                                           "h2d_bytes", "d2h_bytes", "device_peak_bytes",
                                           "device_cap_bytes", "device_budget_overflows")},
                                       "device_kind": device_kind,
                                       "shm_transport": shm_used,
                                       "shm_plan_bytes": shm_plan,
                                       "per_step": per_step,
                                       "shard_numel": shard_numel,
                                       "spill": bool(eng.zero.spill),
                                       "stream_window": eng.placement.stream_window,
                                       "grad_full_bytes": grad_full_bytes,
                                       "grad_trainable_elems": trainable_elems,
                                       "grad_bucketed": bucketed,
                                       **{k: stats.get(k, 0) for k in (
                                           "grad_buckets_reduced",
                                           "grad_bucket_early_reductions")},
                                       "param_bytes": param_bytes,
                                       "param_homes": param_homes,
                                       "planned_device_bytes": planned_device}
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# engine.stats() counters recorded per optimizer step (test_stream_zero.py)
PER_STEP = ("nvme_read_bytes", "nvme_write_bytes", "optimizer_groups_overlapped",
            "optimizer_master_read_bytes_saved", "optimizer_stream_waits",
            "optimizer_clip_redos")


def host_sizes(eng) -> dict:
    """What a parameter-cache test sizes a host cap from: the plan's host tier without the
    cache, this rank's NVMe-homed shards (page-rounded, as the pool leases them) and the
    full-size fp32 gradients the reductions lease from the host pool during backward."""
    from infinity.memory.pool import ALIGN, round_up
    from infinity.zero.partitioned_grads import MAX_INFLIGHT_REDUCTIONS
    need = sum(v for k, v in eng.placement.host.items() if not k.startswith("parameter cache"))
    shards = 0
    if eng.zero is not None:
        for g in eng.grouping.groups:
            if g.home == "nvme":
                lo, hi = eng.zero.part.range(g.padded_numel)
                shards += round_up((hi - lo) * g.dtype.itemsize, ALIGN)
    full = max((round_up(4 * g.padded_numel, ALIGN) for g in eng.grouping.groups
                if g.trainable), default=0)
    # the undo copies of host-resident optimizer states come before the cache (build.py)
    undo = sum(v for k, v in eng.placement.host.items() if k.startswith("optimizer states"))
    return {"need": need, "shards": shards, "transient": (MAX_INFLIGHT_REDUCTIONS + 2) * full,
            "undo": undo}


def cap_from(cfg, sizes, fraction):
    """``cfg`` with ``offload.host_memory_gb`` = the plan's host tier + the undo copies of
    host-resident optimizer states + the transient gradient buffers + ``fraction`` of this
    rank's shards (a parameter cache that holds about that fraction between backward
    passes, less while gradients are in flight)."""
    import copy
    cfg = copy.deepcopy(cfg)
    cap = sizes["need"] + sizes["undo"] + sizes["transient"] + int(fraction * sizes["shards"])
    cfg["offload"]["host_memory_gb"] = cap / 1e9
    return cfg


def check_engine_weights(eng, sd, directory, rank):
    """engine.state_dict() and save_pretrained() at world size > 1 give the gathered
    values on every rank (collective: every rank iterates the same keys)."""
    from safetensors.torch import load_file
    esd = eng.state_dict()
    for k, v in sd.items():
        got = esd[k]
        if not torch.equal(got.float(), v):
            raise AssertionError(f"rank {rank}: engine.state_dict()[{k!r}] differs from the "
                                 f"gathered value")
    eng.save_pretrained(directory)
    dist.barrier()
    if rank == 0:
        loaded = load_file(os.path.join(directory, "model.safetensors"))
        for k, v in loaded.items():
            if not torch.equal(v.float(), sd[k]):
                raise AssertionError(f"save_pretrained: {k} differs from the gathered value")


def make_engine(model, cfg, force_spill=False):
    import infinity
    import infinity.zero.distributed as D
    if not force_spill:
        return infinity.initialize(model, cfg)
    # test-only: take the NVMe gradient-spill path for a tiny model (the real rule compares
    # the gradient bytes with the host budget, which a tiny model never exceeds)
    orig = D.grad_spill_needed
    D.grad_spill_needed = lambda *a, **k: True
    try:
        return infinity.initialize(model, cfg)
    finally:
        D.grad_spill_needed = orig


if __name__ == "__main__":
    child_entry(main)
