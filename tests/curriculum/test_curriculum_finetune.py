"""`infinity finetune --curriculum`: the step log and the JSON lines carry the length, the
batches are truncated to it, a resumed run continues the schedule, the checkpoints record it,
and bad specs are clear errors."""
import io
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("infinity.engine", reason="the offload engine is not in this build yet")

from infinity.curriculum import SeqlenSchedule, cli_block  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=128, tie_word_embeddings=False, use_cache=False)


def _model(tmp_path):
    p = tmp_path / "tiny-llama.json"
    p.write_text(json.dumps(TINY))
    return str(p)


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("INFINITY_BENCH_IO", None)
    return subprocess.run([sys.executable, "-m", "infinity", "finetune", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)


def test_finetune_curriculum_truncates_logs_and_resumes(tmp_path):
    model = _model(tmp_path)
    common = ["--model", model, "--batch-tokens", "256", "--seq-len", "64", "--no-bench-io",
              "--curriculum", "seqlen:16:6:root", "--save", "ck"]
    expected = SeqlenSchedule.from_config(cli_block("seqlen:16:6:root", 64)).lengths(8)
    assert expected[0] < 64 and expected[-1] == 64
    r = _run(tmp_path, *common, "--steps", "3", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [x["seqlen"] for x in recs] == expected[:3]
    # batch 4 x 64 tokens, truncated: the tokens of a step are 4 x its length
    assert [x["tokens"] for x in recs] == [4 * n for n in expected[:3]]
    assert "curriculum: seqlen curriculum fixed_root 16 -> 64 over 6 steps" in r.stderr
    with open(tmp_path / "ck" / "step-00000003" / "manifest.json") as f:
        meta = json.load(f)["meta"]
    assert meta["curriculum"]["global_step"] == 3 and meta["curriculum"]["seqlen"] == expected[3]
    assert meta["run"]["training"]["curriculum_learning"]["schedule_type"] == "fixed_root"
    # resumed: steps 4..8 continue the schedule (the text step log prints the length)
    r = _run(tmp_path, *common, "--steps", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [int(ln.split(" seqlen ")[1].split()[0]) for ln in r.stderr.splitlines()
              if ln.startswith("step ") and " seqlen " in ln]
    assert logged == expected[3:8]
    # another schedule is another run
    r = _run(tmp_path, *[a if a != "seqlen:16:6:root" else "seqlen:32:6" for a in common],
             "--steps", "9")
    assert r.returncode != 0 and "curriculum_learning.min_difficulty: 16 in the checkpoints, " \
        "32 now" in r.stderr


def test_finetune_curriculum_errors(tmp_path):
    from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune

    def fails(match, **kw):
        opts = FinetuneOptions(model=_model(tmp_path), nvme_paths=[str(tmp_path / "swap")],
                               steps=1, seq_len=64, batch_tokens=128, **kw)
        with pytest.raises(FinetuneError, match=match):
            finetune(opts, reporter_streams={"stdout": io.StringIO(), "stderr": io.StringIO()})

    fails("expected seqlen:START:STEPS", curriculum="seqlen:64")
    fails("linear, root or discrete", curriculum="seqlen:8:10:cosine")
    fails("longer than the run's sequence length 64", curriculum="seqlen:128:10")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"curriculum_learning": {"enabled": True, "min_difficulty": 8}}))
    fails(r"curriculum_learning\.max_difficulty: required", config=str(cfg))


def test_auto_plans_for_the_final_length_and_says_so(tmp_path):
    """--auto with --curriculum: the plan is made for --seq-len (the schedule's final, longest
    length; early steps are only shorter) and the log says so."""
    from infinity.finetune.run import FinetuneOptions, finetune
    out, err = io.StringIO(), io.StringIO()
    res = finetune(FinetuneOptions(model=_model(tmp_path), steps=2, seq_len=64, batch_tokens=256,
                                   auto=True, use_bench_io=False, curriculum="seqlen:16:6",
                                   nvme_paths=[str(tmp_path / "swap")], json_lines=True),
                   reporter_streams={"stdout": out, "stderr": err})
    assert res["auto"].plan.model.seq == 64
    assert "auto: the curriculum grows the sequence to 64 tokens; the plan is sized for that " \
           "final length" in err.getvalue()
    recs = [json.loads(ln) for ln in out.getvalue().splitlines()]
    assert [r["seqlen"] for r in recs] == SeqlenSchedule.from_config(
        cli_block("seqlen:16:6", 64)).lengths(2)


def test_profile_names_the_length_of_each_profiled_step(tmp_path):
    """--profile with --curriculum: the profile's summary carries each profiled step's length."""
    model = _model(tmp_path)
    r = _run(tmp_path, "--model", model, "--batch-tokens", "256", "--seq-len", "64",
             "--no-bench-io", "--curriculum", "seqlen:16:6", "--steps", "3", "--profile", "prof",
             "--profile-skip", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    lengths = SeqlenSchedule.from_config(cli_block("seqlen:16:6", 64)).lengths(3)
    text = "".join(open(os.path.join(tmp_path, "prof", f)).read()
                   for f in os.listdir(tmp_path / "prof") if f.endswith((".txt", ".json", ".md")))
    assert f"curriculum: sequence length of steps 2-3: {lengths[1]}, {lengths[2]}" in text, \
        os.listdir(tmp_path / "prof")
