"""Load training text: the shipped corpus, a text file, a directory of
``.txt``/``.jsonl`` files, or a ``.jsonl`` file whose records carry a ``text``
field. Every problem raises :class:`DataError` naming the file (and line)."""
import gzip
import json
import logging
import os
from importlib import resources

log = logging.getLogger("infinity.data")

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
SHIPPED_CORPUS = "shakespeare.txt.gz"


class DataError(ValueError):
    """Training data is missing, empty or malformed."""


def shipped_corpus_path():
    """Path of the public-domain corpus shipped in the package (see CORPUS.md)."""
    return str(resources.files("infinity.data").joinpath(SHIPPED_CORPUS))


def _read_text_file(path):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (bad byte at offset {e.start}); "
                        "convert it to UTF-8 first") from e
    if not text.strip():
        raise DataError(f"data file {path} is empty")
    _check_has_text(text, path)
    return text


def _printable(ch):
    return ch.isprintable() or ch in "\t\n\r"


def _check_has_text(text, where):
    """Refuse data with no text in it (only NUL/control characters, e.g. a zero-filled or
    binary file that happens to be valid UTF-8), as a non-UTF-8 binary file is refused."""
    sample = text[: 1 << 20]
    nul = sample.count("\0")
    if not any(_printable(c) and not c.isspace() for c in sample):
        raise DataError(f"{where} holds no text (only control characters such as NUL bytes): it "
                        "looks like a binary file; pass a UTF-8 text file")
    if nul > len(sample) // 100:
        raise DataError(f"{where} is {100 * nul / len(sample):.0f} % NUL bytes: it looks like a "
                        "binary file, not text; pass a UTF-8 text file")


def _read_jsonl(path, field="text"):
    texts = []
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                    "each line must be one JSON object with a "
                                    f"{field!r} field") from e
                if not isinstance(rec, dict) or field not in rec:
                    raise DataError(f"{path}:{lineno}: record has no {field!r} field "
                                    f"(keys: {sorted(rec) if isinstance(rec, dict) else type(rec).__name__})")
                value = rec[field]
                if not isinstance(value, str):
                    raise DataError(f"{path}:{lineno}: {field!r} must be a string, "
                                    f"got {type(value).__name__}")
                if value:
                    texts.append(value)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (bad byte at offset {e.start})") from e
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from e
    if not any(t.strip() for t in texts):
        raise DataError(f"{path} holds no non-empty {field!r} values")
    _check_has_text("".join(t[:4096] for t in texts[:256]), f"{path} ({field!r} values)")
    return texts


def _is_jsonl(path):
    p = path[:-3] if path.endswith(".gz") else path
    return p.endswith(JSONL_SUFFIXES)


def _load_file(path):
    if _is_jsonl(path):
        return _read_jsonl(path)
    return [_read_text_file(path)]


def load_texts(path=None):
    """Return a list of documents (strings) from ``path``.

    - ``None``: the shipped public-domain corpus;
    - a ``.jsonl`` file (optionally ``.gz``): one JSON object per line with a
      ``text`` string field; every record is a document;
    - any other file (optionally ``.gz``): one UTF-8 text document;
    - a directory: every ``*.txt`` and ``*.jsonl`` file below it, in sorted
      path order (hidden files and directories skipped).
    """
    if path is None:
        return [_read_text_file(shipped_corpus_path())]
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"data path {path} does not exist; pass a text file, a directory "
                        "of .txt files or a .jsonl file with a 'text' field")
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for n in sorted(names):
                if n.startswith("."):
                    continue
                base = n[:-3] if n.endswith(".gz") else n
                if base.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES):
                    files.append(os.path.join(root, n))
        if not files:
            raise DataError(f"data directory {path} holds no .txt or .jsonl files")
        texts = []
        for fp in files:
            if not _is_jsonl(fp):
                try:
                    texts.append(_read_text_file(fp))
                except DataError as e:
                    if "is empty" in str(e):
                        log.warning("skipping empty data file %s", fp)
                        continue
                    raise
            else:
                texts.extend(_read_jsonl(fp))
        if not texts:
            raise DataError(f"all .txt/.jsonl files under {path} are empty")
        log.info("loaded %d documents from %d files under %s", len(texts), len(files), path)
        return texts
    return _load_file(path)
