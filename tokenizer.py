"""Corpora and the byte-level BPE tokenizer.

Every corpus is an iterator of documents (strings). The tokenizer is HuggingFace `tokenizers`'
byte-level BPE, saved as a standard tokenizer.json that `tokenizers.Tokenizer.from_file` and
transformers' fast tokenizer load unchanged.

Imports nothing of the project: data.py drives it (`python data.py prepare`, `python data.py stats`).
"""

import functools
import glob
import hashlib
import logging
import os
import socket
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

EOT = "<|endoftext|>"  # separates documents; always token id 0
CORPORA = ("stdlib", "python", "tinystories", "fineweb-edu")  # or a path or glob of local files
HUB = {  # name -> (dataset, config, split, text field), streamed: nothing is downloaded whole
    "tinystories": ("roneneldan/TinyStories", None, "train", "text"),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text"),
}


class CorpusError(ValueError):
    """A corpus that cannot be read: the message names the input and how to fix it."""


# --- Corpora -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The running Python's standard library sources: about 30 MB of code and English docstrings
    that every machine with Python has, so the project trains offline on a fresh machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts))


def stdlib_documents() -> Iterator[str]:
    for path in stdlib_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            yield text


PYTHON_SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt", ".h")
PYTHON_MAX_FILE = 1 << 20  # bytes; larger files are generated tables (unicode data, vendored blobs), not text


@functools.lru_cache(maxsize=1)
def python_files() -> tuple[Path, ...]:
    """Every text source of the running Python installation: the standard library and the
    site-packages (code, stubs, docs and C headers), files of at most PYTHON_MAX_FILE bytes.
    Sorted by path here; python_documents orders them by content."""
    paths = sysconfig.get_paths()
    roots = sorted({Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib", "include") if k in paths})
    roots = [r for r in roots if not any(o != r and o in r.parents for o in roots)]  # site-packages sits in stdlib
    files = set()
    for root in roots:
        for path in root.rglob("*"):
            if path.suffix in PYTHON_SUFFIXES and path.is_file() and path.stat().st_size <= PYTHON_MAX_FILE:
                files.add(path)
    return tuple(sorted(files))


def python_documents(warn=print) -> Iterator[str]:
    """The python corpus: python_files() read on all cores, each distinct text once (packages vendor
    the same files), in the order of the text's sha256. That order, and so the split and the
    tokenizer sample, is the same on every machine with the same files, whatever their paths."""
    files = python_files()
    texts = {}
    for raw in tqdm(read_in_parallel(files), total=len(files), desc="reading python", unit="file", leave=False,
                    disable=None):
        text = raw.decode("utf-8", errors="replace")
        if text.strip():
            texts.setdefault(hashlib.sha256(raw).hexdigest(), text)
    warn(f"python corpus: {len(files):,} files, {len(texts):,} distinct non-empty texts "
         f"({len(files) - len(texts):,} duplicates or empty skipped)")
    for digest in sorted(texts):
        yield texts.pop(digest)


def read_in_parallel(files, workers: int | None = None) -> Iterator[bytes]:
    """Each file's bytes, in the order the reads finish, read by daemon threads: a Ctrl-C in the consumer stops
    at once, and no reader holds the process at its exit (a thread pool's, interrupted inside its submit, once
    hung it there). A read that fails raises here, in the consumer."""
    import queue
    import threading
    workers = max(1, min(workers or os.cpu_count() or 4, len(files)))
    done = queue.Queue(maxsize=4 * workers)

    def read(part):
        for path in part:
            try:
                done.put(Path(path).read_bytes())
            except OSError as e:
                done.put(e)
    for i in range(workers):
        threading.Thread(target=read, args=(files[i::workers],), daemon=True).start()
    for _ in range(len(files)):
        raw = done.get()
        if isinstance(raw, OSError):
            raise raw
        yield raw


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when offline is asked for (HF_HUB_OFFLINE) or the hub does not answer within
    timeout seconds: the datasets library would otherwise retry for about half a minute."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


HUB_RETRY_WAITS = (2, 4, 8, 16, 32)  # seconds before each retry of a broken hub stream: about a minute in all


def hub_documents(name: str, limit: int | None = None, warn=print) -> Iterator[str]:
    """Stream a HuggingFace dataset. With no network this fails at once with one clear message; a
    stream that breaks part way is opened again after a pause (HUB_RETRY_WAITS) and goes on from the
    record it reached, each retry named in one line."""
    path, config, split, field = HUB[name]
    local = (f"download its files elsewhere and pass them as a local corpus, e.g. --corpus "
             f"'/path/to/files/*.parquet' --text-field {field} (or use --corpus stdlib, which needs no network)")
    if not hub_reachable():
        raise CorpusError(f"corpus {name!r} streams {path} from the HuggingFace hub, which cannot be reached "
                          f"(offline, or HF_HUB_OFFLINE is set): {local}")
    import datasets

    def records():
        done, error = 0, None
        for retry, wait in enumerate((0, *HUB_RETRY_WAITS)):
            if wait:
                warn(f"hub: {path} broke after {done:,} records ({type(error).__name__}: {str(error)[:120]}); "
                     f"retry {retry} of {len(HUB_RETRY_WAITS)} in {wait} s")
                time.sleep(wait)
            try:
                stream = datasets.load_dataset(path, config, split=split, streaming=True)
                for record in stream.skip(done) if done else stream:
                    done += 1
                    yield record
                return
            except Exception as e:  # the hub raises many types for a dropped connection; all mean the same here
                error = e
        raise CorpusError(f"could not stream {path} from the HuggingFace hub after {len(HUB_RETRY_WAITS)} retries "
                          f"({type(error).__name__}: {str(error)[:200]}): {local}")
    yield from _texts(records(), field, f"{path} ({name})", limit, warn)


def local_files(pattern: str) -> list[Path]:
    files = ([Path(f) for f in sorted(glob.glob(pattern, recursive=True))] if glob.has_magic(pattern)
             else [Path(pattern)])
    files = [f for f in files if f.is_file()]
    if not files:
        raise CorpusError(f"corpus {pattern!r}: no such file; give one of {CORPORA} or a path or glob of text, "
                          f".jsonl or .parquet files (quote a glob: --corpus 'src/**/*.py')")
    return files


def source_fingerprint(corpus: str) -> dict:
    """What the corpus is made of, to notice later that it changed: for local files their names,
    sizes and modification times; for the stdlib the Python version and file count; for a hub
    corpus its name (the hub's revision is not checked)."""
    if corpus == "stdlib":
        return {"python": sys.version.split()[0], "files": len(stdlib_files())}
    if corpus == "python":
        files = python_files()
        listing = "\n".join(f"{f} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files)
        return {"python": sys.version.split()[0], "files": len(files), "bytes": sum(f.stat().st_size for f in files),
                "listing_sha256": hashlib.sha256(listing.encode()).hexdigest()[:16]}
    if corpus in HUB:
        return {"hub": HUB[corpus][0]}
    files = local_files(corpus)
    listing = "\n".join(f"{f.resolve()} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files)
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "listing_sha256": hashlib.sha256(listing.encode()).hexdigest()[:16]}


def local_documents(pattern: str, field: str = "text", warn=print) -> Iterator[str]:
    """Local text files of any extension (one document per file: .txt, .py, .md ...) or .jsonl /
    .parquet files (one per record),
    read through the same `datasets` call path as the hub corpora. Text that is not valid UTF-8
    is decoded with replacement characters, and records without text are skipped: both are
    counted and reported with the file they came from."""
    files = local_files(pattern)
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    kinds = {f.suffix for f in files}
    if not kinds & set(builder):
        empty = []
        for f in files:
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                warn(f"warning: {f} is not valid UTF-8 (byte {e.start}): its undecodable bytes became U+FFFD")
                text = raw.decode("utf-8", errors="replace")
            if text.strip():
                yield text
            else:
                empty.append(f.name)
        if empty:
            warn(f"warning: skipped {len(empty)} empty file(s) in {pattern!r}: {', '.join(empty[:5])}")
        return
    if len(kinds) != 1:
        raise CorpusError(f"corpus {pattern!r}: record files (.jsonl, .parquet) and text files cannot mix, got "
                          f"{sorted(kinds)}: narrow the pattern to one kind")
    import datasets
    # A malformed file is reported below in one line naming it; datasets' own log of it is noise.
    logging.getLogger("datasets").setLevel(logging.CRITICAL)
    for f in files:  # file by file, so that a skipped record can be reported with its file
        if f.stat().st_size == 0:
            warn(f"warning: {f} is empty: skipped")
            continue
        try:
            stream = datasets.load_dataset(builder[f.suffix], data_files=[str(f)], split="train", streaming=True)
            yield from _texts(stream, field, str(f), None, warn)
        except CorpusError:
            raise
        except Exception as e:  # datasets raises its own types for a malformed file
            raise CorpusError(f"{f}: cannot be read as {f.suffix[1:]} ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}): fix or remove "
                              f"the file") from None


def _texts(stream, field: str, source: str, limit: int | None, warn=print) -> Iterator[str]:
    """The text of each record. A record whose field is missing, empty or not text is skipped and
    named in one warning (the first five by number): one bad record in a large dump should not
    stop a run, but it must not vanish unseen. A file where no record has the field is refused."""
    skipped, total = [], 0
    for i, record in enumerate(stream):
        if limit is not None and i >= limit:
            break
        total += 1
        if field not in record:
            raise CorpusError(f"{source}: record {i + 1} has no text field {field!r} (fields: {sorted(record)}); "
                              f"pass the right one with --text-field")
        if isinstance(record[field], str) and record[field]:
            yield record[field]
        else:
            skipped.append((i + 1, record[field]))
    if skipped:
        named = ", ".join(f"record {n} ({'no ' + repr(field) if v is None else 'empty' if v == '' else type(v).__name__})"
                          for n, v in skipped[:5])
        warn(f"warning: {source}: skipped {len(skipped)} of {total} records without text in {field!r}: {named}"
             f"{' ...' if len(skipped) > 5 else ''}")


def documents(corpus: str, text_field: str = "text", limit: int | None = None, warn=print) -> Iterator[str]:
    """The documents of a corpus by name, or of local files by path or glob. Refuses an empty one."""
    if corpus == "stdlib":
        docs = stdlib_documents()
    elif corpus == "python":
        docs = python_documents(warn)
    elif corpus in HUB:
        docs = hub_documents(corpus, limit, warn)
    else:
        docs = local_documents(corpus, text_field, warn)  # the limit applies below
    empty = True
    for i, doc in enumerate(docs):
        if limit is not None and i >= limit:
            return
        empty = False
        yield doc
    if empty:
        raise CorpusError(f"corpus {corpus!r} has no documents (field {text_field!r}): nothing to train on")


# --- The tokenizer -------------------------------------------------------------------------

def new_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE())
    # GPT-2's byte-level scheme: any UTF-8 text maps to bytes, so nothing is ever unknown and
    # decode(encode(text)) == text exactly. No prefix space: it would change the text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(docs: Iterator[str], vocab_size: int, out: Path, show_progress: bool | None = None):
    """Train byte-level BPE on docs and write out/tokenizer.json atomically; returns the tokenizer.
    show_progress: the trainer's own progress bars (None: where stderr is a terminal, not in a log file).

    The merges are computed in a child process that reads docs from its stdin: the Rust trainer
    holds its process for up to a minute once the text is in, and Python runs no signal handler
    until it returns. Here the parent waits in short slices, so a Ctrl-C stops the child (nothing is
    written) and raises KeyboardInterrupt within a fraction of a second."""
    import struct
    import subprocess
    if not 256 + 1 <= vocab_size <= 2**16:
        raise ValueError(f"vocab size {vocab_size} must be between 257 (bytes + end-of-text) and 65,536 "
                         f"(token ids are stored as uint16)")
    show_progress = sys.stderr.isatty() if show_progress is None else show_progress
    # The child ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the parent, which
    # stops it, is the one that says so (the child's own KeyboardInterrupt traceback said it again).
    code = (f"import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import tokenizer; "
            f"tokenizer._train_from_stdin({vocab_size}, {str(out)!r}, {show_progress})")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        for doc in docs:
            data = doc.encode("utf-8", errors="replace")
            child.stdin.write(struct.pack("<q", len(data)) + data)
        child.stdin.write(struct.pack("<q", -1))  # the end of the documents
        child.stdin.close()
        while child.poll() is None:
            try:
                child.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
    except BaseException:
        child.kill()
        child.wait()
        raise
    if child.returncode:
        raise RuntimeError(f"tokenizer training failed in its worker process (exit code {child.returncode}); "
                           f"its message is above")
    return load_tokenizer(out / "tokenizer.json")


def _train_from_stdin(vocab_size: int, out: str, show_progress: bool):
    """train_tokenizer's worker: BPE over the length-prefixed documents on stdin, saved through a
    temporary file."""
    import struct
    from tokenizers import pre_tokenizers, trainers
    stream = sys.stdin.buffer

    def documents():
        while (n := struct.unpack("<q", stream.read(8))[0]) >= 0:
            yield stream.read(n).decode("utf-8")
    tok = new_bpe()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(), trainer=trainer)
    Path(out).mkdir(parents=True, exist_ok=True)  # only now: a corpus that fails to read leaves no folder
    tmp = Path(out) / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(Path(out) / "tokenizer.json")


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer
    if not Path(path).is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist: train one with "
                                f"`python data.py prepare` and the run's --config and --corpus")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a plain Exception for a malformed file
        raise ValueError(f"tokenizer {path} is not a readable tokenizer.json ({str(e)[:120]}): delete it to "
                         f"retrain, or point --tokenizer at the original") from None
    if tok.token_to_id(EOT) is None:
        raise ValueError(f"tokenizer {path} has no {EOT} token: it was not trained by this project")
    # The text "<|endoftext|>" inside a document is text, not a document boundary: by default
    # `tokenizers` matches added special tokens in the input, so a file that holds the literal would
    # be cut in two there and its 13 bytes would count none in bits per byte. The EOT between
    # documents is written by id (data.py), never through the text.
    tok.encode_special_tokens = True
    return tok


def tokenizer_hash(path: Path) -> str:
    """sha256 of tokenizer.json, first 16 hex digits: shards and checkpoints carry it, so data
    tokenized one way is never read by a model trained on another."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def token_byte_lengths(tok) -> list[int]:
    """UTF-8 bytes each token id decodes to (0 for special tokens). Byte-level BPE writes each
    byte as one character of the token's string, so the string length is the byte count and
    summing over a sequence gives the bytes of its decoded text."""
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    lengths = [0] * tok.get_vocab_size()
    for token, i in tok.get_vocab().items():
        lengths[i] = 0 if token in specials else len(token)
    return lengths


def prefix_ids(tok) -> list[int]:
    """Each token id's prefix token: the id of the longest proper prefix of its bytes that is itself a
    token, -1 where there is none (single bytes, special tokens). The prefix-token loss learns it
    (train.prefix_weight, modded-nanogpt record #88). Byte-level BPE writes each byte as one character,
    so a prefix of the string is a prefix of the bytes. Sorted, a token's prefixes come before it and
    every token between them extends them, so a stack of the current token's ancestors holds the
    longest one on top: one pass, where probing every length would take V x length lookups."""
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    table = [-1] * tok.get_vocab_size()
    stack: list[tuple[str, int]] = []  # (token, id): each a prefix of the next, shortest first
    for token, i in sorted((t, i) for t, i in tok.get_vocab().items() if t not in specials):
        while stack and not token.startswith(stack[-1][0]):
            stack.pop()
        if stack:
            table[i] = stack[-1][1]
        stack.append((token, i))
    return table


def bytes_per_token(tok, docs: list[str]) -> float:
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(docs))
    return n_bytes / max(n_tokens, 1)


def is_val(index: int, val_fraction: float, doc: str | None = None) -> bool:
    """Whether a document belongs to the validation split: every (1/val_fraction)-th document, or,
    given its text (the python corpus), when a hash of the text falls in the first val_fraction of
    the range, so that adding or removing a file moves no other file between the splits.
    Deterministic, so the tokenizer, the shards and the stats agree on what is held out."""
    if val_fraction <= 0:
        return False
    if doc is not None:
        digest = hashlib.blake2b(doc.encode("utf-8", errors="replace"), digest_size=8).digest()
        return int.from_bytes(digest, "little") < val_fraction * 2**64
    return index % max(1, round(1 / val_fraction)) == 0


def split_by_hash(corpus: str) -> bool:
    """The corpora whose split is by the document's text (is_val): those built from files that
    differ between machines."""
    return corpus == "python"


def train_documents(corpus: str, text_field: str, val_fraction: float, limit: int | None = None, warn=print):
    hashed = split_by_hash(corpus)
    return (d for i, d in enumerate(documents(corpus, text_field, limit, warn))
            if not is_val(i, val_fraction, d if hashed else None))


def held_out(corpus: str, text_field: str, val_fraction: float, n: int = 200) -> list[str]:
    """Up to n validation documents, which the tokenizer never saw in training."""
    docs, hashed = [], split_by_hash(corpus)
    for i, d in enumerate(documents(corpus, text_field)):
        if is_val(i, val_fraction, d if hashed else None):
            docs.append(d)
            if len(docs) == n:
                break
    return docs
