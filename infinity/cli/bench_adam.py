"""`infinity bench-adam`: the SIMD CPU Adam step against torch's, and against the memory bus.

One run, interleaved rounds (the order rotates every round), medians of per-round
ratios — the machine may be shared, so only ratios measured side by side mean
anything. Measured:

fp32 (param, grad, exp_avg, exp_avg_sq all fp32; 28 bytes moved per element):
  infinity   ``infinity.optim.adam_step``
  fused      ``torch.optim.Adam(fused=True)``
  foreach    ``torch.optim.Adam(foreach=True)``
  roofline   a triad-like pass over the same bytes (read p, g, m, v; write p, m, v) on
             the same threads: the memory-bandwidth ceiling for this traffic
mixed precision (bf16 grads in, fp32 master + states, bf16 params out; 28 B/element):
  infinity   ``adam_step(..., grad=bf16, param_out=bf16)``: one pass
  torch      ``grad.float()`` + ``Adam(fused=True).step()`` + ``param_bf16.copy_(param)``
             (torch's best equivalent)
"""
import json
import statistics
import time

BYTES_PER_ELEM = 28  # fp32 step: 4 reads + 3 writes of 4 bytes; mixed: 4+2+8 in, 4+8+2 out


def register(sub):
    p = sub.add_parser("bench-adam", help="benchmark the SIMD CPU Adam against torch and the memory roofline",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=50_000_000, help="parameters per step (default 50M)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for infinity and torch (default: CPUs in this process's affinity mask)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7; +1 warm-up)")
    p.add_argument("--skip-foreach", action="store_true", help="skip torch's foreach Adam (slowest)")
    p.add_argument("--skip-mixed", action="store_true", help="skip the mixed-precision comparison")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleave(cases, rounds):
    """Runs every case once per round, rotating the order; round 0 is a warm-up. -> {name: [s, ...]}"""
    names = list(cases)
    times = {n: [] for n in names}
    for r in range(rounds + 1):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t = _timed(cases[n])
            if r > 0:
                times[n].append(t)
    return times


def _ratio(times, num, den):
    """Median over rounds of times[num][i] / times[den][i]."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def bench_fp32(numel, rounds, foreach=True):
    import torch
    from infinity.optim import functional as F

    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    p = torch.randn(numel)
    g = torch.randn(numel) * 1e-2
    m, v = torch.zeros(numel), torch.zeros(numel)
    step = [0]

    def ours():
        step[0] += 1
        F.adam_step(p, g, m, v, step=step[0], lr=hp["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0)

    def torch_opt(kind):
        tp = torch.nn.Parameter(torch.randn(numel))
        tp.grad = torch.randn(numel) * 1e-2
        opt = torch.optim.Adam([tp], **hp, **{kind: True})
        opt.step()  # allocate states outside the timing
        return opt.step

    cases = {"infinity": ours, "fused": torch_opt("fused")}
    if foreach:
        cases["foreach"] = torch_opt("foreach")
    # s = 0: p, m, v keep their values (the Adam case reuses them) while the same bytes move
    cases["roofline"] = lambda: F.triad(p, g, m, v, 0.0)
    times = _interleave(cases, rounds)
    out = {"numel": numel, "bytes_per_step": numel * BYTES_PER_ELEM,
           "median_s": {k: statistics.median(t) for k, t in times.items()},
           "speedup_vs_fused": _ratio(times, "fused", "infinity"),
           "fraction_of_roofline": _ratio(times, "roofline", "infinity"),
           "fused_fraction_of_roofline": _ratio(times, "roofline", "fused")}
    if foreach:
        out["speedup_vs_foreach"] = _ratio(times, "foreach", "infinity")
    out["gbps"] = {k: numel * BYTES_PER_ELEM / s / 1e9 for k, s in out["median_s"].items()}
    return out


def bench_mixed(numel, rounds):
    import torch
    from infinity.optim import functional as F

    p = torch.randn(numel)
    g16 = (torch.randn(numel) * 1e-2).bfloat16()
    m, v = torch.zeros(numel), torch.zeros(numel)
    out16 = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def ours():
        step[0] += 1
        F.adam_step(p, g16, m, v, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, param_out=out16)

    tp = torch.nn.Parameter(torch.randn(numel))
    tg16 = (torch.randn(numel) * 1e-2).bfloat16()
    tout16 = torch.empty(numel, dtype=torch.bfloat16)
    opt = torch.optim.Adam([tp], lr=1e-3, fused=True)
    tp.grad = tg16.float()
    opt.step()

    def theirs():
        tp.grad = tg16.float()
        opt.step()
        tout16.copy_(tp.detach())

    times = _interleave({"infinity": ours, "torch_fused_equiv": theirs}, rounds)
    med = {k: statistics.median(t) for k, t in times.items()}
    return {"numel": numel, "median_s": med,
            "speedup_vs_torch": _ratio(times, "torch_fused_equiv", "infinity"),
            "gbps": {"infinity": numel * BYTES_PER_ELEM / med["infinity"] / 1e9}}


def run(args):
    import torch
    import infinity.optim as iopt
    from infinity.cli.main import CLIError

    if args.numel < 1:
        raise CLIError(f"--numel must be >= 1, got {args.numel}")
    if args.rounds < 1:
        raise CLIError(f"--rounds must be >= 1, got {args.rounds}")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads} (omit it to use every CPU "
                       f"in this process's affinity mask)")
    threads = args.threads if args.threads is not None else iopt.default_num_threads()
    iopt.set_num_threads(threads)
    torch.set_num_threads(threads)
    res = {"simd": iopt.simd_level(), "threads": threads, "torch": torch.__version__, "rounds": args.rounds}
    res["fp32"] = bench_fp32(args.numel, args.rounds, foreach=not args.skip_foreach)
    if not args.skip_mixed:
        res["mixed_bf16"] = bench_mixed(args.numel, args.rounds)
    f = res["fp32"]
    res["targets"] = {"fp32_vs_fused>=0.95": f["speedup_vs_fused"] >= 0.95,
                      "fp32_roofline>=0.85": f["fraction_of_roofline"] >= 0.85}
    if "mixed_bf16" in res:
        res["targets"]["mixed_vs_torch>=1.5"] = res["mixed_bf16"]["speedup_vs_torch"] >= 1.5
    if args.json:
        print(json.dumps(res))
        return 0
    ms = lambda s: f"{s * 1e3:8.2f} ms"  # noqa: E731
    print(f"bench-adam: {args.numel:,} params, {threads} thread(s), {res['simd']} kernel, torch {torch.__version__}, "
          f"{args.rounds} interleaved rounds (medians)")
    print("fp32 step (28 B/param):")
    for k, s in f["median_s"].items():
        print(f"  {k:<10} {ms(s)}  {f['gbps'][k]:6.1f} GB/s")
    print(f"  infinity vs torch fused:   {f['speedup_vs_fused']:.3f}x  (target >= 0.95x)")
    if "speedup_vs_foreach" in f:
        print(f"  infinity vs torch foreach: {f['speedup_vs_foreach']:.3f}x")
    print(f"  infinity / roofline:       {f['fraction_of_roofline'] * 100:.1f} %  (target >= 85 %; "
          f"torch fused: {f['fused_fraction_of_roofline'] * 100:.1f} %)")
    if "mixed_bf16" in res:
        mx = res["mixed_bf16"]
        print("mixed precision (bf16 grad in, fp32 master/states, bf16 params out):")
        for k, s in mx["median_s"].items():
            print(f"  {k:<18} {ms(s)}")
        print(f"  infinity vs torch (grad.float() + fused + copy_): {mx['speedup_vs_torch']:.3f}x  (target >= 1.5x)")
    met = [k for k, ok in res["targets"].items() if ok]
    missed = [k for k, ok in res["targets"].items() if not ok]
    print(f"targets met: {', '.join(met) or 'none'}" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return 0
