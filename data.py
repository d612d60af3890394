"""Text to token shards, and shards to micro-batches.

    python data.py prepare                                # tiny config: stdlib corpus, 4,096 tokens
    python data.py prepare --config configs/88m.toml      # what the 88m run trains on
    python data.py prepare --corpus 'my/*.txt' --vocab-size 8192
    python data.py stats --config configs/88m.toml         # bytes per token on held-out documents

A shard is one file: a fixed 256-byte little-endian header, the tokens as uint16, then the
document-start index as uint64 offsets into the tokens. Readers check every header field
before trusting a byte; writers write a temporary file and rename it, so an interrupted
prepare never leaves a shard that loads. A manifest.json, written last, marks a finished
prepare; rerunning an unfinished one does the whole job again.

ShardLoader memory-maps the shards and serves (x, y) micro-batches of B x T windows in a
seeded order without replacement, with an exact resumable cursor.
"""

import argparse
import errno
import itertools
import json
import os
import re
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import config as C
import tokenizer as tk
from config import DataConfig  # data's settings live with the others in config.py

MAGIC = b"ONEGPUTK"
VERSION = 2  # 2: the text "<|endoftext|>" inside a document is encoded as text (tokenizer.load_tokenizer)
HEADER_SIZE = 256  # bytes; keeps the token array 256-byte aligned in the file
# magic, version, bytes per token, vocab size, reserved, tokenizer hash (16 hex digits),
# token count, document count, UTF-8 bytes of the source text (for bits per byte)
HEADER = struct.Struct("<8sIIII16sQQQ")
TOKEN_DTYPE = np.dtype("<u2")  # uint16: vocabularies up to 65,536
DEFAULT_CACHE = Path(__file__).resolve().parent / "cache"


class ShardError(ValueError):
    """A shard that must not be trusted: the message names the file and what was expected."""


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("ONEGPU_CACHE") or DEFAULT_CACHE)


def data_dir(cfg: DataConfig, vocab_size: int) -> Path:
    """One folder per (corpus, vocabulary): cache/stdlib-4096/, cache/fineweb-edu-32768/ ...
    The vocabulary size is the model's (model.vocab_size): one number, one place."""
    if not 257 <= vocab_size <= 2**16:
        raise ValueError(f"vocab_size={vocab_size}: shards store tokens as uint16, so the vocabulary "
                         f"must be between 257 and 65,536")
    # A path or glob becomes a visible name: "../mycode/*.py" -> "mycode_.py", not the hidden ".._mycode_.py".
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", cfg.corpus).strip("._-")[-60:].lstrip("._-")
    limited = cfg.max_documents and not (cfg.corpus == "stdlib" and cfg.max_documents >= len(tk.stdlib_files()))
    suffix = f"-{cfg.max_documents}docs" if limited else ""  # a limit the corpus does not reach changes nothing
    if cfg.tokenizer_file:  # shards of another tokenizer (a checkpoint's) live apart from the corpus' own
        suffix += f"-tok{tk.tokenizer_hash(given_tokenizer(cfg))[:8]}"
    return cache_root(cfg) / f"{slug}-{vocab_size}{suffix}"


def given_tokenizer(cfg: DataConfig) -> Path:
    path = Path(cfg.tokenizer_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer_file={cfg.tokenizer_file!r} does not exist: give a tokenizer.json, "
                                f"or \"\" to train the corpus' own")
    return path


# --- Shard files ---------------------------------------------------------------------------

def write_shard(path: Path, tokens: np.ndarray, doc_starts: np.ndarray, vocab_size: int,
                tok_hash: str, n_bytes: int):
    """Write one shard atomically: temporary name, fsync, rename."""
    if vocab_size > 2**16:  # token ids >= 2**16 would wrap silently in uint16
        raise ValueError(f"vocabulary of {vocab_size} does not fit uint16 shards (at most 65,536)")
    assert tokens.dtype == TOKEN_DTYPE and doc_starts.dtype == np.uint64
    header = HEADER.pack(MAGIC, VERSION, TOKEN_DTYPE.itemsize, vocab_size, 0, tok_hash.encode(),
                         len(tokens), len(doc_starts), n_bytes).ljust(HEADER_SIZE, b"\0")
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(tokens.tobytes())
            f.write(doc_starts.astype("<u8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as e:  # a full disk names no file: name the shard, and leave no partial one
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None


def random_shards(folder: Path, vocab: int, tokens: int, seed: int = 1337) -> list[Path]:
    """A shard of random token ids with random document lengths (mean 512), for measuring speed
    through the real ShardLoader without a prepared corpus. Throughput does not depend on what
    the tokens say."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, tokens, dtype=np.uint16)
    starts = np.unique(np.concatenate([[0], rng.integers(1, tokens, tokens // 512)])).astype(np.uint64)
    path = folder / "train_00000.bin"
    write_shard(path, ids, starts, vocab, "random0000000000", tokens)
    return [path]


@dataclass
class ShardInfo:
    path: Path
    vocab_size: int
    tokenizer_hash: str
    n_tokens: int
    n_docs: int
    n_bytes: int


def read_header(path: Path, vocab_size: int | None = None, tok_hash: str | None = None) -> ShardInfo:
    """Check a shard's header against the file and the run's expectations."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise ShardError(f"{path}: not a onegpu shard (expected magic {MAGIC!r}, found {raw[:8]!r}); "
                         f"rerun `python data.py prepare`")
    magic, version, itemsize, vocab, _, hash_, n_tok, n_docs, n_bytes = HEADER.unpack_from(raw)
    if version != VERSION or itemsize != TOKEN_DTYPE.itemsize:
        raise ShardError(f"{path}: format version {version} with {itemsize}-byte tokens; this code reads "
                         f"version {VERSION} with {TOKEN_DTYPE.itemsize}-byte tokens: rerun prepare")
    expected = HEADER_SIZE + n_tok * itemsize + n_docs * 8
    if size != expected:
        raise ShardError(f"{path}: file is {size:,} bytes but its header ({n_tok:,} tokens, {n_docs:,} "
                         f"documents) needs {expected:,}: truncated or corrupted, rerun prepare")
    info = ShardInfo(path, vocab, hash_.decode(), n_tok, n_docs, n_bytes)
    if vocab_size is not None and vocab != vocab_size:
        raise ShardError(f"{path}: written for a vocabulary of {vocab:,} tokens, but the model expects "
                         f"{vocab_size:,}: prepare data with the same vocab_size as the model")
    if tok_hash is not None and info.tokenizer_hash != tok_hash:
        raise ShardError(f"{path}: written with tokenizer {info.tokenizer_hash}, but this run uses "
                         f"tokenizer {tok_hash}: re-prepare the shards with this run's tokenizer")
    return info


def check_ids(info: ShardInfo, tokens: np.ndarray):
    """Refuse a shard whose body holds a token id its vocabulary does not have (the header can be intact over a
    damaged body): an embedding lookup would fail mid-training, a device-side assert on a GPU. One pass over the
    memory map, at memory speed."""
    top = int(tokens.max()) if len(tokens) else 0
    if top >= info.vocab_size:
        at = int(np.argmax(tokens >= info.vocab_size))
        raise ShardError(f"{info.path}: token id {top:,} (first bad one at token {at:,}) is beyond the "
                         f"{info.vocab_size:,}-token vocabulary its header gives: the file is damaged; rebuild the "
                         f"shards with `python data.py prepare --rebuild`")


def open_shard(info: ShardInfo):
    """(tokens, doc_starts) as read-only memory maps: nothing is read until it is used."""
    tokens = np.memmap(info.path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_SIZE, shape=(info.n_tokens,))
    tokens = tokens.view(np.ndarray)  # same mapping; slicing a plain ndarray is several times cheaper
    starts = np.fromfile(info.path, dtype="<u8", count=info.n_docs, offset=HEADER_SIZE + 2 * info.n_tokens)
    return tokens, starts.astype(np.int64)  # small (8 bytes a document): read it into memory


# --- Prepare: documents -> tokenizer -> shards ---------------------------------------------

def ensure_tokenizer(cfg: DataConfig, vocab_size: int, log=print) -> Path:
    path = data_dir(cfg, vocab_size) / "tokenizer.json"
    if path.is_file():
        log(f"tokenizer: reusing {path}")
        return path
    if cfg.tokenizer_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(given_tokenizer(cfg), path)
        log(f"tokenizer: {cfg.tokenizer_file} (data.tokenizer_file), copied to {path}")
        return path
    log(f"tokenizer: training a {vocab_size:,}-token byte-level BPE on {cfg.corpus} -> {path}")
    t0 = time.perf_counter()
    limit = cfg.tokenizer_documents or cfg.max_documents or None
    docs = tk.train_documents(cfg.corpus, cfg.text_field, cfg.val_fraction, limit, warn=log)
    tk.train_tokenizer(tqdm(docs, desc="reading", unit="doc", disable=None), vocab_size, path.parent)
    # What it was trained for: a tokenizer with fewer tokens than asked is a small corpus's (BPE ran out
    # of pairs to merge) only if this record says so; one copied in from elsewhere has no such record.
    (path.parent / "tokenizer.trained.json").write_text(json.dumps({"vocab_size": vocab_size,
                                                                     "hash": tk.tokenizer_hash(path)}))
    log(f"tokenizer: trained in {time.perf_counter() - t0:.0f} s")
    return path


def check_vocabulary(tok, tok_path: Path, vocab_size: int, manifest: dict | None, log=print):
    """The tokenizer, the shards and the model must agree on the vocabulary. The one allowed
    difference: a tokenizer trained here for vocab_size that came out smaller (a small corpus)."""
    n = tok.get_vocab_size()
    shards = f", its shards were written for {manifest['vocab_size']:,}" if manifest and "vocab_size" in manifest else ""
    if n == vocab_size:
        return
    try:
        trained = json.loads((tok_path.parent / "tokenizer.trained.json").read_text())
    except (OSError, ValueError):
        trained = {}
    if n < vocab_size and trained == {"vocab_size": vocab_size, "hash": tk.tokenizer_hash(tok_path)}:
        log(f"note: the corpus only supports {n:,} of the {vocab_size:,} tokens asked for; the model's extra "
            f"embedding rows stay unused")
        return
    raise ValueError(f"{tok_path} has {n:,} tokens{shards}, but model.vocab_size is {vocab_size:,}: pass "
                     f"--vocab-size {n} to use this tokenizer, or delete {tok_path} to train a {vocab_size:,}-token one")


class _ShardWriter:
    """Collects documents' tokens for one split and writes a shard whenever it is full."""

    def __init__(self, folder: Path, split: str, cfg: DataConfig, vocab_size: int, tok_hash: str):
        self.folder, self.split, self.cfg, self.vocab_size, self.tok_hash = folder, split, cfg, vocab_size, tok_hash
        self.parts, self.starts, self.n, self.bytes, self.files = [], [], 0, 0, []

    def add(self, ids: np.ndarray, n_bytes: int) -> bool:
        """Add one document's tokens; True when that filled a shard and it was written."""
        self.starts.append(self.n)
        self.parts.append(ids)
        self.n += len(ids)
        self.bytes += n_bytes
        if self.n >= self.cfg.shard_tokens:
            self.flush()
            return True
        return False

    def flush(self):
        if not self.parts:
            return
        path = self.folder / f"{self.split}_{len(self.files):05d}.bin"
        write_shard(path, np.concatenate(self.parts).astype(TOKEN_DTYPE), np.array(self.starts, np.uint64),
                    self.vocab_size, self.tok_hash, self.bytes)
        self.files.append(path.name)
        self.parts, self.starts, self.n, self.bytes = [], [], 0, 0

    def pending(self) -> dict:
        """The documents not yet in a shard, as arrays (saved with the progress of a prepare)."""
        tokens = np.concatenate(self.parts) if self.parts else np.zeros(0, TOKEN_DTYPE)
        return {"tokens": tokens, "ends": np.cumsum([len(p) for p in self.parts], dtype=np.int64),
                "bytes": np.array(self.bytes)}

    def restore(self, files: list[str], pending: dict):
        self.files = list(files)
        self.parts = list(np.split(pending["tokens"], pending["ends"][:-1])) if len(pending["ends"]) else []
        self.starts = [0, *pending["ends"][:-1].tolist()] if self.parts else []
        self.n, self.bytes = len(pending["tokens"]), int(pending["bytes"])


# A prepare records its progress after every train shard: the documents read so far, the shards
# written, and the validation documents not yet in a shard (val.pending.<documents>.npz). A prepare
# that broke (a dropped hub stream, Ctrl-C, a full disk) goes on from there the next time, with the
# same shards an unbroken one writes.
PROGRESS = "progress.json"
BATCH_BYTES = 16 << 20  # text tokenized per encode_batch call (all cores)


def save_progress(folder: Path, key: dict, documents: int, source_bytes: int, writers: dict):
    pending = folder / f"val.pending.{documents}.npz"
    with open(pending.with_suffix(".tmp"), "wb") as f:
        np.savez(f, **writers["val"].pending())
    pending.with_suffix(".tmp").replace(pending)
    state = {**key, "documents": documents, "source_bytes": source_bytes, "train": writers["train"].files,
             "val": writers["val"].files, "val_pending": pending.name}
    tmp = folder / (PROGRESS + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(folder / PROGRESS)
    for old in folder.glob("val.pending.*.npz"):  # only now: the progress above no longer names them
        if old != pending:
            old.unlink()


def load_progress(folder: Path, key: dict, vocab_size: int, tok_hash: str) -> dict | None:
    """The progress of an earlier prepare of the same corpus, tokenizer and sharding, with every shard it
    names present and sound; None otherwise."""
    try:
        state = json.loads((folder / PROGRESS).read_text())
        if any(state.get(k) != v for k, v in key.items()):
            return None
        for name in state["train"] + state["val"]:
            read_header(folder / name, vocab_size, tok_hash)
        with np.load(folder / state["val_pending"]) as pending:
            state["pending"] = {k: pending[k] for k in ("tokens", "ends", "bytes")}
        return state
    except (OSError, KeyError, ValueError, json.JSONDecodeError, ShardError):
        return None


def go_on(folder: Path, key: dict, vocab_size: int, tok_hash: str, writers: dict, log) -> tuple[int, int]:
    """(documents, source bytes) an earlier prepare of the same key finished, its shards and pending
    validation documents put back into writers; (0, 0) and a clean folder when there is none."""
    progress = load_progress(folder, key, vocab_size, tok_hash)
    if progress is None:
        clear_progress(folder)
        return 0, 0
    empty = {"tokens": np.zeros(0, TOKEN_DTYPE), "ends": np.zeros(0, np.int64), "bytes": np.array(0)}
    writers["train"].restore(progress["train"], empty)
    writers["val"].restore(progress["val"], progress["pending"])
    log(f"shards: going on from document {progress['documents']:,} of an earlier prepare "
        f"({len(progress['train'])} train shard(s) kept, their headers checked)")
    return progress["documents"], progress["source_bytes"]


def clear_progress(folder: Path):
    (folder / PROGRESS).unlink(missing_ok=True)
    for path in folder.glob("val.pending.*"):
        path.unlink()


def read_manifest(folder: Path) -> dict | None:
    """manifest.json of a finished prepare, or None when there is none or it cannot be trusted."""
    path = Path(folder) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    needed = {"tokenizer_hash", "val_fraction", "train", "val", "train_tokens", "val_tokens"}
    return manifest if isinstance(manifest, dict) and needed <= set(manifest) else None


def prepare(cfg: DataConfig, vocab_size: int, log=print, rebuild: bool = False) -> Path:
    """Tokenize the corpus into train/val shards (once; a finished prepare is reused after its
    shards pass the header checks). A corpus whose files changed since is refused, naming what
    changed; rebuild=True retrains the tokenizer and rewrites the shards. A first prepare that
    fails (a bad corpus file, say) leaves no folder behind."""
    folder = data_dir(cfg, vocab_size)
    new = not folder.exists()
    try:
        return _prepare(cfg, vocab_size, folder, log, rebuild)
    except Exception:
        # A first prepare that fails leaves nothing behind but a tokenizer it trained (minutes of work,
        # and the next prepare's); on Ctrl-C everything written so far stays.
        if new and folder.exists():
            kept = {"tokenizer.json", "tokenizer.trained.json"}
            progress = folder / PROGRESS
            if progress.exists():  # and what the next prepare goes on from
                state = json.loads(progress.read_text())
                kept |= {PROGRESS, state["val_pending"], *state["train"], *state["val"]}
            for path in folder.iterdir():
                if path.name not in kept:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            if not any(folder.iterdir()):
                folder.rmdir()
            else:
                log(f"shards: the prepare failed; what it finished (the tokenizer, and shards in {PROGRESS}) is "
                    f"kept in {folder} for the next one")
        raise


def _prepare(cfg: DataConfig, vocab_size: int, folder: Path, log, rebuild: bool) -> Path:
    manifest_path = folder / "manifest.json"
    source = tk.source_fingerprint(cfg.corpus)
    manifest = read_manifest(folder)
    if manifest_path.exists() and manifest is None:
        log(f"shards: {manifest_path} is unreadable or incomplete: writing the shards again")
    if manifest is not None and manifest.get("source") not in (None, source) and not rebuild:
        raise ValueError(f"corpus {cfg.corpus!r} changed since {folder} was prepared (then {manifest['source']}, "
                         f"now {source}): rebuild it with `python data.py prepare --corpus {cfg.corpus!r} "
                         f"--vocab-size {vocab_size} --rebuild` "
                         f"(this retrains the tokenizer, so older checkpoints will not resume on it)")
    if rebuild and folder.exists():
        log(f"rebuild: removing the tokenizer and shards in {folder}")
        for path in folder.iterdir():
            if path.name in ("tokenizer.json", "tokenizer.trained.json", "manifest.json") or path.suffix == ".bin":
                path.unlink()
        manifest = None
    tok_path = ensure_tokenizer(cfg, vocab_size, log)
    tok = tk.load_tokenizer(tok_path)  # a damaged tokenizer.json is refused here, before any file changes
    check_vocabulary(tok, tok_path, vocab_size, manifest, log)
    tok_hash = tk.tokenizer_hash(tok_path)
    if manifest is not None and manifest["tokenizer_hash"] == tok_hash and manifest["val_fraction"] == cfg.val_fraction:
        if reusable(folder, manifest, vocab_size, tok_hash, log):
            return folder
    manifest_path.unlink(missing_ok=True)
    eot = tok.token_to_id(tk.EOT)
    writers = {s: _ShardWriter(folder, s, cfg, vocab_size, tok_hash) for s in ("train", "val")}
    key = {"source": source, "tokenizer_hash": tok_hash, "val_fraction": cfg.val_fraction,
           "shard_tokens": cfg.shard_tokens, "max_documents": cfg.max_documents}
    t0, total_bytes, index, hashed = time.perf_counter(), 0, 0, tk.split_by_hash(cfg.corpus)
    if not rebuild:
        index, total_bytes = go_on(folder, key, vocab_size, tok_hash, writers, log)
    log(f"shards: tokenizing {cfg.corpus} with {os.cpu_count()} threads -> {folder}")
    docs = itertools.islice(tk.documents(cfg.corpus, cfg.text_field, cfg.max_documents or None, warn=log), index, None)
    bar = tqdm(desc="tokenizing", unit="B", unit_scale=True, disable=None)  # None: no bar in a log file
    for batch in _batches(docs, max_bytes=BATCH_BYTES):
        # encode_batch runs on all cores (Rust threads), so no process pool is needed.
        for doc, enc in zip(batch, tok.encode_batch(batch)):
            n_bytes = len(doc.encode("utf-8"))
            split = "val" if tk.is_val(index, cfg.val_fraction, doc if hashed else None) else "train"
            full = writers[split].add(np.array(enc.ids + [eot], dtype=TOKEN_DTYPE), n_bytes)
            total_bytes += n_bytes
            index += 1
            if full and split == "train":
                save_progress(folder, key, index, total_bytes, writers)
            bar.update(n_bytes)
    bar.close()
    for w in writers.values():
        w.flush()
    write_manifest(folder, cfg, key, vocab_size, writers, index, total_bytes, time.perf_counter() - t0, log)
    return folder


def reusable(folder: Path, manifest: dict, vocab_size: int, tok_hash: str, log) -> bool:
    """Whether every shard the manifest lists passes its header's checks (else say which failed)."""
    broken = []
    for name in manifest["train"] + manifest["val"]:
        try:
            read_header(folder / name, vocab_size, tok_hash)
        except (ShardError, OSError) as e:
            broken.append(str(e).split(":")[0] if isinstance(e, ShardError) else f"{folder / name} (missing)")
    if not broken:
        log(f"shards: reusing {folder} ({manifest['train_tokens']:,} train, {manifest['val_tokens']:,} val tokens)")
        return True
    log(f"shards: {len(broken)} shard(s) failed their checks ({', '.join(broken[:3])}): writing the shards again")
    return False


def write_manifest(folder: Path, cfg: DataConfig, key: dict, vocab_size: int, writers: dict, index: int,
                   total_bytes: int, seconds: float, log):
    """The finished shards' manifest.json (atomically), once both splits have some; the tokenizing's summary."""
    source, tok_hash, manifest_path = key["source"], key["tokenizer_hash"], folder / "manifest.json"
    manifest = {"corpus": cfg.corpus, "source": source, "tokenizer_hash": tok_hash, "vocab_size": vocab_size,
                "val_fraction": cfg.val_fraction, "documents": index,
                "train_tokens": _count(folder, writers["train"].files), "val_tokens": _count(folder, writers["val"].files),
                "source_bytes": total_bytes, "seconds": round(seconds, 1),
                "mb_per_s": round(total_bytes / 1e6 / seconds, 2),
                "train": writers["train"].files, "val": writers["val"].files}
    if not manifest["train"]:
        raise ValueError(f"corpus {cfg.corpus!r}: every document went to validation; lower data.val_fraction")
    if not manifest["val"]:  # the python corpus holds out by each file's hash: a few files may give none
        raise ValueError(f"corpus {cfg.corpus!r}: none of its {index:,} documents went to validation at "
                         f"data.val_fraction={cfg.val_fraction:g}; raise data.val_fraction (--val-fraction)")
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(manifest_path)
    clear_progress(folder)
    log(f"shards: {index:,} documents, {total_bytes / 1e6:.1f} MB -> {manifest['train_tokens']:,} train + "
        f"{manifest['val_tokens']:,} val tokens in {seconds:.1f} s ({manifest['mb_per_s']} MB/s, "
        f"{total_bytes / (manifest['train_tokens'] + manifest['val_tokens']):.2f} bytes/token)")


def _count(folder: Path, files: list[str]) -> int:
    return sum(read_header(folder / f).n_tokens for f in files)


def _batches(docs, max_bytes: int):
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def shard_files(folder: Path, split: str) -> list[Path]:
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"{folder} has no finished shards (manifest.json missing or unreadable): run "
                                f"`python data.py prepare --config <your config>`")
    return [Path(folder) / name for name in manifest[split]]


# --- The loader ----------------------------------------------------------------------------

class ShardLoader:
    """(x, y[, doc_ids]) micro-batches of B windows of T tokens from memory-mapped shards.

    Each shard is cut into non-overlapping windows of T + 1 tokens (x is the first T, y the
    last T), or windows that start every `stride` tokens (evaluation's whole windows, below). An
    epoch visits every window once, in an order shuffled by (seed, epoch); rank r of W takes every
    W-th window of that order, so ranks never share data. The cursor (epoch, position) is the whole
    state: load_state_dict(state_dict()) resumes exactly, a micro-batch drawn ahead by prefetch() included.
    """

    def __init__(self, files: list[Path], batch: int, seq_len: int, *, vocab_size: int | None = None,
                 tokenizer_hash: str | None = None, seed: int = 0, rank: int = 0, world: int = 1,
                 shuffle: bool = True, doc_ids: bool = False, device="cpu", pin: bool = False,
                 stride: int | None = None):
        if not files:
            raise FileNotFoundError("ShardLoader got no shard files")
        self.infos = [read_header(f, vocab_size, tokenizer_hash) for f in files]
        self.shards = [open_shard(i) for i in self.infos]
        for info, (tokens, _) in zip(self.infos, self.shards):
            check_ids(info, tokens)
        self.B, self.T = batch, seq_len
        self.seed, self.rank, self.world, self.shuffle = seed, rank, world, shuffle
        self.want_doc_ids, self.device = doc_ids, torch.device(device)
        self.pin = pin and self.device.type == "cuda"
        if stride is not None and not 0 < stride <= seq_len:
            raise ValueError(f"ShardLoader stride={stride} must lie in 1..seq_len={seq_len}")
        self.stride = stride or seq_len
        windows = np.array([max(0, (i.n_tokens - 1 - seq_len) // self.stride + 1) for i in self.infos])
        self.first_window = np.concatenate([[0], np.cumsum(windows)])  # global window -> shard
        # Windows of T + 1 tokens without a stride per shard, and their global index of each shard's first:
        # the plain evaluation's, whose targets a strided loader scores (scored_targets).
        self.plain = np.array([max(0, (i.n_tokens - 1) // seq_len) for i in self.infos])
        self.plain_first = np.concatenate([[0], np.cumsum(self.plain)])
        self.last_starts = None  # (shard, start offset) of each row of the last batch
        self.per_rank = int(windows.sum()) // world
        if self.per_rank < batch:
            split = "validation" if Path(files[0]).name.startswith("val_") else "training"
            more = "raise --val-fraction (the validation share), " if split == "validation" else ""
            raise ValueError(f"the {split} split's {len(files)} shard(s) hold {int(windows.sum())} windows of "
                             f"{seq_len + 1} tokens, fewer than --micro-batch {batch} per rank x {world} rank(s): "
                             f"{more}lower --micro-batch, or use more data")
        self.epoch, self.pos = 0, 0
        self._order = None
        self._ahead = None  # (epoch, pos before it, the batch, its last_starts): prefetch's, not yet handed out

    def state_dict(self) -> dict:
        epoch, pos = self._ahead[:2] if self._ahead else (self.epoch, self.pos)  # a batch drawn ahead is not read yet
        return {"epoch": epoch, "pos": pos, "seed": self.seed, "rank": self.rank, "world": self.world}

    def load_state_dict(self, state: dict):
        if (state["seed"], state["world"]) != (self.seed, self.world):
            raise ValueError(f"loader state is for seed {state['seed']} with {state['world']} rank(s), "
                             f"this loader has seed {self.seed} with {self.world}")
        self.epoch, self.pos, self._order, self._ahead = state["epoch"], state["pos"], None, None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            n = int(self.first_window[-1])
            order = (np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
            self._order = order[self.rank::self.world][:self.per_rank]
        return self._order

    def next_windows(self) -> np.ndarray:
        """Global indices of the next B windows; a short tail of an epoch is skipped."""
        if self.pos + self.B > self.per_rank:
            self.epoch, self.pos, self._order = self.epoch + 1, 0, None
        windows = self._epoch_order()[self.pos:self.pos + self.B]
        self.pos += self.B
        return windows

    def __len__(self) -> int:
        """Micro-batches per epoch for this rank."""
        return self.per_rank // self.B

    def rewind(self):
        """Back to the start of epoch 0 (evaluation reads the same val batches every time)."""
        self.epoch, self.pos, self._order, self._ahead = 0, 0, None, None

    def prefetch(self):
        """Draw the next micro-batch now and queue its copy to the device; next_batch() hands it out.
        train_step calls this while the GPU still runs a step's last backward: drawn after the step's one
        synchronization, with the GPU's queue empty, the next step's first micro-batch kept the GPU idle
        for the host's whole work on it (the largest gap of the 88m profile, docs/PERFORMANCE.md "Where the
        time goes"). state_dict() still stands before it, so a checkpoint saved now resumes with it.
        Without pinned memory it draws nothing: a copy from pageable memory would wait here for the GPU's
        queue to empty, and the GPU would then idle while the host queues the update."""
        if self._ahead is None and (self.pin or self.device.type != "cuda"):
            epoch, pos = self.epoch, self.pos
            batch = self.next_batch()
            self._ahead = (epoch, pos, batch, self.last_starts)

    def next_batch(self):
        if self._ahead is not None:
            *_, batch, self.last_starts = self._ahead
            self._ahead = None
            return batch
        windows = self.next_windows()
        shard = np.searchsorted(self.first_window, windows, side="right") - 1
        starts = (windows - self.first_window[shard]) * self.stride
        self.last_starts = (shard, starts)
        # x and y straight from each sequence's slice of its shard, widened to int64 as they are copied: no Python
        # loop over tokens, and both contiguous (see _to_device). Sliced from one (B, T + 1) array instead, they
        # needed a copy each to be contiguous: 1,436 µs a micro-batch of 16 x 8,192 against 857 this way on 2 CPU
        # cores (`python bench.py --loader --preset 88m --micro-batch 16`, docs/LOG.md, 2026-12-04).
        x, y = np.empty((self.B, self.T), np.int64), np.empty((self.B, self.T), np.int64)
        for row, (s, o) in enumerate(zip(shard, starts)):
            tokens = self.shards[s][0]
            x[row], y[row] = tokens[o:o + self.T], tokens[o + 1:o + self.T + 1]
        out = [torch.from_numpy(x), torch.from_numpy(y)]
        if self.want_doc_ids:
            out.append(torch.from_numpy(self._doc_ids(shard, starts)))
        return tuple(self._to_device(t) for t in out)

    # Whole windows: with sliding-window attention (window W < T), a token in the first W positions of a
    # sequence sees fewer keys than it would in the stream, wherever its document began before the
    # sequence did. An evaluation loader whose windows start every T - W tokens (shuffle off) gives each
    # target the W tokens before it: each window scores only the targets the window before it did not
    # (a shard's first window all of them). The targets are those of the first n windows that a loader
    # of the same T without a stride reads, so the loss is over the same tokens as that evaluation.

    def batches_covering(self, n: int) -> int:
        """Micro-batches per rank (shuffle off) whose scored targets cover the first n plain windows'."""
        n = min(n, int(self.plain_first[-1]))
        shard = int(np.searchsorted(self.plain_first, n - 1, side="right") - 1)
        end = (n - self.plain_first[shard]) * self.T  # the last target's offset in its shard, counted from 1
        needed = int(self.first_window[shard]) + 1 + -(-max(0, end - self.T) // self.stride)
        return -(-needed // (self.B * self.world))

    def scored_targets(self, n: int) -> torch.Tensor:
        """(B, T) bool for the last batch: targets no window before scored, within the first n plain windows."""
        shard, starts = self.last_starts
        j = np.arange(self.T)
        fresh = (starts[:, None] == 0) | (j[None, :] >= self.T - self.stride)
        window = (starts[:, None] + j[None, :]) // self.T  # the plain window holding y's token, in its shard
        within = (self.plain_first[shard][:, None] + window < n) & (window < self.plain[shard][:, None])
        return self._to_device(torch.from_numpy(fresh & within))

    def _doc_ids(self, shard, starts) -> np.ndarray:
        """(B, T) int32: for each token of x, the index of its document within the sequence."""
        ids = np.zeros((self.B, self.T), np.int32)
        for row, (s, o) in enumerate(zip(shard, starts)):
            doc_starts = self.shards[s][1]
            lo, hi = np.searchsorted(doc_starts, [o + 1, o + self.T])  # documents starting inside
            ids[row, doc_starts[lo:hi] - o] = 1
        return np.cumsum(ids, axis=1, dtype=np.int32)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device, self.pin)


def to_device(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """t, a CPU tensor, on `device`; with pin (CUDA only), through page-locked memory.
    Page-locked memory lets the copy queue behind the GPU's work instead of waiting for it: a copy from pageable
    memory waits for the stream's work to finish, so the GPU then idles while the host launches the next kernels.
    Only a contiguous tensor goes so: PyTorch sends a strided one through a contiguous copy of it in pageable memory,
    so the loader's tensors come here contiguous (a strided x did until 2026-12-04, docs/LOG.md). A fresh pinned
    tensor each time: the caching host allocator will not hand its memory out again until the copy has finished."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tokenize a corpus into uint16 shards; inspect the tokenizer.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"prepare": "train (or reuse) the tokenizer and write train/val shards",
                "stats": "bytes per token of the prepared tokenizer on held-out documents"}
    for name, help_ in commands.items():
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", default=str(C.PRESETS_DIR / "tiny.toml"),
                       help="TOML file whose [data] section and model.vocab_size are used (default: configs/tiny.toml)")
        p.add_argument("--vocab-size", type=int, default=None, help="tokens in the vocabulary (default: the config's "
                                                                    "model.vocab_size)")
        if name == "prepare":
            p.add_argument("--rebuild", action="store_true", help="retrain the tokenizer and rewrite the shards")
        else:
            p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json to measure (default: the "
                                                                        "prepared one for --config and --corpus)")
        C.add_config_flags(p, ("data",))
    args = parser.parse_args(argv)
    try:
        overrides = C.flag_overrides(args)
        if args.vocab_size is not None:
            overrides["model__vocab_size"] = args.vocab_size
        cfg = C.load_config(args.config, **overrides)
        folder = data_dir(cfg.data, cfg.model.vocab_size)
        if args.command == "prepare":
            prepare(cfg.data, cfg.model.vocab_size, rebuild=args.rebuild)
        else:
            path = args.tokenizer or folder / "tokenizer.json"
            tok, docs = tk.load_tokenizer(path), tk.held_out(cfg.data.corpus, cfg.data.text_field, cfg.data.val_fraction)
            print(json.dumps({"tokenizer": str(path), "vocab": tok.get_vocab_size(), "documents": len(docs),
                              "bytes_per_token": round(tk.bytes_per_token(tok, docs), 3)}))
    except (tk.CorpusError, ShardError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        sys.exit(f"error: {e.filename or 'the data cache'}: {e.strerror or e}: "
                 f"{'free some space, or give --cache-dir on another disk' if full else 'check the path and its permissions'}")
    except KeyboardInterrupt:  # nothing half-written is trusted: shards and the manifest are renamed into place
        kept = "no finished file was written"
        if args.command == "prepare" and "folder" in locals() and (folder / "tokenizer.json").is_file():
            kept = f"the finished {folder / 'tokenizer.json'} is kept"
        print(f"SIGINT: stopped; {kept}, and the next prepare redoes the rest", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
