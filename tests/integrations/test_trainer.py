"""InfinityTrainer against the plain Hugging Face Trainer (same seed, same data): logged
losses, gradient norms and learning rates per step, final weights, save_model ->
from_pretrained -> generate, Trainer-style checkpoints and resume, evaluation/predict,
callbacks, gradient checkpointing, bf16, and the who-owns-what errors."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from infinity.config import ConfigError  # noqa: E402
from infinity.integrations.transformers import InfinityTrainer  # noqa: E402


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _weights_close(engine, ref_model, tol=1e-5, loose=("c_attn.bias",)):
    """Every parameter within ``tol`` (norm-relative) of the reference. GPT-2's fused
    c_attn bias holds the key bias, whose gradient is ~0 (softmax ignores it): Adam turns
    its rounding noise into lr-sized steps, so it is compared loosely (as in
    tests/engine/test_hf.py)."""
    sd = engine.state_dict()
    for n, p in ref_model.named_parameters():
        d = float((sd[n] - p.detach()).norm() / p.detach().norm())
        lim = 5e-3 if any(k in n for k in loose) else tol
        assert d < lim, (n, d)


@pytest.fixture
def plain_run(tmp_path):
    def run(model_fn=H.gpt2, **kw):
        t = transformers.Trainer(model=model_fn(), args=H.args(tmp_path / "ref", **kw),
                                 train_dataset=H.TokenData())
        t.train()
        return t
    return run


@pytest.mark.parametrize("model_fn", [H.gpt2, pytest.param(H.llama, marks=pytest.mark.slow)],
                         ids=["gpt2", "llama"])
def test_matches_plain_trainer(tmp_path, swap_dir, plain_run, model_fn):
    """10 optimizer steps, accumulation 2, max_grad_norm 1.0, linear warmup, weight decay:
    params and optimizer on NVMe give the plain Trainer's logged numbers."""
    ref = plain_run(model_fn)
    tr = InfinityTrainer(model=model_fn(), args=H.args(tmp_path / "inf"),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        assert tr.engine.cfg.offload.params == "nvme"
        assert tr.engine.global_steps == 10
        a, b = H.losses(tr), H.losses(ref)
        assert len(a) == len(b) == 10
        for x, y in zip(a, b):
            assert _rel(x, y) < 1e-5, (a, b)
        for x, y in zip(H.log_values(tr, "grad_norm"), H.log_values(ref, "grad_norm")):
            assert _rel(x, y) < 1e-4
        assert H.log_values(tr, "learning_rate") == pytest.approx(
            H.log_values(ref, "learning_rate"), rel=1e-12, abs=1e-15)
        _weights_close(tr.engine, ref.model)
    finally:
        tr.close()


def test_parity_fails_when_the_recipe_differs(tmp_path, swap_dir, plain_run):
    """The comparison can fail: a different weight decay changes the weights."""
    ref = plain_run()
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "inf", weight_decay=0.5),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        with pytest.raises(AssertionError):
            _weights_close(tr.engine, ref.model)
    finally:
        tr.close()


def test_save_model_loads_and_generates(tmp_path, swap_dir):
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "inf", max_steps=4),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        tr.save_model(str(tmp_path / "final"))
        files = set(os.listdir(tmp_path / "final"))
        assert {"config.json", "model.safetensors", "training_args.json"} <= files
        assert not any(f.endswith((".bin", ".pt", ".pth")) for f in files)  # nothing pickled
        prompt = H.TokenData()[0]["input_ids"][None, :4]
        tr.model.eval()
        want = tr.model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        tr.close()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    got = m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step
        self.events = []

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step_end", state.global_step))
        if state.global_step == self.step:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", state.global_step))


def test_checkpoints_resume_to_the_same_weights(tmp_path, swap_dir):
    kw = dict(save_strategy="steps", save_steps=4)
    full = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "full", save_total_limit=1, **kw),
                           train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        full.train()
        want = {k: v.clone() for k, v in full.engine.state_dict().items()}
    finally:
        full.close()
    # save_total_limit=1: checkpoints 4 and 8 were rotated out; the final one remains
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-10"]
    ck = tmp_path / "full" / "checkpoint-10"
    names = set(os.listdir(ck))
    assert {"trainer_state.json", "config.json", "infinity"} <= names
    assert not any(n.endswith((".pt", ".pth", ".bin")) for n in names)   # nothing pickled
    assert json.load(open(ck / "trainer_state.json"))["global_step"] == 10

    stop = _StopAt(9)
    part = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "part", **kw),
                           train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir),
                           callbacks=[stop])
    try:
        part.train()
    finally:
        part.close()
    assert ("save", 8) in stop.events and sorted(os.listdir(tmp_path / "part")) == \
        ["checkpoint-4", "checkpoint-8"]
    # True: the latest (8); a path: that one (4); each into a differently initialised model
    import shutil
    for i, resume in enumerate((True, "checkpoint-4")):
        out = tmp_path / f"resumed{i}"      # the resumed run rotates its own checkpoints
        shutil.copytree(tmp_path / "part", out)
        if resume is not True:
            resume = str(out / resume)
        res = InfinityTrainer(model=H.gpt2(seed=7), args=H.args(out, **kw),
                              train_dataset=H.TokenData(),
                              infinity_config=H.nvme_config(swap_dir))
        try:
            res.train(resume_from_checkpoint=resume)
            assert res.state.global_step == 10
            got = res.engine.state_dict()
            for k, v in want.items():
                assert float((got[k] - v).norm() / max(float(v.norm()), 1e-12)) < 1e-6, k
        finally:
            res.close()


def test_resume_from_a_plain_trainer_checkpoint_is_refused(tmp_path, swap_dir):
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text("{}")
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "out"),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        with pytest.raises(ConfigError, match="no infinity checkpoint"):
            tr.train(resume_from_checkpoint=True)
    finally:
        tr.close()


def test_evaluate_predict_callbacks_and_gradient_checkpointing(tmp_path, swap_dir, plain_run):
    gc = "activation_checkpointing" if "activation_checkpointing" in \
        transformers.TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"
    kw = dict(eval_strategy="steps", eval_steps=5, **{gc: True})
    ref = transformers.Trainer(model=H.gpt2(), args=H.args(tmp_path / "ref", **kw),
                               train_dataset=H.TokenData(), eval_dataset=H.TokenData(8, seed=3))
    ref.train()
    seen = []

    class Record(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **k):
            seen.append(dict(logs))

    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "inf", **kw),
                         train_dataset=H.TokenData(), eval_dataset=H.TokenData(8, seed=3),
                         infinity_config=H.nvme_config(swap_dir), callbacks=[Record()])
    try:
        tr.train()
        assert getattr(tr.model, "is_activation_checkpointing",
                       getattr(tr.model, "is_gradient_checkpointing", None))
        ev = [h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h]
        ev_ref = [h["eval_loss"] for h in ref.state.log_history if "eval_loss" in h]
        assert len(ev) == 2 and all(_rel(a, b) < 1e-5 for a, b in zip(ev, ev_ref))
        assert sum("loss" in s for s in seen) == 10          # callbacks see every log
        out = tr.predict(H.TokenData(4, seed=9))
        want = ref.predict(H.TokenData(4, seed=9))
        assert _rel(out.metrics["test_loss"], want.metrics["test_loss"]) < 1e-5
        assert out.predictions.shape == want.predictions.shape
    finally:
        tr.close()


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.slow), "fp16"])
def test_low_precision(tmp_path, swap_dir, plain_run, precision):
    """bf16/fp16: the engine computes in that dtype with fp32 masters (DeepSpeed's mixed
    precision, not autocast; fp16 with dynamic loss scaling): losses follow the fp32 run
    within the dtype's rounding."""
    ref = plain_run()
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "inf", **{precision: True}),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        assert tr.engine.cfg.precision == precision
        assert tr.engine.stats()["skipped_steps"] == 0
        a, b = H.losses(tr), H.losses(ref)
        assert len(a) == 10 and all(_rel(x, y) < 2e-2 for x, y in zip(a, b)), (a, b)
        assert a != b                                  # really computed in low precision
    finally:
        tr.close()


# ---------------------------------------------------------------------- who owns what
@pytest.mark.parametrize("cfg,args_kw,words", [
    ({"optimizer": {"lr": 1e-4}}, {}, ["optimizer.lr=0.0001", "learning_rate=0.003"]),
    ({"gradient_accumulation_steps": 4}, {}, ["gradient_accumulation_steps=4",
                                              "gradient_accumulation_steps=2"]),
    ({"gradient_clipping": 0.5}, {}, ["gradient_clipping=0.5", "max_grad_norm=1.0"]),
    ({"precision": "bf16"}, {}, ["precision='bf16'", "bf16/fp16='fp32'"]),
    ({"optimizer": {"weight_decay": 0.0}}, {}, ["weight_decay=0.0", "weight_decay=0.1"]),
    ({"scheduler": {"type": "constant"}}, {}, ["scheduler", "lr_scheduler_type"]),
    ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW",
      "params": {"lr": 1e-4}}}, {}, ["optimizer.params.lr=0.0001", "learning_rate=0.003"]),
])
def test_contradictions_name_both_values(tmp_path, swap_dir, cfg, args_kw, words):
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "o", **args_kw),
                         train_dataset=H.TokenData(), infinity_config=cfg)
    try:
        with pytest.raises(ConfigError) as ei:
            tr.train()
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
    finally:
        tr.close()


def test_equal_explicit_values_are_fine_and_other_optimizers_refused(tmp_path, swap_dir):
    cfg = H.nvme_config(swap_dir, optimizer={"lr": 3e-3, "weight_decay": 0.1},
                        gradient_accumulation_steps=2)
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "o", max_steps=2),
                         train_dataset=H.TokenData(), infinity_config=cfg)
    try:
        tr.train()
        assert tr.engine.global_steps == 2
    finally:
        tr.close()
    with pytest.raises(ConfigError, match="optim='sgd'.*AdamW"):
        InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "o", optim="sgd"),
                        train_dataset=H.TokenData(), infinity_config={})
    with pytest.raises(ConfigError, match="optimizers="):
        InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "o"), train_dataset=H.TokenData(),
                        optimizers=(torch.optim.SGD(H.gpt2().parameters(), lr=1), None))


def test_uneven_accumulation_is_a_clear_error(tmp_path, swap_dir):
    """An epoch whose batch count is not a multiple of the accumulation: the Trainer steps
    on a partial window, which the engine cannot do; said before anything goes wrong."""
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "o", max_steps=-1,
                                                     num_train_epochs=2),
                         train_dataset=H.TokenData(n=6), infinity_config=H.nvme_config(swap_dir))
    try:
        with pytest.raises(RuntimeError, match="multiple of gradient_accumulation_steps"):
            tr.train()
    finally:
        tr.close()


def test_save_only_model_checkpoints_hold_weights(tmp_path, swap_dir):
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "o", max_steps=2, save_steps=2,
                                                     save_strategy="steps", save_only_model=True),
                         train_dataset=H.TokenData(), infinity_config=H.nvme_config(swap_dir))
    try:
        tr.train()
        want = dict(tr.engine.state_dict())
    finally:
        tr.close()
    ck = tmp_path / "o" / "checkpoint-2"
    assert "infinity" not in os.listdir(ck)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ck))
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), want[n]), n


def test_config_forms(tmp_path, swap_dir):
    """infinity_config as a YAML path and as an InfinityConfig (whose non-default values
    count as explicit)."""
    import yaml

    from infinity.config import InfinityConfig
    from infinity.integrations.trainer_config import resolve_trainer_config
    args = H.args(tmp_path / "o")
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(H.nvme_config(swap_dir, prefetch={"depth": 3})))
    cfg, sched = resolve_trainer_config(str(p), args, model=H.gpt2())
    assert sched is None and cfg.prefetch.depth == 3 and cfg.offload.params == "nvme"
    assert cfg.optimizer.lr == 3e-3 and cfg.optimizer.weight_decay == 0.1
    assert cfg.gradient_accumulation_steps == 2 and cfg.gradient_clipping == 1.0
    pg = cfg.optimizer.param_groups
    assert len(pg) == 1 and pg[0]["weight_decay"] == 0.0 and cfg.optimizer.no_decay == []
    assert len(pg[0]["params"]) == 2 * 8 + 2   # per layer: ln_1, ln_2 (w, b), 4 biases; ln_f
    cfg, _ = resolve_trainer_config(InfinityConfig.from_dict(H.nvme_config(swap_dir)), args)
    assert cfg.offload.optimizer == "nvme"
    with pytest.raises(ConfigError, match="optimizer.eps=1e-06 vs TrainingArguments adam_epsilon"):
        resolve_trainer_config(InfinityConfig.from_dict({"optimizer": {"eps": 1e-6}}), args)
