"""The salt rule every front end applies (runtime/serving/cache_salts.py): a request carries one
salt (fields that disagree are refused), a salt is a non-empty string, and with a salt key only a
salt the gateway signed is taken (none, unsigned, forged, another key's: refused, the salt never
repeated). The key file's mistakes name the file and the line, never the key. The Dynamo worker's
and the Triton model's use of it: tests/runtime/serving/test_dynamo_protocol.py, test_tenants.py; end to
end through `kvexport serve` and a real Dynamo frontend: test_tenants.py, test_dynamo_salts.py."""

import hashlib
import hmac
import logging
import shutil
import subprocess
import sys

import pytest

from kvexport.errors import ConfigError
from kvexport.runtime.serving.cache_salts import SaltKey, SaltKeyError, accept_salt, one_salt
from kvexport.runtime.serving.requests import RequestError

KEY, OLD_KEY = "k" * 40, "0123456789abcdef" * 4


def refused(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value


def test_one_salt_per_request():
    assert one_salt([("a", None), ("b", None)]) is None
    assert one_salt([("a", "s"), ("b", None)]) == one_salt([("a", None), ("b", "s")]) == "s"
    assert one_salt([("a", "s"), ("b", "s")]) == "s"
    e = refused(one_salt, [("routing.cache_salt", "s1"), ("extra_args.nvext.cache_salt", "s2")])
    assert (e.param, e.code) == ("routing.cache_salt", "conflicting_cache_salt")
    assert "routing.cache_salt and extra_args.nvext.cache_salt disagree" in str(e) and "s1" not in str(e)
    # an empty salt is not a salt, in any field; nor a non-string or an over-long one
    for value, what in (("", "non-empty"), (5, "non-empty"), ("x" * 1025, "at most 1024"), ("\ud800", "Unicode")):
        e = refused(one_salt, [("a", "s"), ("b", value)])
        assert e.param == "b" and what in str(e), str(e)


def test_signed_salts_only_with_a_key():
    key = SaltKey.parse(f"# current, then the old one (rotation)\n{KEY}\n\n{OLD_KEY}\n", "salt.key")
    good = key.sign("acme")
    assert good == "acme." + hmac.new(KEY.encode(), b"acme", hashlib.sha256).hexdigest()
    assert accept_salt([("cache_salt", good)], key) == good
    old = "globex." + hmac.new(OLD_KEY.encode(), b"globex", hashlib.sha256).hexdigest()
    assert accept_salt([("cache_salt", old)], key) == old  # every key of the file verifies
    assert accept_salt([("cache_salt", "anything")], None) == "anything"  # no key: taken as sent
    other = SaltKey.parse("z" * 40).sign("acme")
    forged = [None, "acme", "acme.", "." + good.split(".")[1], good.upper(), good[:-1] + "0", other,
              "globex" + good[4:], good + ".", "acme." + "0" * 64]
    for salt in forged:
        e = refused(accept_salt, [("cache_salt", salt)], key)
        assert (e.param, e.code) == ("cache_salt", "invalid_cache_salt"), salt
        assert "through the gateway" in str(e) and (salt is None or salt not in str(e)), str(e)
    # the one-salt rule comes first: two signed salts that disagree are refused as such
    e = refused(accept_salt, [("a", good), ("b", key.sign("globex"))], key)
    assert e.code == "conflicting_cache_salt"
    with pytest.raises(ConfigError):
        key.sign("")
    assert KEY not in repr(key) and "2 key(s)" in repr(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl on PATH")
def test_a_gateway_can_sign_with_openssl():
    """The shell line docs/DEPLOYMENT.md gives gateways makes the same salt."""
    sig = subprocess.run(["openssl", "dgst", "-sha256", "-hmac", KEY, "-r"], input=b"acme \xc3\xa9", check=True,
                         capture_output=True).stdout.split()[0].decode()
    assert SaltKey.parse(KEY).sign("acme é") == f"acme é.{sig}"


def test_key_file_mistakes_name_the_file_and_line(tmp_path, caplog):
    path = tmp_path / "salt.key"
    for text, what in (("", "holds no key"), ("# only a comment\n", "holds no key"),
                       ("short\n", "line 1: the key has 5"),
                       (f"# c\n{KEY} {KEY}\n", "line 2: a key is one run"), ("x" * 1025, "1025 characters"),
                       (f"{KEY}é\n", "line 1: a key is one run")):
        path.write_text(text)
        with pytest.raises(SaltKeyError) as e:
            SaltKey.load(path)
        assert what in str(e.value) and str(path) in str(e.value) and "--cache-salt-key" in str(e.value), str(e.value)
        assert KEY not in str(e.value)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(SaltKeyError, match="line 1: not UTF-8"):
        SaltKey.load(path)
    for missing in (tmp_path / "nope", tmp_path):
        with pytest.raises(SaltKeyError, match="cannot read it|is a directory"):
            SaltKey.load(missing)
    path.write_text(KEY + "\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert SaltKey.load(path).sign("a") == SaltKey.parse(KEY).sign("a")
    assert "chmod 600" in caplog.text and KEY not in caplog.text


def test_the_environment_names_the_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KVEXPORT_CACHE_SALT_KEY", raising=False)
    assert SaltKey.from_env() is None
    (tmp_path / "k").write_text(KEY)
    monkeypatch.setenv("KVEXPORT_CACHE_SALT_KEY", str(tmp_path / "k"))
    assert SaltKey.from_env().sign("t") == SaltKey.parse(KEY).sign("t")
    monkeypatch.setenv("KVEXPORT_CACHE_SALT_KEY", str(tmp_path / "missing"))
    with pytest.raises(SaltKeyError, match="KVEXPORT_CACHE_SALT_KEY"):
        SaltKey.from_env()


@pytest.mark.parametrize("command", ["serve", "dynamo"])
def test_a_bad_key_file_stops_the_server_at_start(command, tmp_path):
    """Exit 2 naming the option and the line, before any model is loaded (the folder is no build)."""
    if command == "dynamo":
        pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed")
    key = tmp_path / "salt.key"
    key.write_text(f"# rotation\n{KEY}\nshort\n")
    r = subprocess.run([sys.executable, "-m", "kvexport.cli", command, str(tmp_path), "--cache-salt-key", str(key)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r
    assert "--cache-salt-key (or $KVEXPORT_CACHE_SALT_KEY)" in r.stderr, r.stderr
    assert "line 3: the key has 5" in r.stderr, r.stderr
    assert KEY not in r.stderr + r.stdout
