"""runtime/serving/metrics.py: one table for `kvexport serve`'s /metrics and the Triton model's
custom metrics, listed in docs/DEPLOYMENT.md."""

import re
from pathlib import Path

from kvexport.runtime.serving import metrics as mx
from kvexport.runtime.core.stats import PrefixCacheStats, SchedulerStats
from kvexport.runtime.serving.engine_thread import Counters

DOC = Path(__file__).resolve().parents[3] / "docs" / "DEPLOYMENT.md"


def counters() -> Counters:
    stats = SchedulerStats(kv_blocks_used=3, kv_blocks_total=10, kv_cache_usage=0.3,
                           prefix_cache=PrefixCacheStats(queries=8, hits=2, evictions=0), num_preemptions=1)
    return Counters(running=2, waiting=1, stats=stats, generation_tokens=40, prompt_tokens=12, requests=5, aborted=1)


def test_table_is_consistent():
    names = [m.name for m in mx.METRICS]
    assert len(set(names)) == len(names) and mx.NAMES == tuple("kvexport_" + n for n in names)
    for m in mx.METRICS:
        assert m.kind in (mx.GAUGE, mx.COUNTER) and m.help
        assert m.kind == mx.GAUGE or m.name.endswith("_total"), m.name  # Prometheus naming of counters
    assert {"kvexport_prefix_cache_hit_rate", "kvexport_requests_cancelled_total"} <= set(mx.NAMES)
    assert not any("aborted" in n for n in mx.NAMES)  # one name for client-cancelled requests


def test_prometheus_text():
    text = mx.prometheus_text(counters(), cancelled=4)
    values = dict(line.split() for line in text.splitlines() if not line.startswith("#"))
    assert list(values) == list(mx.NAMES)
    assert values["kvexport_requests_running"] == "2" and values["kvexport_kv_cache_usage"] == "0.3"
    assert values["kvexport_prefix_cache_hit_rate"] == "0.25" and values["kvexport_requests_cancelled_total"] == "4"
    assert "# TYPE kvexport_preemptions_total counter\n" in text and "# TYPE kvexport_kv_blocks_used gauge\n" in text
    empty = Counters(stats=SchedulerStats(kv_blocks_total=4))
    assert "kvexport_prefix_cache_hit_rate 0\n" in mx.prometheus_text(empty, 0)  # no queries: 0, not a division error


def test_docs_list_the_table():
    text = DOC.read_text()
    m = re.search(r"<!-- metrics table:[^\n]*-->\n(.*?)<!-- end of metrics table -->", text, re.S)
    assert m, "docs/DEPLOYMENT.md lost its metrics table markers"
    assert m.group(1) == mx.markdown_table(), "regenerate it: python -m kvexport.runtime.serving.metrics"


class _FakeMetric:
    def __init__(self, family, labels):
        self.family, self.labels, self.value, self.calls = family, labels, 0.0, []

    def set(self, v):
        self.calls.append(("set", v))
        self.value = v

    def increment(self, v):
        self.calls.append(("increment", v))
        self.value += v


class _FakeFamily:
    GAUGE, COUNTER = "GAUGE", "COUNTER"
    made: list = []

    def __init__(self, name, description, kind):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []
        _FakeFamily.made.append(self)

    def Metric(self, labels):  # noqa: N802 - Triton's name
        self.metrics.append(_FakeMetric(self, labels))
        return self.metrics[-1]


def test_triton_metrics_publish_the_same_table(monkeypatch):
    """The Triton model's _Metrics, with a stand-in for triton_python_backend_utils."""
    from kvexport.runtime.serving import triton_model

    monkeypatch.setattr(triton_model, "pb_utils", type("pb", (), {"MetricFamily": _FakeFamily}))
    _FakeFamily.made = []
    metrics = triton_model._Metrics({"model": "m"})
    assert [f.name for f in _FakeFamily.made] == list(mx.NAMES)
    kinds = {f.name: f.kind for f in _FakeFamily.made}
    assert all(kinds[m.full_name] == m.kind.upper() for m in mx.METRICS)
    c = counters()
    metrics.publish(c, 1)
    c.generation_tokens, c.running = 50, 0
    metrics.publish(c, 1)
    got = {f.name: f.metrics[0] for f in _FakeFamily.made}
    assert got["kvexport_generation_tokens_total"].calls == [("increment", 40.0), ("increment", 10.0)]
    assert got["kvexport_requests_cancelled_total"].calls == [("increment", 1.0)]  # no zero increments
    assert got["kvexport_requests_running"].calls == [("set", 2.0), ("set", 0.0)]
    assert got["kvexport_prefix_cache_hit_rate"].value == 0.25
    assert got["kvexport_requests_running"].labels == {"model": "m"}
    text = dict(line.split() for line in mx.prometheus_text(c, 1).splitlines() if not line.startswith("#"))
    assert {n: float(v) for n, v in text.items()} == {n: m.value for n, m in got.items()}  # same values as serve's
