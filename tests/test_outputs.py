"""kvexport/outputs.py: what --force may replace, the temporary folders and their cleanup,
signals during a swap, permissions. Fake outputs here (a kvexport.json or a Triton marker is
all the rule reads); real builds and repositories: tests/exporter/test_build_safety.py and
tests/runtime/serving/test_triton_repo_safety.py."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvexport import outputs
from kvexport.errors import BuildExistsError, OutputError
from kvexport.outputs import Kind, write_dir

OWNER = outputs.OWNER_FILE


def fake_build(d: Path, payload: bytes = b"graph") -> Path:
    """What the rule reads of a build: its manifest and the files it names."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "kvexport.json").write_text(json.dumps({"schema_version": 1, "graphs": {"prefill": {"file": "p.onnx"}}}))
    (d / "p.onnx").write_bytes(payload)
    return d


def fake_repo(d: Path) -> Path:
    (d / "m" / "1").mkdir(parents=True)
    (d / "m" / "1" / "model.py").write_text("x")
    outputs.mark_triton_repository(d, ["m"])
    return d


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def write_build(out: Path, force: bool = False, protect=(), payload: bytes = b"new") -> Path:
    write_dir(out, lambda tmp: fake_build(tmp, payload), kind=Kind.BUILD, force=force, protect=protect)
    return out


# ---- what is never replaced ---------------------------------------------------------------------


def _foreign_folder(out: Path) -> None:
    out.mkdir()
    (out / "notes.txt").write_text("mine")


def _file(out: Path) -> None:
    out.write_text("mine\n")


def _link_to_build(out: Path) -> None:
    out.symlink_to(fake_build(out.parent / "elsewhere"))


def _dangling_link(out: Path) -> None:
    out.symlink_to(out.parent / "nowhere")


def _fifo(out: Path) -> None:
    os.mkfifo(out)


def _build_with_a_users_file(out: Path) -> None:
    fake_build(out)
    (out / "my-adapter.safetensors").write_bytes(b"weights")


def _build_with_a_users_file_in_a_repo_inside(out: Path) -> None:
    fake_build(out)
    fake_repo(out / "triton")
    (out / "triton" / "m" / "env.tar.gz").write_bytes(b"env")


def _triton_repo(out: Path) -> None:
    fake_repo(out)


def _hidden_foreign_entry(out: Path) -> None:
    fake_build(out)
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref")


def _manifest_only_as_a_link(out: Path) -> None:
    out.mkdir()
    (out / "kvexport.json").symlink_to(out.parent / "x.json")
    (out.parent / "x.json").write_text("{}")


REFUSED = {  # what is at --out -> words of the error
    "folder-with-files": (_foreign_folder, "a folder holding 'notes.txt', not a kvexport build"),
    "file": (_file, "a file (5 bytes), not a kvexport build"),
    "link-to-a-build": (_link_to_build, "a symbolic link (to "),
    "dangling-link": (_dangling_link, "a symbolic link (to "),
    "fifo": (_fifo, "a named pipe, not a kvexport build"),
    "build-plus-a-users-file": (_build_with_a_users_file, "also holds what kvexport did not write ('my-adapter"),
    "users-file-in-a-repo-inside": (_build_with_a_users_file_in_a_repo_inside, "'triton/m/env.tar.gz'"),
    "triton-repo": (_triton_repo, "is a Triton model repository written by kvexport, not a kvexport build"),
    "hidden-foreign-folder": (_hidden_foreign_entry, "'.git'"),
    "manifest-is-a-link": (_manifest_only_as_a_link, "not a kvexport build"),
}


@pytest.mark.parametrize("force", [False, True], ids=["no-force", "force"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_never_replaces_what_kvexport_did_not_write(tmp_path, snapshot, case, force):
    make, words = REFUSED[case]
    out = tmp_path / "out"
    make(out)
    before = snapshot(tmp_path)
    with pytest.raises(OutputError) as e:
        write_build(out, force=force)
    assert words in str(e.value) and "--out" in str(e.value)
    assert snapshot(tmp_path) == before  # nothing changed, nothing left behind


@pytest.mark.parametrize("where", ["same", "parent", "grandparent", "link-to-it"])
def test_never_writes_over_a_protected_path(tmp_path, snapshot, where):
    source = fake_build(tmp_path / "a" / "model")  # even a folder that looks like a build
    out = {"same": source, "parent": source.parent, "grandparent": tmp_path, "link-to-it": tmp_path / "l"}[where]
    if where == "link-to-it":
        out.symlink_to(source)
    before = snapshot(tmp_path)
    with pytest.raises(OutputError, match="the model source"):
        write_build(out, force=True, protect=[("the model source", source)])
    assert snapshot(tmp_path) == before


def test_a_new_folder_inside_a_protected_one_is_fine(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    write_build(source / "build", protect=[("the model source", source)])
    assert (source / "build" / "p.onnx").read_bytes() == b"new"


@pytest.mark.parametrize("out, words", [("/", "root folder"), ("a\0b", "NUL"), ("x" * 256, "255")])
def test_paths_no_folder_can_be_written_at(tmp_path, out, words, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match=words):
        write_build(out, force=True)
    assert list(tmp_path.iterdir()) == []


def test_parent_that_is_a_file(tmp_path, snapshot):
    (tmp_path / "f").write_text("x")
    before = snapshot(tmp_path)
    with pytest.raises(OutputError, match=r"f is a file \(1 bytes\), not a folder"):
        write_build(tmp_path / "f" / "sub" / "out")
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
def test_parent_that_is_not_writable(tmp_path, snapshot):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    before = snapshot(tmp_path)
    try:
        with pytest.raises(OutputError, match="permission denied"):
            write_build(ro / "sub" / "out")
        after = snapshot(tmp_path)
    finally:
        ro.chmod(0o755)
    assert after == before


# ---- what is replaced ---------------------------------------------------------------------------


def test_an_earlier_output_is_replaced_only_with_force(tmp_path):
    out = write_build(tmp_path / "out", payload=b"old")
    with pytest.raises(BuildExistsError, match="--force"):
        write_build(out)
    assert (out / "p.onnx").read_bytes() == b"old"
    write_build(out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["kvexport.json", "p.onnx"]  # no owner file either
    assert (out / "p.onnx").read_bytes() == b"new" and leftovers(out) == []


def test_a_build_with_kvexports_own_extras_is_replaced(tmp_path):
    """engines/ added later, a Triton repository inside (BUILD/triton/), an atomic save's temp file."""
    out = fake_build(tmp_path / "out")
    (out / "engines").mkdir()
    (out / ".kvexport.json.1a2b3c4d").write_text("{}")
    fake_repo(out / "triton")
    (out / "triton" / "m" / "1" / "__pycache__").mkdir()  # Python's, when Triton imports model.py
    write_build(out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["kvexport.json", "p.onnx"]


def test_an_empty_folder_is_replaced_with_force(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(BuildExistsError, match="empty folder.*--force"):
        write_build(tmp_path / "out")
    write_build(tmp_path / "out", force=True)
    assert (tmp_path / "out" / "p.onnx").read_bytes() == b"new"


@pytest.mark.parametrize("name", ["with space", "br[ack]ets", "ünï©ødé", "new\nline", "-dash", ".hidden",
                                  "x" * 255])
def test_odd_names(tmp_path, name):
    out = write_build(tmp_path / name)
    write_build(out, force=True)
    assert (out / "p.onnx").read_bytes() == b"new" and leftovers(out) == []


def test_something_appearing_at_out_meanwhile_is_kept(tmp_path, snapshot):
    out = tmp_path / "out"

    def produce(tmp: Path) -> None:
        fake_build(tmp)
        _foreign_folder(out)  # another program writes there during the build

    with pytest.raises(OutputError, match="notes.txt"):
        write_dir(out, produce, kind=Kind.BUILD, force=True)
    assert (out / "notes.txt").read_text() == "mine" and leftovers(out) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("boom")], ids=["interrupt", "error"])
def test_a_failure_keeps_the_old_output_and_leaves_no_temp(tmp_path, snapshot, exc):
    out = write_build(tmp_path / "out", payload=b"old")
    before = snapshot(tmp_path)

    def produce(tmp: Path) -> None:
        fake_build(tmp)
        raise exc

    with pytest.raises(type(exc)):
        write_dir(out, produce, kind=Kind.BUILD, force=True)
    assert snapshot(tmp_path) == before


def test_a_full_disk_is_a_clear_error(tmp_path):
    def produce(tmp: Path) -> None:
        raise OSError(28, "No space left on device", str(tmp / "weights.data"))

    with pytest.raises(OutputError, match="No space left on device.*free some space"):
        write_dir(tmp_path / "out", produce, kind=Kind.BUILD, force=False)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_the_swap_waits_for_it(tmp_path, monkeypatch):
    """A signal arriving between the two renames is held until the new output is in place."""
    out = write_build(tmp_path / "out", payload=b"old")
    real = os.rename
    sent = []

    def rename(a, b):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return real(a, b)

    class Stop(Exception):
        pass

    def on_term(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGTERM, on_term)
    monkeypatch.setattr(os, "rename", rename)
    try:
        with pytest.raises(Stop):
            write_build(out, force=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sent and (out / "p.onnx").read_bytes() == b"new" and leftovers(out) == []


# ---- temporary folders of earlier runs ----------------------------------------------------------


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _temp(out: Path, kind: str, owner: dict | None) -> Path:
    d = out.parent / f".{out.name}.{kind}-{os.urandom(4).hex()}"
    (d / "half").mkdir(parents=True)
    (d / "half" / "weights.data").write_bytes(b"\0" * 1000)
    if owner is not None:
        (d / OWNER).write_text(json.dumps(owner))
    return d


@pytest.fixture
def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def live_process():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_stale_temp_folders_of_ended_runs_are_removed(tmp_path, dead_pid, live_process, caplog):
    out = write_build(tmp_path / "out", payload=b"old")
    me, boot, host = os.getpid(), _boot(), socket.gethostname()
    live = {"pid": live_process.pid, "started": _start_time(live_process.pid), "boot": boot, "host": host}
    gone = {
        "dead pid": _temp(out, "tmp", {"pid": dead_pid, "started": 1, "boot": boot, "host": host}),
        "pid reused (a container's pid 1 again)": _temp(out, "tmp", {"pid": me, "started": 1, "boot": boot,
                                                                      "host": "c0ffee"}),
        "rebooted since": _temp(out, "tmp", {"pid": live_process.pid, "started": 1, "boot": "old-boot",
                                             "host": host}),
        "old output of a dead run": _temp(out, "old", {"pid": dead_pid, "started": 1, "boot": boot, "host": host}),
    }
    kept = {
        "a live run": _temp(out, "tmp", live),
        "this process": _temp(out, "tmp", {"pid": me, "started": _start_time(me), "boot": boot, "host": host}),
        "no owner file": _temp(out, "tmp", None),
        "another machine": _temp(out, "tmp", {"pid": dead_pid, "started": 1, "boot": "b2", "host": "other"}),
        "garbled owner": _temp(out, "tmp", None),
        "not our name": out.parent / f".{out.name}.tmp-notours",
        "another output's": _temp(tmp_path / "other", "tmp", {"pid": dead_pid, "started": 1, "boot": boot,
                                                               "host": host}),
    }
    (kept["garbled owner"] / OWNER).write_text("{not json")
    kept["not our name"].mkdir()
    (kept["not our name"] / OWNER).write_text(json.dumps({"pid": dead_pid, "boot": boot, "host": host}))
    write_build(out, force=True)
    assert [k for k, d in gone.items() if d.exists()] == []
    assert [k for k, d in kept.items() if not (d / ("half" if k != "not our name" else OWNER)).exists()] == []
    assert "left by an earlier run" in caplog.text


def test_an_old_output_is_kept_when_it_may_be_the_only_copy(tmp_path, dead_pid, caplog):
    out = tmp_path / "out"
    old = _temp(out, "old", {"pid": dead_pid, "started": 1, "boot": _boot(), "host": socket.gethostname()})
    outputs.clean_stale(outputs.location(out))
    assert (old / "half").exists() and "rename it back" in caplog.text


def test_a_temp_folder_never_written_into_goes_once_a_minute_old(tmp_path, caplog):
    """A run killed between new_temp_dir's mkdir and its owner file's write leaves a folder with
    nothing (or an empty owner file) in it: removed by the next run once older than
    UNBORN_AGE_S; a younger one (a run that may be about to write) and one holding anything
    else are kept."""
    out = write_build(tmp_path / "out", payload=b"old")
    aged = time.time() - outputs.UNBORN_AGE_S - 5
    empty = out.parent / f".{out.name}.tmp-{os.urandom(4).hex()}"
    empty.mkdir()
    half_owner = out.parent / f".{out.name}.tmp-{os.urandom(4).hex()}"
    half_owner.mkdir()
    (half_owner / OWNER).write_text("")
    young = out.parent / f".{out.name}.tmp-{os.urandom(4).hex()}"
    young.mkdir()
    holding = _temp(out, "tmp", None)  # ownerless, with a half-written build: nobody's to remove
    for d in (empty, half_owner, holding):
        os.utime(d, (aged, aged))
    write_build(out, force=True)
    assert not empty.exists() and not half_owner.exists()
    assert young.is_dir() and (holding / "half" / "weights.data").exists()
    assert "never wrote into" in caplog.text


def test_a_sigkilled_run_is_cleaned_by_the_next(tmp_path):
    """A real process killed while writing: its temporary folder goes with the next run."""
    out = tmp_path / "out"
    code = (f"import time; from kvexport.outputs import write_dir, Kind\n"
            f"write_dir({str(out)!r}, lambda tmp: (open(tmp / 'ready', 'w').close(), time.sleep(60)), "
            f"kind=Kind.BUILD, force=False)")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(600):
            if list(tmp_path.glob(".out.tmp-*/ready")):
                break
            assert p.poll() is None
            time.sleep(0.05)
        p.kill()
    finally:
        p.wait()
    assert len(leftovers(out)) == 1
    write_build(out)
    assert leftovers(out) == [] and (out / "p.onnx").read_bytes() == b"new"


# ---- permissions --------------------------------------------------------------------------------


@pytest.fixture
def umask():
    """umask(value): set the process umask for the test (restored after)."""
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize("mask, dirs, files", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600), (0o002, 0o775, 0o664)],
                         ids=["022", "077", "002"])
def test_permissions_follow_the_umask(tmp_path, umask, mask, dirs, files):
    umask(mask)
    out = write_build(tmp_path / "deep" / "out")
    fd, path = outputs.new_temp_file(out, ".x.")
    os.close(fd)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "deep", out,
                                                                                     *out.iterdir()]}
    assert modes == {"deep": dirs, "deep/out": dirs, "deep/out/kvexport.json": files, "deep/out/p.onnx": files,
                     f"deep/out/{Path(path).name}": files}
