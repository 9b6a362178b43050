"""The disk tier's folder as untrusted input, and what a restart keeps (issue 31 §1, §2), on real
engines over a tiny random llama build (onnxruntime, `onnx` attention, 4-token blocks of 2 KiB):

- what sits under a block file's name in `blocks/` (a FIFO, a dangling symlink, a symlink to a
  valid block file elsewhere, a directory), found at start or appearing while serving: never
  opened through, never waited on, never followed; counted as a disk error, removed (a directory
  is left), the block recomputed: tokens identical to an engine without offload, in a bounded
  number of steps, the disk tier still on;
- a disk read that hangs (simulated: DiskTier.read blocks): after the time limit the block counts
  as missing and is recomputed, the hung disk turns the tier off, an unrelated request is served
  meanwhile, and `close()` does not wait out its timeout;
- an engine thread stuck in a step: `/health` answers 503 "engine stalled", then 200 once the step ends;
- two engines on one folder: the second is refused naming --kv-offload-dir, the first's temporary
  file untouched; after the first closes, the second starts; a FIFO or symlink under the lock's
  name is replaced (never waited on, never written through); a refused folder keeps no lock;
- shutdown keeps the host tier's blocks too: a restart with host + disk tiers hits the prefix the
  host tier held; within the disk budget, most recently used first (exact ops on a bare index).
"""

import os
import threading
import time

import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.core.kv_tiers import DISK, HOST, DropBlock, MoveToDisk, SaveBlock, TierIndex
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.execution import kv_disk
from kvexport.runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
SYSTEM = list(range(3, 43))  # 40 tokens = 10 full blocks
FLOOD = [[100 + k] + list(range(50, 89)) for k in range(3)]  # 3 x 40 tokens: more than the pool holds
MAX_STEPS = 400  # a run that needs more is stuck (a clean run of SYSTEM takes a handful)


@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path_factory.mktemp("folder") / "b",
                   BuildOptions(block_size=4, max_seq_len=128, validate=False, attention=io.Attention.ONNX))
    return out


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(kv_cache_memory="40KiB", max_num_batched_tokens=64, **kw)


def _run(engine: LLMEngine, prompt: list[int]):
    rid = engine.add_request(prompt, PARAMS)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return engine.pop_output(rid)
        engine.step()
    raise AssertionError(f"the request did not finish in {MAX_STEPS} steps (the engine is stuck)")


@pytest.fixture(scope="module")
def clean(tiny):
    return _run(LLMEngine(tiny, _cfg()), SYSTEM).token_ids


def _warm(tiny, folder) -> list:
    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    _run(eng, SYSTEM)
    eng.close()
    return sorted((folder / kv_disk.BLOCKS).iterdir())


def _plant(victim, kind: str, outside):
    """Replace block file `victim` by `kind`; returns what must survive untouched (or None)."""
    data = victim.read_bytes()
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    elif kind == "dangling":
        victim.symlink_to(outside / "gone.kvb")
    elif kind == "foreign":  # a valid block file, but elsewhere: a symlink is never followed
        target = outside / "elsewhere.kvb"
        target.write_bytes(data)
        victim.symlink_to(target)
        return target, data
    else:
        victim.mkdir()
    return None


@pytest.mark.parametrize("when", ["start", "serving"])
@pytest.mark.parametrize("kind", ["fifo", "dangling", "foreign", "dir"])
def test_a_block_name_that_is_not_a_regular_file_is_recomputed(tiny, clean, tmp_path, kind, when):
    folder, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    files = _warm(tiny, folder)
    victim = files[len(files) // 2]
    keep = None
    if when == "start":
        keep = _plant(victim, kind, outside)
    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))  # NOTE: a dangling symlink stopped this before
    if when == "serving":  # indexed as a block file at start, replaced before it is read
        keep = _plant(victim, kind, outside)
    out = _run(eng, SYSTEM)  # NOTE: a FIFO stalled this (the read waited for a writer) before
    st = eng.stats().tiers
    assert out.token_ids == clean
    assert st.disk_errors == 1 and st.disk_on is True
    assert 0 < out.num_cached_prompt_tokens < 36  # the blocks before it were served, the rest recomputed
    assert victim.is_dir() if kind == "dir" else not os.path.lexists(victim)
    if keep is not None:
        assert keep[0].read_bytes() == keep[1]  # the link went, never its target
    if kind == "dir":
        # the block computed again is written to disk under its name: a directory there loses that
        # block alone (counted), never the disk tier (before, the write turned the tier off)
        for prompt in FLOOD:
            _run(eng, prompt)
        for _ in range(3):
            _run(eng, [9, 9, 9])
        st = eng.stats().tiers
        assert st.disk_on is True and st.disk_errors >= 2
        assert _run(eng, SYSTEM).token_ids == clean
    eng.close()


def test_a_hung_disk_read_counts_the_block_missing(tiny, clean, tmp_path, monkeypatch):
    """A hung disk is simulated: DiskTier.read blocks until the test ends."""
    folder = tmp_path / "kv"
    _warm(tiny, folder)
    release = threading.Event()

    def hang(self, group, key):
        release.wait(60)
        raise kv_disk.CorruptBlock("released")

    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    offload = eng.kv_connector.worker.offload
    offload.disk_timeout_s = 0.3
    monkeypatch.setattr(kv_disk.DiskTier, "read", hang)
    try:
        t0 = time.monotonic()
        waiter = eng.add_request(SYSTEM, PARAMS)
        eng.step()  # its prefix is on disk: the read starts and hangs
        other = _run(eng, [9, 8, 7])  # an unrelated request is served meanwhile
        assert len(other.token_ids) == 4
        for _ in range(MAX_STEPS):
            if not eng.has_unfinished():
                break
            eng.step()
        out = eng.pop_output(waiter)
        assert out.finished and out.token_ids == clean and out.num_cached_prompt_tokens == 0
        assert time.monotonic() - t0 < 10
        st = eng.stats().tiers
        assert st.disk_errors >= 1 and st.disk_on is False  # a disk that hangs is turned off
        t1 = time.monotonic()
        eng.close(timeout_s=30)  # NOTE: before, flush waited the whole timeout behind the hung job
        assert time.monotonic() - t1 < 5
    finally:
        release.set()


def test_health_reports_an_engine_stuck_in_a_step(tiny):
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import create_app

    app = create_app(tiny, _cfg(), served_model_name="tiny")
    worker, release, entered = app.state.worker, threading.Event(), threading.Event()
    engine = app.state.server.engine
    step = engine.step

    def stuck():
        entered.set()
        release.wait(30)
        return step()

    with TestClient(app) as c:
        assert c.get("/health").json() == {"status": "ok"}
        worker.stall_s = 0.3
        engine.step = stuck
        worker.submit([5, 6, 7], PARAMS, lambda ev: None)
        assert entered.wait(10)
        time.sleep(0.5)
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"].startswith("engine stalled"), r.json()
        release.set()
        for _ in range(100):
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        assert c.get("/health").json() == {"status": "ok"}


def test_a_second_engine_on_the_same_folder_is_refused(tiny, tmp_path):
    folder = tmp_path / "kv"
    first = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    writing = folder / kv_disk.BLOCKS / f".tmp-{os.getpid()}-99"  # the first's write in progress
    writing.write_bytes(b"half a block")
    with pytest.raises(ConfigError, match=r"kv_offload_dir \(--kv-offload-dir\) .* is in use by another kvexport "
                                          rf"process \(pid {os.getpid()}\).*give each server its own"):
        LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    assert writing.read_bytes() == b"half a block"
    writing.unlink()
    first.close()
    second = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))  # the lock went with close()
    second.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_lock_name_that_is_not_a_regular_file_is_replaced(tiny, tmp_path, kind):
    folder, target = tmp_path / "kv", tmp_path / "mine.txt"
    LLMEngine(tiny, _cfg(kv_offload_dir=str(folder))).close()
    lock = folder / kv_disk.LOCK
    lock.unlink()
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        target.write_text("mine")
        lock.symlink_to(target)
    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))  # never waits on the FIFO, never writes through the link
    assert lock.is_file() and not lock.is_symlink()
    with pytest.raises(ConfigError, match="is in use by another kvexport process"):
        LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    eng.close()
    assert kind == "fifo" or target.read_text() == "mine"


def test_a_restart_keeps_what_the_host_tier_held(tiny, clean, tmp_path):
    folder = tmp_path / "kv"
    cfg = _cfg(kv_offload_memory="1MiB", kv_offload_dir=str(folder))
    eng = LLMEngine(tiny, cfg)
    _run(eng, SYSTEM)
    for prompt in FLOOD:  # SYSTEM's blocks leave the pool for the host tier (it holds them all)
        _run(eng, prompt)
    st = eng.stats().tiers
    assert st.host_blocks >= 10 and st.disk_write_bytes == 0
    pool_keys = {(io.FULL_GROUP, h) for _, h in eng.pool.cached_blocks()}
    eng.close()
    again = LLMEngine(tiny, cfg)
    assert again.stats().tiers.disk_blocks == len(pool_keys) + st.host_blocks
    assert list(again.tiers._disk)[-1] in pool_keys  # the restart's index: the pool's blocks most recent
    out = _run(again, SYSTEM)
    # before, only the pool's blocks were written: SYSTEM, in the host tier at close(), was recomputed
    assert out.token_ids == clean and out.num_cached_prompt_tokens == 36
    assert again.stats().tiers.disk_hits == 9
    again.close()


def test_persist_keeps_the_most_recently_used_within_the_disk_budget():
    F = io.FULL_GROUP
    h = [bytes([i]) * 32 for i in range(8)]
    t = TierIndex({F: 100}, host_bytes=300, disk_bytes=400)
    t.add_disk_blocks([(F, h[0]), (F, h[1])])  # on disk from before (oldest first)
    for i in (2, 3, 4):  # evicted to the host tier, h[4] last (most recent)
        t.offer(F, 10 + i, h[i])
    t.take_ops()
    t.persist([(F, 20, h[5]), (F, 21, h[4])])  # the pool's cached blocks: h[4] is also in the host tier
    # 4 blocks fit: the pool's h[5], h[4], then the host's h[3], h[2]; h[0], h[1] make room first
    assert t.take_ops() == (DropBlock(F, h[0], DISK), DropBlock(F, h[1], DISK), SaveBlock(F, 20, h[5], DISK),
                            SaveBlock(F, 21, h[4], DISK), MoveToDisk(F, h[3]), MoveToDisk(F, h[2]))
    assert list(t._disk) == [(F, h[2]), (F, h[3]), (F, h[4]), (F, h[5])]  # least recently used first
    assert list(t._host) == [(F, h[4])] and t.where((F, h[4])) == HOST
    t.persist([])  # all on disk already
    assert t.take_ops() == ()


def test_a_refused_folder_keeps_no_lock(tiny, tmp_path):
    folder = tmp_path / "kv"
    LLMEngine(tiny, _cfg(kv_offload_dir=str(folder))).close()
    stray = folder / kv_disk.BLOCKS / "photo.jpg"
    stray.write_bytes(b"x")
    with pytest.raises(ConfigError, match="holds files kvexport did not write"):
        LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    stray.unlink()
    LLMEngine(tiny, _cfg(kv_offload_dir=str(folder))).close()  # not "in use": the refusal released the lock
