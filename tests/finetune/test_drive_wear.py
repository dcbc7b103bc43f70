"""Drive wear in the finetune summary (issue 32): NVMe TB written per step and per million
tokens always, the drives' life only with their rating (--drive-tbw)."""
import io

from infinity.finetune.report import Reporter, wear_text


def _rec(step, written, tokens=1000):
    return {"step": step, "loss": 2.0, "step_time_s": 1.0, "tokens": tokens,
            "bytes": {"nvme_write": written, "nvme_read": 1}}


def test_wear_text_counts_and_life():
    assert wear_text(2e12, 1e6) == "2 TB written per step, 2 TB per million tokens"
    t = wear_text(2e12, 1e6, drive_tbw=1000)
    assert t.endswith("rated 1000 TB written: 500 steps, 0.5 B tokens")


def test_summary_has_the_wear_row_and_life_only_with_a_rating():
    for tbw, life in ((None, False), (3.0, True)):
        err = io.StringIO()
        r = Reporter(total_steps=2, enabled=True, stdout=io.StringIO(), stderr=err,
                     progress=False, drive_tbw=tbw)
        r.records = [_rec(1, 3e9), _rec(2, 5e9)]
        text = r.summary()
        row = next(line for line in text.splitlines() if line.startswith("drive wear"))
        assert "0.004 TB written per step" in row and "4 TB per million tokens" in row
        assert ("rated 3 TB written: 750 steps" in row) == life
