import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import attention as A
import data as D
import model as M
import tokenizer as tk
from conftest import VOCAB, tiny_model_cfg


@pytest.fixture(scope="module")
def tok(data_cfg):
    return tk.load_tokenizer(D.data_dir(data_cfg, VOCAB) / "tokenizer.json")


@pytest.fixture(scope="module")
def shards(data_cfg):
    folder = D.data_dir(data_cfg, VOCAB)
    return D.shard_files(folder, "train"), tk.tokenizer_hash(folder / "tokenizer.json")


# --- Tokenizer -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "plain ascii", "emoji 🧪🚀 and flags 🇳🇱", "中文字符と日本語のかな",
                                  "combining e\u0301 a\u0308 \u0915\u094d\u0937", "ctrl \x00\x01\x1b[0m\x7f",
                                  "runs of   \t\t\n\n\n    whitespace\r\n", "<|endoftext|> literal"])
def test_round_trip_examples(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1))
@example(f"a {tk.EOT} b")  # the EOT's text inside a document: text, with its 13 bytes
def test_token_byte_lengths_count_the_decoded_bytes(tok, text):
    lengths = tk.token_byte_lengths(tok)
    ids = tok.encode(text).ids
    assert sum(lengths[i] for i in ids) == len(text.encode("utf-8"))


def test_prefix_ids_name_each_tokens_longest_proper_prefix_in_the_vocabulary(tok):
    vocab = {t: i for t, i in tok.get_vocab().items() if t != tk.EOT}
    table = tk.prefix_ids(tok)
    for token, i in vocab.items():  # probing every shorter length, longest first
        found = next((vocab[token[:n]] for n in range(len(token) - 1, 0, -1) if token[:n] in vocab), -1)
        assert table[i] == found, token
    # every byte is a token, so every longer token has a prefix; a byte and the EOT have none
    assert table[tok.token_to_id(tk.EOT)] == -1 and sum(t >= 0 for t in table) == sum(len(t) > 1 for t in vocab)


def test_literal_eot_in_a_text_is_text_not_the_eot_token(tok):
    text = f"a {tk.EOT} b"
    ids = tok.encode(text).ids
    assert tok.token_to_id(tk.EOT) not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text  # no special token to skip


def test_tokenizer_file_is_standard(data_cfg):
    from tokenizers import Tokenizer
    path = D.data_dir(data_cfg, VOCAB) / "tokenizer.json"
    plain = Tokenizer.from_file(str(path))
    assert plain.get_vocab_size() == VOCAB and plain.token_to_id(tk.EOT) == 0
    assert json.loads(path.read_text())["model"]["type"] == "BPE"


def test_stats_prints_bytes_per_token(data_cfg, capsys):
    D.main(["stats", "--tokenizer", str(D.data_dir(data_cfg, VOCAB) / "tokenizer.json"),
            "--corpus", data_cfg.corpus, "--val-fraction", "0.1"])
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 6 and stats["bytes_per_token"] > 1.5  # BPE merges: more than a byte a token


def test_vocab_over_uint16_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"vocab size 70000 must be between 257 .* and 65,536 \(token ids are stored as uint16\)"):
        tk.train_tokenizer(iter(["text"]), 70_000, tmp_path)
    with pytest.raises(ValueError, match="must be between 257 and 65,536"):
        D.data_dir(D.DataConfig(), 70_000)
    with pytest.raises(ValueError, match="does not fit uint16"):
        D.write_shard(tmp_path / "x.bin", np.zeros(3, D.TOKEN_DTYPE), np.zeros(1, np.uint64), 70_000, "0" * 16, 3)


def test_ctrl_c_during_tokenizer_training_stops_it_within_a_second(tmp_path):
    """The BPE merges run in Rust for seconds after the last document is read: a Ctrl-C 0.3 s after
    that raises KeyboardInterrupt within a second, stops the worker and writes no tokenizer."""
    import os
    import random
    import signal
    import threading
    import time
    rng = random.Random(0)
    syllables = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    sent = {}

    def docs():  # about 3 MB of made-up words: seconds of merging on a CPU
        for _ in range(1500):
            yield " ".join(rng.choice(syllables) + rng.choice(syllables) for _ in range(300))
        sent["at"] = time.monotonic() + 0.3
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        tk.train_tokenizer(docs(), 16384, tmp_path, show_progress=False)
    assert time.monotonic() - sent["at"] < 1.0
    assert not (tmp_path / "tokenizer.json").exists()


def test_a_prepare_that_fails_after_its_tokenizer_keeps_the_tokenizer(tmp_path, monkeypatch):
    """The shard pass fails (a stream that breaks for good): the BPE trained before it is kept, no
    shard is, and the next prepare reuses that tokenizer."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"d{i}.txt").write_text(f"document {i} " + "words and more words " * 40)
    cfg = D.DataConfig(corpus=str(corpus / "*.txt"), cache_dir=str(tmp_path / "cache"))
    real = D.tk.documents
    monkeypatch.setattr(D.tk, "documents", lambda *a, **k: (_ for _ in ()).throw(D.tk.CorpusError("stream broke")))
    monkeypatch.setattr(D.tk, "train_documents", lambda *a, **k: real(cfg.corpus))
    with pytest.raises(D.tk.CorpusError, match="stream broke"):
        D.prepare(cfg, VOCAB, log=lambda *a: None)
    folder = D.data_dir(cfg, VOCAB)
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer.trained.json"]
    monkeypatch.setattr(D.tk, "documents", real)
    said = []
    D.prepare(cfg, VOCAB, log=said.append)
    assert said[0] == f"tokenizer: reusing {folder / 'tokenizer.json'}"


def test_a_prepare_that_broke_part_way_goes_on_to_the_shards_of_an_unbroken_one(tmp_path, monkeypatch):
    """A local .jsonl corpus read through `datasets`, whose stream breaks after 60% of its documents:
    the tokenizer and the train shards written so far are kept, and the next prepare goes on from the
    last of them to shards byte for byte those of a prepare that never broke."""
    corpus = tmp_path / "c.jsonl"
    rng = np.random.default_rng(3)
    words = ["".join(rng.choice(list("abcdefgh"), rng.integers(2, 7))) for _ in range(200)]
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 120))}) + "\n" for _ in range(200)))
    cfgs = [D.DataConfig(corpus=str(corpus), shard_tokens=4000, val_fraction=0.1, cache_dir=str(tmp_path / name))
            for name in ("whole", "broken")]
    D.prepare(cfgs[0], VOCAB, log=lambda *a: None)
    real, calls = D.tk.documents, []

    def breaks(*a, **k):  # the tokenizer's read (the first) goes through; the shards' read breaks
        calls.append(1)
        for i, doc in enumerate(real(*a, **k)):
            if len(calls) > 1 and i == 120:
                raise D.tk.CorpusError("could not stream: the connection dropped")
            yield doc
    monkeypatch.setattr(D.tk, "documents", breaks)
    monkeypatch.setattr(D, "BATCH_BYTES", 2000)  # a few documents per batch, so shards are written before the break
    with pytest.raises(D.tk.CorpusError, match="connection dropped"):
        D.prepare(cfgs[1], VOCAB, log=lambda *a: None)
    folder = D.data_dir(cfgs[1], VOCAB)
    kept = sorted(p.name for p in folder.iterdir())
    assert "tokenizer.json" in kept and "progress.json" in kept and "train_00000.bin" in kept
    monkeypatch.setattr(D.tk, "documents", real)
    said = []
    D.prepare(cfgs[1], VOCAB, log=said.append)
    assert any(line.startswith("shards: going on from document ") for line in said)
    whole = D.data_dir(cfgs[0], VOCAB)
    names = sorted(p.name for p in whole.glob("*.bin"))
    assert len(names) > 4 and names == sorted(p.name for p in folder.glob("*.bin"))
    assert all((whole / n).read_bytes() == (folder / n).read_bytes() for n in names)
    assert not (folder / "progress.json").exists() and not list(folder.glob("val.pending.*"))


class BreakingStream:
    """A datasets streaming dataset of 10 records whose connection drops after `drop_at` of them, the
    first `drops` times it is opened."""
    opened = 0

    def __init__(self, drops: int, drop_at: int = 4, start: int = 0):
        self.drops, self.drop_at, self.start = drops, drop_at, start

    def skip(self, n):
        return BreakingStream(self.drops, self.drop_at, self.start + n)

    def __iter__(self):
        BreakingStream.opened += 1
        for i in range(self.start, 10):
            if BreakingStream.opened <= self.drops and i == self.drop_at:
                raise ConnectionError("Connection reset by peer")
            yield {"text": f"story {i}"}


@pytest.mark.parametrize("drops", [2, 9])
def test_a_broken_hub_stream_goes_on_from_its_record_or_gives_up_in_one_line(monkeypatch, drops):
    import datasets
    BreakingStream.opened = 0
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: BreakingStream(drops))
    monkeypatch.setattr(tk, "hub_reachable", lambda: True)
    monkeypatch.setattr(tk.time, "sleep", lambda s: None)
    said = []
    if drops > len(tk.HUB_RETRY_WAITS):
        with pytest.raises(tk.CorpusError, match=r"could not stream .* after 5 retries \(ConnectionError: Connection"):
            list(tk.hub_documents("tinystories", warn=said.append))
        return
    assert list(tk.hub_documents("tinystories", warn=said.append)) == [f"story {i}" for i in range(10)]
    assert said[0].startswith("hub: roneneldan/TinyStories broke after 4 records (ConnectionError: Connection reset")
    assert said[1].endswith("retry 2 of 5 in 4 s") and len(said) == 2


def test_a_corpus_path_gets_a_visible_cache_folder(tmp_path):
    """A relative path or glob names its cache folder without the leading dots that would hide it."""
    assert D.data_dir(D.DataConfig(corpus="../mycode/*.py", cache_dir=str(tmp_path)), VOCAB).name == f"mycode_.py-{VOCAB}"
    assert D.data_dir(D.DataConfig(corpus="fineweb-edu", cache_dir=str(tmp_path)), VOCAB).name == f"fineweb-edu-{VOCAB}"


# --- Corpora through `datasets` ------------------------------------------------------------

def test_local_jsonl_and_parquet_go_through_datasets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [f"story number {i}: once upon a time" for i in range(5)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)))
    pq.write_table(pa.table({"body": docs}), tmp_path / "a.parquet")
    assert list(tk.documents(str(tmp_path / "a.jsonl"), "body")) == docs
    assert list(tk.documents(str(tmp_path / "*.parquet"), "body")) == docs


def test_missing_text_field_names_file_and_field(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(tk.CorpusError, match=r"a\.jsonl.*no text field 'text'.*\['content'\]"):
        list(tk.documents(str(tmp_path / "a.jsonl")))


def test_empty_corpus_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(tk.CorpusError, match=r"empty\.jsonl' has no documents"):
        list(tk.documents(str(tmp_path / "empty.jsonl")))
    with pytest.raises(tk.CorpusError, match="no such file"):
        list(tk.documents(str(tmp_path / "nothing*.txt")))


def test_unreachable_hub_fails_at_once_with_one_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what a machine without network sees, without waiting
    start = time.perf_counter()
    with pytest.raises(tk.CorpusError, match=r"streams roneneldan/TinyStories from the HuggingFace hub, which cannot "
                                             r"be reached .* --corpus '/path/to/files/\*\.parquet'"):
        next(tk.documents("tinystories"))
    assert time.perf_counter() - start < 1.0


def test_bad_records_and_bad_bytes_are_counted_and_named(tmp_path):
    records = [{"text": f"doc {i}"} for i in range(41)]
    records[24] = {"content": "the text is in another field"}  # record 25 lacks 'text' (datasets fills None)
    records[30] = {"text": ""}
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    said = []
    assert len(list(tk.documents(str(tmp_path / "a.jsonl"), warn=said.append))) == 39
    assert said == [f"warning: {tmp_path / 'a.jsonl'}: skipped 2 of 41 records without text in 'text': "
                    f"record 25 (no 'text'), record 31 (empty)"]
    (tmp_path / "empty.jsonl").write_text("")
    said.clear()
    with pytest.raises(tk.CorpusError, match="has no documents"):
        list(tk.documents(str(tmp_path / "empty.jsonl"), warn=said.append))
    assert said == [f"warning: {tmp_path / 'empty.jsonl'} is empty: skipped"]
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 au lait")
    said.clear()
    assert list(tk.documents(str(tmp_path / "b.txt"), warn=said.append)) == ["caf\ufffd au lait"]
    assert said == [f"warning: {tmp_path / 'b.txt'} is not valid UTF-8 (byte 3): its undecodable bytes became U+FFFD"]


def small_corpus(tmp_path) -> D.DataConfig:
    """30 .txt documents in tmp_path/corpus and a cache of their own: for tests that change them."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"d{i}.txt").write_text(f"document {i} " + "words and more words " * 40)
    return D.DataConfig(corpus=str(corpus / "*.txt"), cache_dir=str(tmp_path / "cache"), val_fraction=0.1)


def test_prepare_notices_a_changed_corpus(tmp_path):
    cfg = small_corpus(tmp_path)
    corpus = tmp_path / "corpus"
    D.prepare(cfg, 300, log=lambda *a: None)
    (corpus / "new.txt").write_text("a new document " * 50)
    folder = D.data_dir(cfg, 300)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ValueError, match=r"changed since .* was prepared .*data\.py prepare --corpus '.*\*\.txt' --vocab-size \d+ --rebuild"):
        D.prepare(cfg, 300, log=lambda *a: None)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the refusal wrote nothing
    D.prepare(cfg, 300, log=lambda *a: None, rebuild=True)
    assert json.loads((D.data_dir(cfg, 300) / "manifest.json").read_text())["documents"] == 31


def test_a_corrupt_shard_is_rewritten_by_prepare(tmp_path):
    cfg = small_corpus(tmp_path)
    folder = D.prepare(cfg, 300, log=lambda *a: None)
    shard = folder / "train_00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(good[:-100])  # truncated: the loader refuses it and says to rerun prepare
    with pytest.raises(D.ShardError, match="truncated or corrupted, rerun prepare"):
        D.ShardLoader([shard], 2, 16)
    said = []
    D.prepare(cfg, 300, log=said.append)
    assert any("failed their checks" in s for s in said) and shard.read_bytes() == good


def test_an_unreadable_manifest_is_said_and_the_shards_rewritten(tmp_path):
    cfg = small_corpus(tmp_path)
    folder = D.prepare(cfg, 300, log=lambda *a: None)
    (folder / "manifest.json").write_text('{"train": ["train_0')  # cut short mid-write
    with pytest.raises(FileNotFoundError, match=r"manifest\.json missing or unreadable\): run `python data\.py prepare"):
        D.shard_files(folder, "train")
    said = []
    D.prepare(cfg, 300, log=said.append)
    assert any("manifest.json is unreadable or incomplete: writing the shards again" in s for s in said)
    assert D.shard_files(folder, "train")


def test_a_document_limit_the_stdlib_never_reaches_shares_the_folder():
    assert D.data_dir(D.DataConfig(corpus="stdlib", max_documents=1_800_000), 32768) == \
        D.data_dir(D.DataConfig(corpus="stdlib"), 32768)
    assert D.data_dir(D.DataConfig(corpus="stdlib", max_documents=10), 32768).name == "stdlib-32768-10docs"


def test_stdlib_corpus_is_the_standard_library():
    files = tk.stdlib_files()
    assert any(f.name == "tokenize.py" for f in files) and len(files) > 500
    assert not any("site-packages" in f.parts for f in files)


# --- Shards --------------------------------------------------------------------------------

def test_shards_hold_every_document_with_eot(data_cfg, tok, shards):
    files, tok_hash = shards
    folder = D.data_dir(data_cfg, VOCAB)
    manifest = json.loads((folder / "manifest.json").read_text())
    docs = list(tk.documents(data_cfg.corpus))
    val = [d for i, d in enumerate(docs) if tk.is_val(i, data_cfg.val_fraction)]
    assert manifest["documents"] == 60 and len(val) == 6
    info = D.read_header(folder / manifest["val"][0], VOCAB, tok_hash)
    tokens, starts = D.open_shard(info)
    assert info.n_docs == 6 and info.n_bytes == sum(len(d.encode()) for d in val)
    bounds = list(starts) + [info.n_tokens]
    for d, (a, b) in zip(val, zip(bounds, bounds[1:])):
        assert tokens[b - 1] == 0  # end-of-text closes each document
        assert tok.decode(tokens[a:b - 1].tolist()) == d


def test_shard_from_other_tokenizer_or_vocab_is_refused(shards):
    files, tok_hash = shards
    with pytest.raises(D.ShardError, match=r"written for a vocabulary of 512 tokens, but the model expects 4,096"):
        D.ShardLoader(files, 2, 16, vocab_size=4096)
    with pytest.raises(D.ShardError, match=rf"written with tokenizer {tok_hash}, but this run uses tokenizer deadbeef"):
        D.ShardLoader(files, 2, 16, tokenizer_hash="deadbeef00000000")


def test_truncated_or_foreign_file_is_refused(shards, tmp_path):
    raw = shards[0][0].read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(raw[:-10])
    with pytest.raises(D.ShardError, match=r"cut\.bin: file is .* bytes but its header .* needs .*truncated"):
        D.read_header(cut)
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"GARBAGE!" + raw[8:])
    with pytest.raises(D.ShardError, match=r"foreign\.bin: not a onegpu shard"):
        D.read_header(foreign)


def test_a_token_id_beyond_the_vocabulary_in_a_shards_body_is_refused_at_open(shards, tmp_path):
    """The header intact, one token in the body past the vocabulary (a damaged file): the loader refuses it when
    it opens the shard, naming the file and the token, before any step would index past the embedding."""
    info = D.read_header(shards[0][0])
    tokens, starts = D.open_shard(info)
    bad = np.array(tokens)
    bad[123] = info.vocab_size + 7
    path = tmp_path / "bad.bin"
    D.write_shard(path, bad, starts.astype(np.uint64), info.vocab_size, info.tokenizer_hash, info.n_bytes)
    with pytest.raises(D.ShardError, match=rf"bad\.bin: token id {info.vocab_size + 7} \(first bad one at token 123\) "
                                           rf"is beyond the {info.vocab_size}-token vocabulary"):
        D.ShardLoader([path], 2, 16)
    D.ShardLoader([shards[0][0]], 2, 16)  # its intact twin opens


def test_interrupted_prepare_leaves_nothing_that_loads(corpus_dir, tmp_path, monkeypatch):
    cfg = D.DataConfig(corpus=str(corpus_dir / "*.txt"), val_fraction=0.1, cache_dir=str(tmp_path))

    def crash(fd):
        raise OSError("disk vanished")

    monkeypatch.setattr(D.os, "fsync", crash)
    with pytest.raises(OSError):
        D.prepare(cfg, VOCAB, log=lambda *a: None)
    folder = D.data_dir(cfg, VOCAB)
    assert not list(folder.glob("*.bin"))  # only a .tmp, which no reader opens
    with pytest.raises(FileNotFoundError, match="no finished shards"):
        D.shard_files(folder, "train")
    monkeypatch.undo()
    D.prepare(cfg, VOCAB, log=lambda *a: None)  # rerunning finishes the job
    assert D.ShardLoader(D.shard_files(folder, "train"), 2, 16, vocab_size=VOCAB).next_batch()[0].shape == (2, 16)


# --- Loader --------------------------------------------------------------------------------

def test_batches_are_shifted_windows(shards):
    loader = D.ShardLoader(shards[0], 4, 32)
    x, y = loader.next_batch()
    assert x.dtype == torch.int64 and x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_epoch_visits_every_window_once(shards, tmp_path):
    loader = D.ShardLoader(shards[0], 3, 32, seed=5)
    seen = np.concatenate([loader.next_windows() for _ in range(len(loader))])
    assert len(set(seen.tolist())) == len(seen) == 3 * len(loader)
    assert loader.epoch == 0 and loader.next_windows() is not None and loader.epoch == 1
    D.write_shard(tmp_path / "train_00000.bin", np.arange(6 * 32 + 1, dtype=np.uint16), np.zeros(1, np.uint64), 1000,
                  "0" * 16, 1)  # six windows: two micro-batches of 3 end the epoch exactly, the last one included
    exact = D.ShardLoader([tmp_path / "train_00000.bin"], 3, 32, seed=5)
    assert sorted(np.concatenate([exact.next_windows() for _ in range(2)]).tolist()) == list(range(6))
    assert exact.epoch == 0


def test_resume_gives_exactly_the_next_batches(shards):
    a = D.ShardLoader(shards[0], 4, 32, seed=7)
    for _ in range(len(a) - 2):  # stop near the end of an epoch so the resume crosses it
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(5)]
    b = D.ShardLoader(shards[0], 4, 32, seed=7)
    b.load_state_dict(state)
    for want, got in zip(expected, (b.next_batch() for _ in range(5))):
        assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_a_batch_drawn_ahead_is_the_next_and_the_cursor_stands_before_it(shards):
    """prefetch() draws the next micro-batch early (train_step, while the GPU runs the last backward); it is
    the one next_batch() hands out, and a checkpoint taken between the two resumes with it, across an epoch's
    end as well. Rewinding or loading a state drops it."""
    plain, ahead = (D.ShardLoader(shards[0], 4, 32, seed=7, doc_ids=True) for _ in range(2))
    for _ in range(len(plain) - 1):  # the batch drawn ahead is the epoch's last: the next one crosses into epoch 1
        plain.next_batch(), ahead.next_batch()
    state = plain.state_dict()
    ahead.prefetch()
    ahead.prefetch()  # a second call draws nothing more
    assert ahead.state_dict() == state
    resumed = D.ShardLoader(shards[0], 4, 32, seed=7, doc_ids=True)
    resumed.load_state_dict(ahead.state_dict())
    for _ in range(3):
        want = plain.next_batch()
        for got in (ahead.next_batch(), resumed.next_batch()):
            assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert ahead.state_dict() == plain.state_dict()
    ahead.prefetch()
    ahead.rewind()
    first = D.ShardLoader(shards[0], 4, 32, seed=7, doc_ids=True).next_batch()
    assert all(torch.equal(w, g) for w, g in zip(ahead.next_batch(), first))
    ahead.prefetch()
    ahead.load_state_dict(plain.state_dict())
    assert all(torch.equal(w, g) for w, g in zip(ahead.next_batch(), plain.next_batch()))
    pageable = D.ShardLoader(shards[0], 4, 32, device="cuda", pin=False)  # built without touching a GPU
    pageable.prefetch()  # its copy would wait for the GPU mid-step: it draws when asked instead
    assert pageable.pos == 0


def test_ranks_read_disjoint_slices(shards):
    one = D.ShardLoader(shards[0], 2, 32, seed=3)
    r0, r1 = (D.ShardLoader(shards[0], 2, 32, seed=3, rank=r, world=2) for r in (0, 1))
    w0 = np.concatenate([r0.next_windows() for _ in range(len(r0))])
    w1 = np.concatenate([r1.next_windows() for _ in range(len(r1))])
    assert not set(w0) & set(w1)
    assert set(w0) | set(w1) == set(np.concatenate([one.next_windows() for _ in range(2 * len(r0))]))


@pytest.mark.parametrize("world", [1, 2])
def test_whole_windows_score_each_plain_target_once_with_a_window_before_it(shards, world):
    """A loader whose windows start every T - W tokens scores, over batches_covering(n) batches, each target
    of the first n plain windows once, and each of them but a shard's first T has W tokens of x before it."""
    T, W, B, n = 32, 12, 3, 7
    files = shards[0][:1]
    plain = D.ShardLoader(files, B, T, shuffle=False)
    assert plain.stride == T and len(plain) == len(D.ShardLoader(files, B, T, shuffle=False, stride=T))
    want = {w * T + j for w in range(n) for j in range(T)}  # y's offsets, minus one, of the plain windows
    seen = []
    for rank in range(world):
        whole = D.ShardLoader(files, B, T, shuffle=False, stride=T - W, rank=rank, world=world)
        for _ in range(whole.batches_covering(n)):
            x, y = whole.next_batch()
            keep = whole.scored_targets(n).numpy()
            shard, starts = whole.last_starts
            for row, start in enumerate(starts):
                tokens = whole.shards[shard[row]][0]
                assert torch.equal(y[row], torch.from_numpy(tokens[start + 1:start + T + 1].astype(np.int64)))
                for j in np.flatnonzero(keep[row]):
                    seen.append(start + j)
                    assert start == 0 or j >= W  # W tokens of this window before the target
    assert sorted(seen) == sorted(want)


def test_whole_windows_leave_a_shards_tail_unscored_as_plain_windows_do(tmp_path):
    """A shard's last tokens past its last whole plain window are never a plain target. A strided window
    can reach them (here shard 0's window at 140 holds targets 141..172, past 160): they stay unscored,
    and the next shard's plain targets are scored from its start."""
    T, W, B = 32, 12, 2
    files = []
    for i in range(2):  # 5 plain windows of T + 1 and 26 tokens more, each shard
        files.append(tmp_path / f"val_{i:05d}.bin")
        D.write_shard(files[-1], np.arange(5 * T + 27, dtype=np.uint16), np.zeros(1, np.uint64), 1000, "0" * 16, 1)
    n = 7  # shard 0's five plain windows and shard 1's first two
    whole = D.ShardLoader(files, B, T, shuffle=False, stride=T - W)
    seen = set()
    for _ in range(whole.batches_covering(n)):
        whole.next_batch()
        shard, starts = whole.last_starts
        for row, keep in enumerate(whole.scored_targets(n).numpy()):
            seen |= {(int(shard[row]), int(starts[row]) + int(j)) for j in np.flatnonzero(keep)}
    assert seen == {(0, o) for o in range(5 * T)} | {(1, o) for o in range(2 * T)}


def test_a_stride_outside_the_window_is_refused(shards):
    with pytest.raises(ValueError, match="stride=40 must lie in 1..seq_len=32"):
        D.ShardLoader(shards[0], 2, 32, stride=40)


def test_doc_ids_follow_the_document_index(shards):
    loader = D.ShardLoader(shards[0], 4, 64, doc_ids=True, shuffle=False)
    tokens, starts = loader.shards[0]
    crossings = 0
    for batch in range(len(loader)):
        x, y, doc = loader.next_batch()
        for row in range(4):
            pos = (batch * 4 + row) * 64 + np.arange(64)
            expected = np.searchsorted(starts, pos, side="right") - 1
            assert doc[row].tolist() == (expected - expected[0]).tolist()
            crossings += int(doc[row].max())
    assert crossings > 0  # some windows do cross documents


# --- Document masking ----------------------------------------------------------------------

def test_doc_mask_is_block_diagonal_and_causal():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2]])
    mask = A.doc_mask(doc)[0]
    blocks = torch.block_diag(torch.ones(3, 3), torch.ones(2, 2), torch.ones(1, 1)).bool()
    assert torch.equal(mask, blocks & torch.ones(6, 6, dtype=torch.bool).tril())


def test_doc_mask_stops_attention_across_documents():
    """The check the "Making it fast" lesson suggests: document A ends with a distinctive token and B continues it. With the
    mask, B's logits do not depend on A; without it, they do."""
    torch.manual_seed(0)
    model = M.Llama(tiny_model_cfg()).double().eval()
    a = torch.randint(1, VOCAB, (10,))
    a[-1] = 7  # A's distinctive last token
    b = torch.randint(1, VOCAB, (12,))
    changed_a = a.clone()
    changed_a[:-1] = (changed_a[:-1] + 5) % VOCAB
    doc = torch.tensor([[0] * 10 + [1] * 12])
    with torch.no_grad():
        masked = [model(torch.cat([x, b])[None], masks=A.masks(doc.shape[1], doc.device, doc))[0, 10:] for x in (a, changed_a)]
        unmasked = [model(torch.cat([x, b])[None])[0, 10:] for x in (a, changed_a)]
    assert torch.equal(masked[0], masked[1])
    assert not torch.allclose(unmasked[0], unmasked[1])
    # B's logits under the mask equal B alone, as if it were the only document.
    torch.testing.assert_close(masked[0], model(b[None])[0], rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's block mask needs CUDA")
def test_flex_attention_matches_boolean_mask_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 256, 64, device="cuda", generator=g)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", generator=g) for _ in range(2))
    doc = torch.cumsum(torch.rand(2, 256, device="cuda", generator=g) < 0.02, dim=1).int()
    flex = M.attention(q, k, v, block_mask=M.mask_inputs(256, q.device, doc)["block_mask"])
    torch.testing.assert_close(flex, M.attention(q, k, v, doc_ids=doc), rtol=2e-3, atol=2e-3)


def test_cuda_copy_options_are_off_on_cpu(shards):
    loader = D.ShardLoader(shards[0], 2, 16, pin=True)
    assert not loader.pin and loader.next_batch()[0].device.type == "cpu"


def test_every_batch_tensor_is_contiguous(shards):
    """A strided tensor reaches a GPU through a contiguous copy PyTorch makes in pageable memory, which waits for
    the GPU's queue whatever `pin` did: x, y and the document ids must each be contiguous on the host already
    (tests/test_gpu.py checks the copies' kind on a GPU)."""
    loader = D.ShardLoader(shards[0], 3, 16, doc_ids=True)
    assert all(t.is_contiguous() for t in loader.next_batch())


# --- The python corpus and local files of any extension ------------------------------------

@pytest.fixture
def python_tree(tmp_path, monkeypatch):
    """A fake installation: 30 modules, two vendored copies of one of them, and an empty file."""
    root = tmp_path / "site"
    for i in range(30):
        (root / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 3}" / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n" * 20)
    for vendor in ("a", "b"):
        (root / vendor / "_vendor").mkdir(parents=True)
        (root / vendor / "_vendor" / "six.py").write_text((root / "pkg0" / "m0.py").read_text())
    (root / "empty.pyi").write_text("  \n")
    files = tuple(sorted(p for p in root.rglob("*") if p.is_file()))
    monkeypatch.setattr(tk, "python_files", lambda: files)
    return root, files


def test_python_corpus_is_distinct_texts_in_content_order(python_tree, monkeypatch):
    root, files = python_tree
    said = []
    docs = list(tk.python_documents(warn=said.append))
    assert len(docs) == 30 and len(set(docs)) == 30  # the vendored copies and the empty file are gone
    assert said == ["python corpus: 33 files, 30 distinct non-empty texts (3 duplicates or empty skipped)"]
    monkeypatch.setattr(tk, "python_files", lambda: tuple(reversed(files)))  # another machine's file order
    assert list(tk.python_documents(warn=said.append)) == docs


def test_ctrl_c_while_reading_the_python_corpus_leaves_without_reading_the_rest(monkeypatch):
    """A Ctrl-C while the python corpus is read (3,000 files of 50 ms each here: a minute and more on two cores)
    leaves at once, with none of the reads still to do holding the process."""
    import hashlib
    files = tuple(Path(f"/nowhere/m{i}.py") for i in range(3000))
    monkeypatch.setattr(tk, "python_files", lambda: files)
    monkeypatch.setattr(Path, "read_bytes", lambda path: time.sleep(0.05) or path.name.encode())
    seen, real = [], hashlib.sha256

    def sha256(data):  # the consumer's work on each file read: the Ctrl-C lands there on the tenth
        seen.append(1)
        if len(seen) == 10:
            raise KeyboardInterrupt
        return real(data)
    monkeypatch.setattr(tk.hashlib, "sha256", sha256)
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        list(tk.python_documents(warn=lambda *a: None))
    assert time.perf_counter() - start < 3


def test_python_split_is_by_text_so_a_new_file_moves_no_other(python_tree):
    root, files = python_tree
    val = set(tk.held_out("python", "text", 0.3, n=100))
    assert 0 < len(val) < 30 and not val & set(tk.train_documents("python", "text", 0.3, warn=lambda s: None))
    assert all(tk.is_val(0, 0.3, d) for d in val) and all(tk.is_val(12345, 0.3, d) for d in val)


def test_python_corpus_prepares_with_a_fingerprint(python_tree, tmp_path):
    root, files = python_tree
    cfg = D.DataConfig(corpus="python", cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    folder = D.prepare(cfg, 300, log=lambda *a: None)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["documents"] == 30 and manifest["source"]["files"] == 33 and "listing_sha256" in manifest["source"]
    (root / "pkg1" / "m1.py").write_text("changed = True\n")  # an upgraded package: the prepared data is stale
    assert tk.source_fingerprint("python") != manifest["source"]


def test_a_corpus_that_holds_out_no_document_says_which_setting_to_raise(python_tree, tmp_path):
    """The python corpus holds a file out by its text's hash, so a small share of few files can hold out none:
    training would then have nothing to evaluate on."""
    cfg = D.DataConfig(corpus="python", cache_dir=str(tmp_path / "cache"), val_fraction=1e-9)
    with pytest.raises(ValueError, match=r"corpus 'python': none of its 30 documents went to validation at "
                                         r"data.val_fraction=1e-09; raise data.val_fraction \(--val-fraction\)"):
        D.prepare(cfg, 300, log=lambda *a: None)


def test_local_files_of_any_extension_through_a_recursive_glob(tmp_path):
    (tmp_path / "src" / "deep").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("import os\n")
    (tmp_path / "src" / "deep" / "b.py").write_text("print(1)\n")
    (tmp_path / "src" / "deep" / "c.md").write_text("# notes\n")
    assert sorted(tk.documents(str(tmp_path / "src" / "**" / "*.py"))) == ["import os\n", "print(1)\n"]
    (tmp_path / "src" / "d.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(tk.CorpusError, match=r"record files \(\.jsonl, \.parquet\) and text files cannot mix"):
        list(tk.documents(str(tmp_path / "src" / "*")))


def test_a_refused_tokenizer_leaves_every_file_as_it_was(tmp_path):
    cfg = small_corpus(tmp_path)
    folder = D.prepare(cfg, 300, log=lambda *a: None)
    (folder / "tokenizer.json").write_text('{"truncated": ')
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a readable tokenizer\.json"):
        D.prepare(cfg, 300, log=lambda *a: None)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_both(tmp_path):
    cfg = small_corpus(tmp_path)
    small = D.prepare(cfg, 300, log=lambda *a: None)
    other = D.data_dir(cfg, 400)
    other.mkdir()
    (other / "tokenizer.json").write_bytes((small / "tokenizer.json").read_bytes())  # copied in by hand
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(ValueError, match=r"tokenizer\.json has 300 tokens, but model\.vocab_size is 400: pass "
                                         r"--vocab-size 300 to use this tokenizer, or delete .* to train a 400-token one"):
        D.prepare(cfg, 400, log=lambda *a: None)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


def test_a_small_corpus_tokenizer_trained_here_may_come_out_smaller(tmp_path):
    cfg = small_corpus(tmp_path)
    said = []
    folder = D.prepare(cfg, 60_000, log=said.append)  # far more tokens than 30 short documents support
    n = tk.load_tokenizer(folder / "tokenizer.json").get_vocab_size()
    assert n < 60_000 and any(f"only supports {n:,} of the 60,000 tokens" in line for line in said)
    assert D.read_header(D.shard_files(folder, "train")[0]).vocab_size == 60_000


def test_ctrl_c_in_prepare_says_only_what_is_true(tmp_path, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "prepare", interrupted)
    with pytest.raises(SystemExit) as stop:
        D.main(["prepare", "--cache-dir", str(tmp_path)])
    assert stop.value.code == 130 and "SIGINT: stopped; no finished file was written" in capsys.readouterr().err
    folder = D.data_dir(D.DataConfig(cache_dir=str(tmp_path)), 4096)
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit):
        D.main(["prepare", "--cache-dir", str(tmp_path)])
    assert f"the finished {folder / 'tokenizer.json'} is kept" in capsys.readouterr().err


def test_a_full_disk_while_prepare_writes_a_shard_names_it_in_one_line(corpus_dir, tmp_path, monkeypatch):
    """A full disk raises an OSError that names no file ("error: : File too large" once): prepare names the
    shard it was writing, says to free space, and leaves no partial shard."""
    import errno
    real_open = open

    def full_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if str(path).endswith(".bin.tmp"):
            def write(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = write
        return f
    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(SystemExit) as e:
        D.main(["prepare", "--corpus", str(corpus_dir / "*.txt"), "--vocab-size", "512", "--cache-dir", str(tmp_path)])
    message = str(e.value.code)
    assert re.match(r"error: .*\.bin: No space left on device: free some space, or give --cache-dir on another disk$",
                    message), message
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_parallel_reader_reads_every_file_and_holds_no_thread_at_exit(corpus_dir, tmp_path):
    """The python corpus's reader: every file's bytes once, a failed read raised in the consumer, and only daemon
    threads, so a Ctrl-C part-way through never leaves the process waiting at its exit for a pool."""
    import threading
    files = sorted(corpus_dir.glob("*.txt"))
    assert sorted(tk.read_in_parallel(files, workers=3)) == sorted(f.read_bytes() for f in files)
    stopped = tk.read_in_parallel(files, workers=3)
    next(stopped)  # a consumer that stops early (as Ctrl-C stops it)
    assert all(t.daemon for t in threading.enumerate() if t is not threading.main_thread())
    with pytest.raises(FileNotFoundError):
        list(tk.read_in_parallel(files[:2] + [tmp_path / "gone.txt"], workers=2))


def test_the_tokenizers_worker_ignores_ctrl_c_which_its_parent_handles(tmp_path, monkeypatch):
    """A terminal's Ctrl-C reaches the tokenizer's worker process too: it ignores SIGINT (its kernel-side mask,
    /proc/PID/status), so the parent, which stops it, is the only one to say anything; the worker printed its own
    KeyboardInterrupt traceback before."""
    import subprocess
    if not Path("/proc/self/status").exists():
        pytest.skip("reads the worker's signal mask from /proc (Linux)")
    children, real = [], subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: children.append(real(*a, **k)) or children[-1])
    ignored = []

    def docs():
        yield "some text to learn merges from " * 50
        for _ in range(500):  # the worker's interpreter starts, then sets its handler
            mask = next(line for line in Path(f"/proc/{children[0].pid}/status").read_text().splitlines()
                        if line.startswith("SigIgn:"))
            if int(mask.split()[1], 16) & (1 << (2 - 1)):  # SIGINT is signal 2: bit 1
                ignored.append(True)
                break
            time.sleep(0.01)
        yield "more text " * 50
    tk.train_tokenizer(docs(), 300, tmp_path / "tok", show_progress=False)
    assert ignored == [True]
