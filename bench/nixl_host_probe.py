"""Does NIXL move host (CPU) memory between two processes here, without a GPU? (issue 26 §3's first
question: the prefill -> decode KV hand-off could go through it.)

Two processes of this script: `prefill` registers a 4 MiB float32 tensor, `decode` registers an
empty one and READs the prefill's over NIXL's UCX backend; agent metadata and the descriptor list
go through files in FOLDER (what Dynamo's request plane or etcd would carry); a notification tells
the prefill side the read is done. The answer was yes: nixl-cu12 is now part of the `dynamo`
extra (pyproject.toml) and runtime/serving/kv_transfer.py moves the KV blocks this way; the probe
stays as the smallest reproduction:

    mkdir /tmp/nixl-probe
    .venv/bin/python bench/nixl_host_probe.py prefill /tmp/nixl-probe &
    .venv/bin/python bench/nixl_host_probe.py decode /tmp/nixl-probe
"""

import os
import sys
import time
from pathlib import Path

import torch
from nixl_cu12._api import nixl_agent, nixl_agent_config

N = 1 << 20  # float32 elements: 4 MiB


def main() -> None:
    role, folder = sys.argv[1], Path(sys.argv[2])
    agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    t = torch.arange(N, dtype=torch.float32) if role == "prefill" else torch.zeros(N, dtype=torch.float32)
    agent.register_memory(agent.get_reg_descs(t))
    (folder / f"{role}.md.tmp").write_bytes(agent.get_agent_metadata())
    os.replace(folder / f"{role}.md.tmp", folder / f"{role}.md")
    other = "decode" if role == "prefill" else "prefill"
    while not (folder / f"{other}.md").exists():
        time.sleep(0.05)
    agent.add_remote_agent((folder / f"{other}.md").read_bytes())
    if role == "prefill":
        (folder / "prefill.descs").write_bytes(agent.get_serialized_descs(agent.get_xfer_descs(t)))
        deadline = time.time() + 30
        while time.time() < deadline:
            notes = agent.get_new_notifs()
            if notes:
                print("prefill: notified", notes)
                return
            time.sleep(0.01)
        raise SystemExit("prefill: no notification within 30 s")
    while not (folder / "prefill.descs").exists():
        time.sleep(0.05)
    time.sleep(0.2)
    remote = agent.deserialize_descs((folder / "prefill.descs").read_bytes())
    t0 = time.perf_counter()
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(t), remote, "prefill", b"done")
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    dt = time.perf_counter() - t0
    ok = torch.equal(t, torch.arange(N, dtype=torch.float32))
    print(f"decode: {state}, bytes equal: {ok}, {4 * N / 2**20:.0f} MiB in {dt * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
