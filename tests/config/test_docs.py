"""docs/configuration.md cannot drift from the dataclasses: every key documented with its
exact default, every documented key real, and the examples in the doc load."""
import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from infinity.config import InfinityConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\|\s*`([a-z0-9_.]+)`\s*\|\s*`([^`]*)`\s*\|")


def _doc_rows():
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} documented twice"
            rows[m.group(1)] = m.group(2)
    return rows


def _dataclass_defaults():
    out = {}

    def walk(prefix, obj):           # nested sections (offload.frozen_weights) by their keys
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(f"{prefix}{f.name}.", v)
            else:
                out[f"{prefix}{f.name}"] = v
    walk("", InfinityConfig())
    return out


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


def _code_blocks(lang):
    text = DOC.read_text(encoding="utf-8")
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_every_field_documented_with_its_default():
    rows = _doc_rows()
    defaults = _dataclass_defaults()
    missing = sorted(set(defaults) - set(rows))
    assert not missing, f"undocumented keys in docs/configuration.md: {missing}"
    extra = sorted(set(rows) - set(defaults))
    assert not extra, f"documented keys that do not exist: {extra}"
    for key, raw in rows.items():
        documented = json.loads(raw)
        actual = _norm(defaults[key])
        assert documented == actual and type(documented) in (type(actual), int, float,
                                                             type(None), list), \
            f"{key}: documented default {raw} != dataclass default {actual!r}"


def test_design_snippet_is_the_defaults():
    blocks = [b for b in _code_blocks("python") if b.lstrip().startswith("{")]
    assert blocks, "the DESIGN snippet is missing"
    d = ast.literal_eval(blocks[0])
    assert InfinityConfig.from_dict(d) == InfinityConfig()
    assert set(d) == {f.name for f in dataclasses.fields(InfinityConfig)}


def test_full_example_loads_and_json_matches_yaml(tmp_path):
    (y,) = _code_blocks("yaml")
    (j,) = _code_blocks("json")
    p = tmp_path / "train.yaml"
    p.write_text(y)
    cfg = InfinityConfig.load(str(p))
    assert cfg.to_dict() == json.loads(j)
    assert cfg.offload.params == "nvme" and cfg.optimizer.lr == 2e-5


@pytest.mark.parametrize("bad_row", ["| `aio.threads` | `2` | int |"])
def test_checker_can_fail(bad_row):
    """The row parser really reads defaults: a wrong one is caught."""
    key, raw = ROW.match(bad_row).groups()
    assert json.loads(raw) != _dataclass_defaults()[key]


MIGRATION = DOC.parent / "migrating-from-deepspeed.md"


def test_migration_example_translates_as_documented():
    text = MIGRATION.read_text(encoding="utf-8")
    blocks = re.findall(r"```json\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2, "expected the DeepSpeed example and its translation"
    ds, expected = (json.loads(b) for b in blocks)
    assert InfinityConfig.from_deepspeed(ds).to_dict() == expected


def test_migration_doc_lists_every_ignored_key():
    from infinity import config_deepspeed as cd
    text = MIGRATION.read_text(encoding="utf-8")
    section = text[text.index("## Accepted and ignored"):text.index("## Rejected")]
    for k in (cd.DS_IGNORED_TOP_KEYS + cd.DS_IGNORED_ZERO_KEYS + cd.DS_IGNORED_OFFLOAD_KEYS
              + cd.DS_IGNORED_AIO_KEYS):
        assert f"`{k}`" in section, f"ignored DeepSpeed key {k} not documented"
