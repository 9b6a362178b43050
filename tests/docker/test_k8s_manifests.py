"""deploy/k8s/: every manifest parses as YAML and has a kind, an apiVersion and a name; the
DynamoGraphDeployments follow the operator's v1beta1 shape (component names unique, types from
its enum, a `main` container each); every `kvexport` command line in them is one the CLI takes
(parsed by the real click commands, build paths mapped into a temp folder), every `python -m
dynamo.frontend` line one Dynamo's frontend takes (its own argument parser; skipped without the
`dynamo` extra); the workers of one graph serve one model name and mount the volume
models.yaml declares. Nothing here is applied to a cluster: no Kubernetes runs on the project's
machines (docs/DEPLOYMENT.md says what was not run)."""

from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
COMPONENT_TYPES = {"frontend", "worker", "prefill", "decode", "planner", "epp"}  # v1beta1 ComponentType


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _containers(doc: dict) -> list[tuple[str, dict]]:
    """(owner name, container) of every pod template in a manifest document."""
    if doc["kind"] == "DynamoGraphDeployment":
        return [(c["name"], k) for c in doc["spec"]["components"] for k in c["podTemplate"]["spec"]["containers"]]
    if doc["kind"] == "Job":
        return [(doc["metadata"]["name"], k) for k in doc["spec"]["template"]["spec"]["containers"]]
    return []


def _graphs() -> list[dict]:
    return [d for p in MANIFESTS for d in _docs(p) if d["kind"] == "DynamoGraphDeployment"]


def test_the_aggregated_and_disaggregated_graphs_and_the_models_volume_exist():
    assert [p.name for p in MANIFESTS] == ["dynamo-agg.yaml", "dynamo-disagg.yaml", "models.yaml"]
    assert sorted(g["metadata"]["name"] for g in _graphs()) == ["kvexport-agg", "kvexport-disagg"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_parses_and_names_itself(path):
    docs = _docs(path)
    assert docs
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"]["name"], d


def test_graphs_follow_the_operators_v1beta1_shape():
    for g in _graphs():
        assert g["apiVersion"] == "nvidia.com/v1beta1"
        comps = g["spec"]["components"]
        names = [c["name"].lower() for c in comps]
        assert len(set(names)) == len(names), names
        assert {c["type"] for c in comps} <= COMPONENT_TYPES
        assert sum(c["type"] == "frontend" for c in comps) == 1
        for c in comps:
            assert [k["name"] for k in c["podTemplate"]["spec"]["containers"]] == ["main"], c["name"]
            assert isinstance(c["replicas"], int) and c["replicas"] >= 1
    kinds = {g["metadata"]["name"]: sorted(c["type"] for c in g["spec"]["components"]) for g in _graphs()}
    assert kinds == {"kvexport-agg": ["frontend", "worker"], "kvexport-disagg": ["decode", "frontend", "prefill"]}


def test_every_kvexport_command_line_is_one_the_cli_takes(tmp_path):
    from kvexport.cli import main

    def local(arg: str) -> str:  # the volume's paths, made real so BUILD_DIR's exists-check passes
        if arg.startswith("/models/"):
            p = tmp_path / arg.removeprefix("/")
            p.mkdir(parents=True, exist_ok=True)
            return str(p)
        return arg

    seen = []
    for path in MANIFESTS:
        for d in _docs(path):
            for owner, k in _containers(d):
                line = list(k.get("command", [])) + [str(a) for a in k.get("args", [])]
                if not line or line[0] != "kvexport":
                    continue
                with main.make_context("kvexport", [line[1]], resilient_parsing=True) as top:
                    cmd = main.get_command(top, line[1])
                    assert cmd is not None, f"{path.name} {owner}: no command kvexport {line[1]}"
                    ctx = cmd.make_context(line[1], [local(a) for a in line[2:]], parent=top)  # raises on a bad flag
                seen.append((line[1], ctx.params.get("mode")))
    assert sorted(seen, key=str) == sorted([("build", None), ("dynamo", "agg"), ("dynamo", "decode"),
                                            ("dynamo", "prefill")], key=str)


def test_every_frontend_command_line_is_one_dynamo_takes():
    pytest.importorskip("dynamo.frontend", reason="the dynamo extra is not installed (scripts/install_dev.sh)")
    import argparse

    from dynamo.frontend.frontend_args import FrontendArgGroup, FrontendConfig

    lines = [[str(a) for a in k.get("args", [])] for g in _graphs() for _, k in _containers(g)
             if k.get("command") == ["python", "-m", "dynamo.frontend"]]
    assert len(lines) == 2
    for args in lines:
        parser = argparse.ArgumentParser(exit_on_error=False)
        FrontendArgGroup().add_arguments(parser)
        cfg = FrontendConfig.from_cli_args(parser.parse_args(args))  # an unknown flag raises
        cfg.validate()
        assert (cfg.router_mode, cfg.migration_limit) == ("kv", 3)


def test_workers_serve_one_model_from_the_declared_volume():
    claims = {d["metadata"]["name"] for d in _docs(K8S / "models.yaml") if d["kind"] == "PersistentVolumeClaim"}
    for g in _graphs():
        names = set()
        for c in g["spec"]["components"]:
            if c["type"] == "frontend":
                continue
            spec = c["podTemplate"]["spec"]
            args = [str(a) for a in spec["containers"][0]["args"]]
            names.add(args[args.index("--served-model-name") + 1])
            mounted = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]}
            assert mounted <= claims and args[0].startswith("/models/builds/"), c["name"]
        assert len(names) == 1, (g["metadata"]["name"], names)
