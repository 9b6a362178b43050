"""`kvexport` commands that deploy a build behind other servers: triton (write a Triton
Inference Server model repository), triton-serve (run one on the local tritonserver), dynamo
(an NVIDIA Dynamo worker), dynamo-broker (the workers' event plane on one address). docs/DEPLOYMENT.md tells how they fit together."""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from .options import console, engine_config, engine_options


@click.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(), help="Model repository to write.")
@click.option("--name", help="Triton model name [the build directory's name].")
@click.option("--copy-build/--link-build", default=False, show_default=True,
              help="Copy the build into the repository (self-contained), or point at it by relative path.")
@click.option("--instances", type=int, default=1, show_default=True, help="Model instances (one engine each).")
@click.option("--execution-env", type=click.Path(exists=True),
              help="Python environment that runs the model (EXECUTION_ENV_PATH) [python3 on tritonserver's PATH].")
@click.option("--force", is_flag=True,
              help="Replace a Triton repository kvexport wrote earlier at --out (never anything else).")
@engine_options
def triton(build_dir, out, name, copy_build, instances, execution_env, force, **settings):
    """Write a Triton Inference Server model repository serving a paged build (decoupled, streaming)."""
    from kvexport.runtime.serving.triton_repo import TritonRepoOptions, write_repository

    opts = TritonRepoOptions(engine=engine_config(settings), name=name, copy_build=copy_build, instances=instances,
                             execution_env=execution_env, force=force)
    model_dir = write_repository(build_dir, out, opts)
    repo = escape(str(model_dir.parent))
    console.print(f"[bold green]Triton model repository ready:[/] {repo} (model {model_dir.name!r}); "
                  f"start it with `kvexport triton-serve {repo}` (or tritonserver --model-repository={repo}: "
                  f"see docs/DEPLOYMENT.md)")


@click.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mode", type=click.Choice(["agg", "prefill", "decode"]), default="agg", show_default=True,
              help="Disaggregation role: agg (prompt and generation here), prefill (prompt and first token; KV "
                   "handed to a decode worker), decode (pulls the KV, generates). docs/DEPLOYMENT.md.")
@click.option("--namespace", default="kvexport", show_default=True, envvar="DYN_NAMESPACE",
              help="Dynamo namespace (the frontend's --namespace) [$DYN_NAMESPACE: Dynamo's Kubernetes operator sets it].")
@click.option("--component", help="Dynamo component name of the workers [prefill for --mode prefill, else backend].")
@click.option("--endpoint", default="generate", show_default=True, help="Dynamo endpoint name.")
@click.option("--served-model-name", help="The model name clients must send [the build directory's name].")
@click.option("--discovery-backend", type=click.Choice(["etcd", "file", "kubernetes", "mem"]),
              help="How workers and frontend find each other [$DYN_DISCOVERY_BACKEND, else etcd; file: "
                   "$DYN_FILE_KV, one machine].")
@click.option("--request-plane", type=click.Choice(["tcp", "nats"]), help="Request transport [$DYN_REQUEST_PLANE, else tcp].")
@click.option("--kv-transfer", type=click.Choice(["nixl", "request-plane"]), default="nixl", show_default=True,
              help="How prefill workers hand KV blocks to decode workers: NIXL (UCX), or inside the response.")
@click.option("--kv-transfer-timeout", type=click.FloatRange(0, 3600, min_open=True), default=60.0,
              show_default=True, help="Seconds a prefill worker keeps a request's KV for its decode worker.")
@click.option("--cache-salt-key", envvar="KVEXPORT_CACHE_SALT_KEY", metavar="FILE",
              help="Take only prefix-cache salts a gateway signed with a key in FILE, and refuse requests without "
                   "one (tenants behind a gateway; docs/DEPLOYMENT.md) "
                   "[$KVEXPORT_CACHE_SALT_KEY; none: salts as sent].")
@click.option("--public-event-plane", is_flag=True, envvar="KVEXPORT_DYNAMO_PUBLIC_EVENT_PLANE",
              help="Accept Dynamo's direct ZMQ event plane, whose sockets listen on every interface (a trusted "
                   "network only); without it the worker refuses it: use `kvexport dynamo-broker` or NATS "
                   "(docs/DEPLOYMENT.md) [$KVEXPORT_DYNAMO_PUBLIC_EVENT_PLANE].")
@engine_options
def dynamo(build_dir, mode, namespace, component, endpoint, served_model_name, discovery_backend, request_plane,
           kv_transfer, kv_transfer_timeout, cache_salt_key, public_event_plane, **settings):
    """Serve a paged build as an NVIDIA Dynamo worker (behind `python -m dynamo.frontend`; KV-aware routing)."""
    from kvexport.runtime.serving.dynamo_serve import serve_dynamo
    from kvexport.runtime.serving.dynamo_worker import DynamoWorkerOptions

    opts = DynamoWorkerOptions(engine=engine_config(settings), mode=mode, namespace=namespace, component=component,
                               endpoint=endpoint, served_model_name=served_model_name,
                               discovery_backend=discovery_backend, request_plane=request_plane,
                               kv_transfer=kv_transfer, kv_transfer_timeout_s=kv_transfer_timeout,
                               cache_salt_key=cache_salt_key, public_event_plane=public_event_plane)
    serve_dynamo(build_dir, opts, on_ready=lambda name, path: console.print(
        f"dynamo worker: model {escape(repr(name))} on {escape(path)}", highlight=False))


@click.command("dynamo-broker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address both sockets listen on: one the frontend and the workers reach, nobody else.")
@click.option("--xsub-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port the workers publish to (0: a free one).")
@click.option("--xpub-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port the frontends subscribe to (0: a free one).")
def dynamo_broker(host, xsub_port, xpub_port):
    """Forward the Dynamo workers' KV events and load to the frontends, listening on --host only, until
    SIGTERM/Ctrl-C; prints the DYN_ZMQ_BROKER_URL to export to the frontend and every worker."""
    import time

    from kvexport.runtime.serving.dynamo_events import EventBroker

    with EventBroker(host, xsub_port, xpub_port) as broker:
        console.print(f"DYN_ZMQ_BROKER_URL='{escape(broker.url)}'", highlight=False, soft_wrap=True)
        while True:  # SIGTERM/Ctrl-C end it (the CLI raises them here); the broker forwards on its thread
            time.sleep(3600)


@click.command("triton-serve")
@click.argument("repo", type=click.Path(exists=True, file_okay=False))
@click.option("--triton-env", type=click.Path(exists=True, file_okay=False),
              help="Python environment with nvidia-pytriton's tritonserver [$KVEXPORT_TRITON_ENV, this environment, "
                   "./.venv-triton, then `tritonserver` on PATH].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of all three endpoints.")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--shutdown-grace", type=click.FloatRange(min=0), default=10.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM/SIGINT, how long open requests may take to finish before they get an error.")
def triton_serve(repo, triton_env, host, http_port, grpc_port, metrics_port, shutdown_grace):
    """Run a repository written by `kvexport triton` on the local tritonserver, until SIGTERM/Ctrl-C."""
    from kvexport.runtime.serving.triton_local import Ports, serve_repository

    def ready(url: str) -> None:
        console.print(f"Triton serving {escape(str(repo))} on {escape(url)} (gRPC {escape(host)}:{grpc_port}, "
                      f"metrics {escape(host)}:{metrics_port}); Ctrl-C stops it", highlight=False)

    code = serve_repository(repo, triton_env, host, Ports(http_port, grpc_port, metrics_port), shutdown_grace,
                            on_ready=ready)
    console.print(f"tritonserver exited with code {code}", highlight=False)
    sys.exit(code)


COMMANDS = (triton, triton_serve, dynamo, dynamo_broker)
