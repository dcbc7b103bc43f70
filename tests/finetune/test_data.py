"""Tokenizer, data loading and batching for `infinity finetune`."""
import gzip
import json

import pytest
import torch

from infinity.data import ByteTokenizer, DataError, TokenBatcher, load_texts, shipped_corpus_path


def test_tokenizer_round_trip_ascii_and_unicode():
    tok = ByteTokenizer()
    for text in ["", "hello", "Ünïcödé ✓ 日本語 🙂", "line\nbreak\ttab\x00nul"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_tokenizer_specials():
    tok = ByteTokenizer()
    ids = tok.encode("ab", add_bos=True, add_eos=True)
    assert ids == [tok.BOS, 97, 98, tok.EOS]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special=False) == "<bos>ab<eos>"
    assert tok.vocab_size == 259
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_shipped_corpus_is_sizeable_text():
    path = shipped_corpus_path()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        raw = f.read()
    texts = load_texts(None)
    assert texts == [raw]
    assert 200_000 < len(raw) < 2_000_000
    assert "HAMLET" in raw and "MACBETH" in raw


def test_load_text_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("some text ✓\n", encoding="utf-8")
    assert load_texts(str(p)) == ["some text ✓\n"]


def test_load_directory_sorted_txt_and_jsonl(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n", encoding="utf-8")
    (tmp_path / "ignored.csv").write_text("x,y", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    assert load_texts(str(tmp_path)) == ["first", "second", "third"]


def test_load_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["x", "yy", ""]))
                 + "\n\n", encoding="utf-8")
    assert load_texts(str(p)) == ["x", "yy"]


@pytest.mark.parametrize("content, match", [
    ('{"text": "ok"}\n{not json}\n', r"d\.jsonl:2: not valid JSON"),
    ('{"body": "no text"}\n', r"d\.jsonl:1: record has no 'text' field"),
    ('{"text": 5}\n', r"'text' must be a string"),
    ('[1, 2]\n', r"record has no 'text' field"),
    ('\n\n', r"no non-empty 'text'"),
])
def test_jsonl_errors(tmp_path, content, match):
    p = tmp_path / "d.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=match):
        load_texts(str(p))


def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_texts(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match="is empty"):
        load_texts(str(empty))
    d = tmp_path / "dir"
    d.mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl"):
        load_texts(str(d))
    (d / "e.txt").write_text("", encoding="utf-8")
    with pytest.raises(DataError, match="are empty"):
        load_texts(str(d))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe bad")
    with pytest.raises(DataError, match="not UTF-8"):
        load_texts(str(bad))


def test_batcher_windows_follow_the_stream():
    tok = ByteTokenizer()
    texts = ["abcdefgh" * 10, "ijklmnop" * 10]
    b = TokenBatcher(texts, tok, seq_len=16, batch_size=3, seed=1)
    stream = torch.tensor(tok.encode(texts[0]) + [tok.EOS] + tok.encode(texts[1]) + [tok.EOS])
    x = b.batch(0)
    assert x.shape == (3, 16) and x.dtype == torch.int64
    for row in x:
        # every row is an aligned window of the token stream
        starts = [s for s in range(0, len(stream) - 15, 16) if torch.equal(stream[s:s + 16], row)]
        assert starts, row
    assert torch.equal(b.batch(5), TokenBatcher(texts, tok, seq_len=16, batch_size=3, seed=1).batch(5))


def test_batcher_epoch_visits_every_window_once():
    tok = ByteTokenizer()
    b = TokenBatcher(["x" * 1000], tok, seq_len=10, batch_size=4, seed=0)
    n = b.num_windows  # 100
    seen = torch.cat([b.batch(i) for i in range(n // 4)])
    assert seen.shape[0] == n
    # rows are distinct windows: compare to the window table
    idx = {tuple(r.tolist()) for r in b.tokens}
    assert {tuple(r.tolist()) for r in seen} <= idx


def test_batcher_rank_shards_are_disjoint_and_cover_the_global_batch():
    tok = ByteTokenizer()
    text = "".join(chr(65 + (i % 26)) + str(i) for i in range(3000))
    single = TokenBatcher([text], tok, seq_len=8, batch_size=4, world_size=1, seed=3)
    ranks = [TokenBatcher([text], tok, seq_len=8, batch_size=2, rank=r, world_size=2, seed=3)
             for r in range(2)]
    for step in range(5):
        union = torch.cat([rb.batch(step) for rb in ranks])
        assert torch.equal(union, single.batch(step))
        a, b = (set(map(tuple, rb.batch(step).tolist())) for rb in ranks)
        assert not (a & b)


def test_batcher_too_little_data():
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenBatcher(["abc"], ByteTokenizer(), seq_len=64, batch_size=1)


@pytest.mark.parametrize("content", [b"\0" * 4096, b"\0\x01\x02\x03\n" * 100, b"\n\0\t" * 50,
                                     b"real words " + b"\0" * 200])
def test_file_without_text_is_refused_like_binary(tmp_path, content):
    """Valid UTF-8 that holds no text (NUL-filled, control characters, mostly NUL) is refused
    with the binary-file advice, not trained on."""
    f = tmp_path / "zeros.txt"
    f.write_bytes(content)
    with pytest.raises(DataError, match=r"binary file.*pass a UTF-8 text file"):
        load_texts(str(f))
    j = tmp_path / "zeros.jsonl"
    j.write_text(json.dumps({"text": content.decode()}) + "\n")
    with pytest.raises(DataError, match="binary file"):
        load_texts(str(j))


def test_text_with_a_stray_nul_is_accepted(tmp_path):
    f = tmp_path / "ok.txt"
    f.write_bytes(b"To be, or not to be: that is the question.\n" * 10 + b"\0")
    assert load_texts(str(f))[0].startswith("To be")
