"""The Dynamo wire format on kvexport's side (runtime/serving/dynamo_protocol.py) and the block
pool's observer events it is fed from: a PreprocessedRequest -> SamplingParams (and the refusals,
naming the field), engine events -> response chunks, pool events -> KV event batches, and that
the blocks kvexport reports stored hash, with Dynamo's own `compute_block_hash_for_seq`, to
exactly the hashes Dynamo's router computes for the request's tokens (skipped, saying why, where
the `dynamo` extra is not installed; CI installs it). Salts: a request's cache_salt read from where
the frontend puts it, the salt named on its stored blocks so the router hashes them as it hashes
the salted request (and never as an unsalted one), `split_salt` inverting `request_salt`. KV
tiers: blocks loaded back from the host tier are reported stored again (tokens, parent, salt), and
the router's view rebuilt from the events equals the pool's prefix cache after the round trip."""

import pytest

from kvexport.io import FULL_GROUP
from kvexport.runtime.core.block_hash import hash_full_blocks, request_salt, split_salt
from kvexport.runtime.core.block_pool import BlockPool, BlockRemoved, BlockStored
from kvexport.runtime.core.kv_cache_manager import TIER_BLOCK, KVCacheManager
from kvexport.runtime.core.kv_tiers import HOST, TierIndex
from kvexport.runtime.serving.cache_salts import SaltKey
from kvexport.runtime.serving.dynamo_protocol import (chunk, completion_usage, external_hash, kv_event_batch,
                                                      request_cache_salt, request_to_params, router_cache_salt)
from kvexport.runtime.serving.engine_thread import Event
from kvexport.runtime.serving.requests import RequestError, RequestParser

PARSER = RequestParser(None, 100, 32)  # vocabulary 100, context 32


def req(**groups):
    r = {"token_ids": [5, 6, 7], "stop_conditions": {}, "sampling_options": {}, "output_options": {},
         "eos_token_ids": [2]}
    for k, v in groups.items():
        r[k] = {**r.get(k, {}), **v} if isinstance(v, dict) else v
    return r


# ---- requests ----------------------------------------------------------------------------
def test_a_frontend_request_maps_onto_sampling_params():
    # the shape dynamo.frontend 1.6.1 sends for a /v1/completions request (seen on the wire)
    r = req(stop_conditions={"max_tokens": 8, "stop": ["xx"], "stop_token_ids": None, "stop_token_ids_hidden": [2],
                             "min_tokens": None, "ignore_eos": None, "max_thinking_tokens": None},
            sampling_options={"n": None, "best_of": None, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                              "seed": 11, "use_beam_search": None, "guided_decoding": None},
            output_options={"logprobs": 2, "prompt_logprobs": None, "skip_special_tokens": None})
    prompt, p = request_to_params(r, PARSER)
    assert prompt == [5, 6, 7]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.logprobs) == (8, 0.7, 0.9, 0, 11, 2)
    assert p.stop_token_ids == (2,) and p.stop == ()  # stop strings are the frontend's job
    _, p = request_to_params(req(), PARSER)
    assert (p.max_tokens, p.temperature, p.stop_token_ids) == (29, 0.0, ())  # the room left; greedy
    _, p = request_to_params(req(stop_conditions={"ignore_eos": True, "stop_token_ids_hidden": [2, 9],
                                                  "min_tokens": 3, "max_tokens": 5}), PARSER)
    assert (p.ignore_eos, p.stop_token_ids, p.min_tokens) == (True, (9,), 3)


@pytest.mark.parametrize("groups, field", [
    ({"sampling_options": {"n": 2}}, "sampling_options.n"),
    ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search"),
    ({"sampling_options": {"guided_decoding": {"json": {}, "whitespace_pattern": " "}}},
     "sampling_options.guided_decoding.whitespace_pattern"),
    ({"sampling_options": {"guided_decoding": {"regex": "a", "choice": ["b"]}}}, "sampling_options.guided_decoding"),
    ({"output_options": {"prompt_logprobs": 1}}, "output_options.prompt_logprobs"),
    ({"sampling_options": {"temperature": -1.0}}, "sampling_options.temperature"),
    ({"stop_conditions": {"max_tokens": 0}}, "stop_conditions.max_tokens"),
    ({"stop_conditions": {"stop_token_ids_hidden": [100]}}, "stop_conditions.stop_token_ids"),
    ({"token_ids": [1, 200]}, "token_ids"),
    ({"token_ids": list(range(40))}, "prompt"),
    ({"stop_conditions": "x"}, "stop_conditions"),
])
def test_requests_kvexport_cannot_serve_are_refused_naming_the_field(groups, field):
    with pytest.raises(RequestError) as e:
        request_to_params(req(**groups), PARSER)
    assert e.value.param == field, str(e.value)


# ---- responses ---------------------------------------------------------------------------
def test_events_become_chunks_with_dynamos_finish_reasons():
    ev = Event(0, " a", [7], 1, False, None, None, logprobs=[-0.5], top_logprobs=[[(7, -0.5), (9, -1.0)]])
    assert chunk(ev) == {"token_ids": [7], "log_probs": [-0.5]}
    assert chunk(ev, decode=lambda t: f"<{t}>")["top_logprobs"] == [
        [{"rank": 1, "token_id": 7, "token": "<7>", "logprob": -0.5},
         {"rank": 2, "token_id": 9, "token": "<9>", "logprob": -1.0}]]
    for ours, theirs in (("stop", "stop"), ("length", "length"), ("abort", "cancelled")):
        assert chunk(Event(0, "", [3], 2, True, ours, None)) == {"token_ids": [3], "finish_reason": theirs}
    assert "finish_reason" not in chunk(Event(0, "", [], 0, True, "error", "boom"))
    assert completion_usage(10, 4, 8) == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                                          "prompt_tokens_details": {"cached_tokens": 8}}


# ---- KV events -------------------------------------------------------------------------------
def test_the_pool_records_stored_and_removed_blocks_only_when_asked():
    p = BlockPool(4, 2)
    ids = p.get_new_blocks(1)
    p.cache_full_blocks(ids, hash_full_blocks([1, 2], 2))
    assert p.pop_events() == []  # not recording: nothing kept
    p = BlockPool(4, 2)
    p.record_events()
    keys = hash_full_blocks([1, 2, 3, 4, 5, 6], 2)
    ids = p.get_new_blocks(3)
    assert p.cache_full_blocks(ids, keys, parent_hashes=[None, keys[0], keys[1]],
                               block_tokens=[[1, 2], [3, 4], [5, 6]]) == 3
    p.cache_full_blocks(ids[:1], keys[:1])  # already cached: no second event
    assert p.pop_events() == [BlockStored(keys[0], None, (1, 2)), BlockStored(keys[1], keys[0], (3, 4)),
                              BlockStored(keys[2], keys[1], (5, 6))]
    assert p.pop_events() == []
    p.free_blocks(reversed(ids))  # all three evictable: the tail first, then the head
    p.get_new_blocks(2)  # evicts the two least recently released: keys[2], keys[1]
    assert p.pop_events() == [BlockRemoved(keys[2]), BlockRemoved(keys[1])]


def test_event_batches_chain_blocks_and_skip_what_the_router_cannot_hash():
    k = hash_full_blocks(list(range(8)), 2)
    events = [BlockStored(k[0], None, (0, 1)), BlockStored(k[1], k[0], (2, 3)),  # one chain: one entry
              BlockStored(k[3], k[2], (6, 7)),  # parent not the previous block: a new entry
              BlockStored(k[2], k[1], None),  # no tokens (the caller gave none): skipped
              BlockRemoved(k[0]), BlockRemoved(k[1])]
    batch, skipped = kv_event_batch(events, 2)
    assert skipped == 1
    assert batch == [
        {"type": "stored", "token_ids": [0, 1, 2, 3], "num_block_tokens": [2, 2],
         "block_hashes": [external_hash(k[0]), external_hash(k[1])], "parent_hash": None},
        {"type": "stored", "token_ids": [6, 7], "num_block_tokens": [2], "block_hashes": [external_hash(k[3])],
         "parent_hash": external_hash(k[2])},
        {"type": "removed", "block_hashes": [external_hash(k[0]), external_hash(k[1])]}]
    assert all(-2**63 <= h < 2**63 for e in batch for h in e["block_hashes"])


def test_stored_blocks_hash_as_dynamos_router_hashes_the_request():
    dyn = pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh "
                                                   "installs it; docs/DEPLOYMENT.md)")
    bs = 4
    m = KVCacheManager(BlockPool(16, bs))
    m.pool.record_events()
    prompt = [17, 3, 99, 4, 8, 8, 1, 0, 55, 21, 7, 7, 30]  # 3 full blocks + 1 token
    m.allocate_slots("a", len(prompt), computed_blocks=m.get_computed_blocks(prompt))
    m.cache_blocks("a", prompt, len(prompt))
    # a second request sharing the first two blocks stores only its own third block
    other = prompt[:8] + [1, 2, 3, 4, 5]
    m.allocate_slots("b", len(other) - 8, computed_blocks=m.get_computed_blocks(other))
    m.cache_blocks("b", other, len(other))
    batch, skipped = kv_event_batch(m.pool.pop_events(), bs)
    assert skipped == 0 and [e["num_block_tokens"] for e in batch] == [[bs] * 3, [bs]]
    router = dyn.compute_block_hash_for_seq(prompt, bs)
    assert dyn.compute_block_hash_for_seq(batch[0]["token_ids"], bs) == router  # what the publisher hashes
    assert dyn.compute_block_hash_for_seq(batch[1]["token_ids"], bs) == dyn.compute_block_hash_for_seq(other, bs)[2:]
    assert batch[1]["parent_hash"] == batch[0]["block_hashes"][1]  # hangs under the shared prefix


# ---- salts ------------------------------------------------------------------------------------
def test_split_salt_inverts_request_salt_and_refuses_other_strings():
    for tenant, salt in ((None, None), ("a", None), (None, "a"), ("a|s", None), ("a", "s"), ("t;1:", "s2:x;"),
                         ("", "ü")):
        assert split_salt(request_salt(tenant, salt)) == (tenant, salt)
    for bad in ("", "x", "salt3:ab;", "salt2:ab", "salt2:ab;x", "tenantx:a;", "salt-1:;"):
        with pytest.raises(ValueError):
            split_salt(bad)
    assert router_cache_salt(request_salt(None, "s")) == "s"  # what the frontend hashes the request with
    assert router_cache_salt(request_salt("a", "s")) == request_salt("a", "s")  # never a client's plain salt
    assert router_cache_salt(None) is None


def test_the_cache_salt_is_read_where_the_frontend_puts_it():
    # dynamo.frontend 1.6.1, for {"cache_salt": "s"} or {"nvext": {"cache_salt": "s"}} (seen on the wire)
    assert request_cache_salt(req(routing={"dp_rank": 0, "cache_salt": "s"}, extra_args={"nvext": {"cache_salt": "s"}})) == "s"
    assert request_cache_salt(req(extra_args={"nvext": {"cache_salt": "n"}})) == "n"
    assert request_cache_salt(req(routing={"dp_rank": 0})) is None
    for groups, field in (({"routing": {"cache_salt": 5}}, "routing.cache_salt"),
                          ({"extra_args": {"nvext": {"cache_salt": "x" * 1025}}}, "extra_args.nvext.cache_salt")):
        with pytest.raises(RequestError) as e:
            request_cache_salt(req(**groups))
        assert e.value.param == field


def test_the_worker_takes_one_salt_and_with_a_key_only_a_signed_one():
    both = lambda r, n, key=None: request_cache_salt(req(routing={"dp_rank": 0, "cache_salt": r},  # noqa: E731
                                                         extra_args={"nvext": {"cache_salt": n}}), key)
    # the frontend writes one value into both places; two different ones are refused, not chosen between
    # (before: routing.cache_salt won silently)
    with pytest.raises(RequestError, match="disagree") as e:
        both("gateway-salt", "client-salt")
    assert e.value.code == "conflicting_cache_salt" and "client-salt" not in str(e.value)
    for r, n, field in (("", None, "routing.cache_salt"), ("s", "", "extra_args.nvext.cache_salt")):
        with pytest.raises(RequestError, match="non-empty") as e:  # an empty salt is not a salt, in either place
            both(r, n)
        assert e.value.param == field
    key = SaltKey.parse("k" * 40)
    signed = key.sign("acme")
    assert both(signed, signed, key) == signed
    assert request_cache_salt(req(extra_args={"nvext": {"cache_salt": signed}}), key) == signed
    for salt in ("acme", "acme." + "0" * 64, SaltKey.parse("z" * 40).sign("acme")):  # chosen by a client: refused
        with pytest.raises(RequestError, match="not signed") as e:
            both(salt, salt, key)
        assert e.value.code == "invalid_cache_salt" and salt not in str(e.value)
    with pytest.raises(RequestError, match="missing"):  # with a key, every request needs a salt
        request_cache_salt(req(routing={"dp_rank": 0}), key)


def _stored_and_router_hashes(events, bs, dyn):
    """The KV event batch of `events` -> the router's hashes of each stored entry (as the
    publisher hashes its tokens under its cache_salt), concatenated."""
    batch, skipped = kv_event_batch(events, bs)
    assert skipped == 0
    return batch, [h for e in batch if e["type"] == "stored"
                   for h in dyn.compute_block_hash_for_seq(e["token_ids"], bs, cache_namespace=e.get("cache_salt"))]


def test_salted_blocks_hash_as_the_router_hashes_the_salted_request_only():
    dyn = pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh "
                                                   "installs it; docs/DEPLOYMENT.md)")
    bs = 4
    m = KVCacheManager(BlockPool(16, bs))
    m.pool.record_events()
    prompt = [17, 3, 99, 4, 8, 8, 1, 0, 55]
    for rid, s in (("plain", None), ("a", "tenant-a"), ("b", "tenant-b")):
        salt = request_salt(None, s)
        m.allocate_slots(rid, len(prompt), computed_blocks=m.get_computed_blocks(prompt, salt))
        m.cache_blocks(rid, prompt, len(prompt))
    batch, hashes = _stored_and_router_hashes(m.pool.pop_events(), bs, dyn)
    # three entries (the salts keep the same tokens apart), each its salt named
    assert [e.get("cache_salt") for e in batch] == [None, "tenant-a", "tenant-b"]
    want = [dyn.compute_block_hash_for_seq(prompt, bs, cache_namespace=s) for s in (None, "tenant-a", "tenant-b")]
    assert hashes == [h for w in want for h in w]
    assert len(set(hashes)) == 6  # no salted block collides with the unsalted one or the other salt's


def test_blocks_loaded_from_a_kv_tier_are_reported_stored_again():
    dyn = pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh "
                                                   "installs it; docs/DEPLOYMENT.md)")
    bs = 4
    tiers = TierIndex({FULL_GROUP: 1}, host_bytes=100, disk_bytes=0)
    m = KVCacheManager(BlockPool(5, bs), tiers)  # 4 usable blocks: one 13-token prompt (4 blocks) at a time
    m.pool.record_events()
    salt = request_salt(None, "s")
    a, b = [17, 3, 99, 4, 8, 8, 1, 0, 55, 21, 7, 7, 30], [60 + i for i in range(13)]
    router: dict[int, int] = {}  # what the router holds for this worker: event hash -> its router hash

    def run(rid, prompt):
        computed = m.get_computed_blocks(prompt, salt)
        m.allocate_slots(rid, len(prompt) - computed.num_computed_tokens, computed_blocks=computed)
        m.cache_blocks(rid, prompt, len(prompt))
        m.free(rid)
        batch, hashes = _stored_and_router_hashes(m.pool.pop_events(), bs, dyn)
        for e in batch:
            if e["type"] == "removed":
                for h in e["block_hashes"]:
                    del router[h]
        stored = [h for e in batch if e["type"] == "stored" for h in e["block_hashes"]]
        router.update(zip(stored, hashes))
        return computed

    run("a", a)
    run("b", b)  # evicts a's three cached blocks into the host tier: reported removed
    assert sorted(router) == sorted(external_hash(k) for _, k in m.pool.cached_blocks())
    assert not set(router.values()) & set(dyn.compute_block_hash_for_seq(a, bs, cache_namespace="s"))
    back = run("a2", a)  # a's blocks come back from the host tier
    assert back.block_ids == (TIER_BLOCK,) * 3 and [t for _, t in back.tier_hits] == [HOST] * 3
    # the router holds exactly the pool's cached blocks again (b's went to the tier: removed), a's
    # as it hashes the salted request
    assert sorted(router) == sorted(external_hash(k) for _, k in m.pool.cached_blocks()) and len(router) == 3
    keys = hash_full_blocks(a, bs, salt)
    assert [router[external_hash(k)] for k in keys] == dyn.compute_block_hash_for_seq(a, bs, cache_namespace="s")


# ---- the command's refusals (before any engine or Dynamo runtime starts) --------------------------
@pytest.mark.parametrize("args, says", [
    (["--namespace", "a.b"], "namespace must be letters, digits"),
    (["--endpoint", ""], "endpoint must be letters, digits"),
    (["--served-model-name", " "], "served_model_name must not be empty"),
    (["--mode", "encode"], "Invalid value for '--mode'"),
    (["--kv-transfer", "rdma"], "Invalid value for '--kv-transfer'"),
    (["--kv-transfer-timeout", "0"], "Invalid value for '--kv-transfer-timeout'"),
    # before: the adapters were loaded, the base model alone registered, and no request could reach them
    (["--lora-modules", "one=/tmp"], "lora_modules: the Dynamo worker does not serve LoRA adapters yet"),
])
def test_bad_worker_options_are_refused_naming_them(tmp_path, args, says):
    from click.testing import CliRunner

    from kvexport.cli import main

    r = CliRunner().invoke(main, ["dynamo", str(tmp_path), *args])
    assert r.exit_code == 2 and says in r.output, r.output


def test_without_the_dynamo_extra_the_command_says_how_to_install_it(tmp_path, monkeypatch):
    import sys

    from click.testing import CliRunner

    from kvexport.cli import main

    monkeypatch.setitem(sys.modules, "dynamo", None)  # `import dynamo` fails as if not installed
    r = CliRunner().invoke(main, ["dynamo", str(tmp_path)])
    assert r.exit_code == 2 and "kvexport[dynamo]" in r.output and "--no-deps ai-dynamo==1.6.1" in r.output, r.output


def test_a_build_the_frontend_cannot_load_is_refused(tmp_path):
    from types import SimpleNamespace

    from kvexport.errors import ConfigError
    from kvexport.runtime.serving.dynamo_worker import model_folder

    with pytest.raises(ConfigError, match="has no tokenizer"):
        model_folder(tmp_path, SimpleNamespace(tokenizer=None))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="lacks tokenizer.json, tokenizer_config.json at its root.*rebuild"):
        model_folder(tmp_path, SimpleNamespace(tokenizer=object()))
    for n in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / n).write_text("{}")
    assert model_folder(tmp_path, SimpleNamespace(tokenizer=object())) == tmp_path


def test_guided_decoding_the_frontend_forwards_becomes_structured_output():
    """What dynamo.frontend 1.6.1 makes of response_format / structured_outputs / tool_choice (prepost.py:
    sampling_options.guided_decoding = {json | regex | choice | grammar, backend?})."""
    from kvexport.runtime.sampling_params import StructuredOutputs

    _, p = request_to_params(req(sampling_options={"guided_decoding": {"json": {"type": "object"},
                                                                       "backend": "xgrammar"}}), PARSER)
    assert p.structured == StructuredOutputs(json={"type": "object"})
    _, p = request_to_params(req(sampling_options={"guided_decoding": {"choice": ["a", "b"]}}), PARSER)
    assert p.structured == StructuredOutputs(choice=("a", "b"))
