"""A real engine run under ProfileSession: the trace's NVMe bytes equal the engine's own
counters over the same steps, and the prefetch counters are picked up from engine.stats()."""
import json

import pytest
import torch


def test_profile_session_on_engine(tmp_path):
    infinity_engine = pytest.importorskip("infinity.engine")
    transformers = pytest.importorskip("transformers")
    from infinity.profile import ProfileSession, Timeline

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=32))
    tl = Timeline()
    eng = infinity_engine.initialize(model, {"precision": "bf16", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path / "swap")]}}, timeline=tl)
    x = torch.randint(0, 256, (2, 16))

    def step():
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.step()

    try:
        step()                                  # records the module order
        before = eng.stats()
        with ProfileSession(tl, tmp_path / "prof", stats_fn=eng.stats) as prof:
            for i in range(2):
                step()
        after = eng.stats()
    finally:
        eng.close()
    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    x_events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    rd = sum(e["args"].get("bytes", 0) for e in x_events if e["cat"] == "nvme_read")
    assert rd > 0 and rd == after["nvme_read_bytes"] - before["nvme_read_bytes"]
    assert prof.summary["links"]["nvme_read"]["bytes"] == rd
    wr = sum(e["args"].get("bytes", 0) for e in x_events if e["cat"] == "nvme_write")
    assert wr > 0 and wr == after["nvme_write_bytes"] - before["nvme_write_bytes"]
    p = prof.summary["prefetch"]
    assert p["prefetched"] == after["prefetched_fetches"] - before["prefetched_fetches"]
    assert p["on_demand"] == after["on_demand_fetches"] - before["on_demand_fetches"]
    # the engine marks each optimizer-step boundary itself
    marks = [s for s, _ in tl.steps()]
    assert len(marks) >= 2 and marks == sorted(marks)
    rows = prof.summary["steps"]
    assert {r["step"] for r in rows if r["step"] is not None} <= set(marks)
    assert sum(r["time_s"] for r in rows) == pytest.approx(prof.summary["window_s"], rel=0.01)
    assert (tmp_path / "prof" / "timeline.png").stat().st_size > 0
    # compute lanes carry one span per module (forward) and per parameter group (backward),
    # named after the model's own modules
    module_names = {n for n, _ in model.named_modules()}
    fwd = {e["name"] for e in x_events if e["cat"] == "forward"}
    bwd = {e["name"] for e in x_events if e["cat"] == "backward"}
    assert "transformer.h.0.attn.c_attn" in fwd and "transformer.h.1.mlp.c_fc" in fwd
    assert len(fwd & module_names) >= 8
    assert len(bwd & module_names) >= 8
