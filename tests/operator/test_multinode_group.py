"""The LeaderWorkerSet's own commands run a tensor-parallel group: a multi-node LLMDeployment of a tiny checkpoint
is rendered, the leader's and the worker's args are expanded as the kubelet expands them from the variables the
LWS controller injects (the leader's address is loopback here), and the two run as two processes, the two pods.
The leader serves what one rank generates, and the group ends cleanly when the leader drains."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from kubellm.operator import api, render
from kubellm.operator.render import cli as render_cli
from kubellm.operator.render import multinode
from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.sampling.params import SamplingParams
from server_harness import free_port, wait_ready

IMAGE_MODEL = "/opt/models/tiny"  # where an image would hold it (render refuses /tmp, which the pod's emptyDir hides)
PROMPTS = [[5, 17, 230, 41, 99, 7], [300, 12, 12, 64, 3, 88, 140, 211, 9]]  # token ids of the tiny vocabulary


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """``$(VAR)`` replaced as the kubelet does for a container's args (an unknown variable is left as it is)."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


@pytest.mark.slow
def test_the_rendered_leader_and_worker_serve_what_one_rank_generates(tiny_llama, tmp_path):
    rendezvous, port = free_port(), free_port()
    ld = render_cli.load({
        "apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "tiny", "namespace": "ml"},
        "spec": {"model": {"uri": f"file://{IMAGE_MODEL}", "servedModelName": "tiny"}, "dtype": "float32",
                 "parallelism": {"tensor": 2, "nodes": 2, "rendezvousPort": rendezvous},
                 "engine": {"maxModelLen": 256}, "resources": {"gpu": {"count": 0}, "cpu": "1"}},
    })  # fmt: skip
    lws = render.render_workload(ld)
    group = lws["spec"]["leaderWorkerTemplate"]
    env = {multinode.LEADER_ADDRESS_ENV: "127.0.0.1", multinode.WORKER_INDEX_ENV: "1"}
    leader_args, worker_args = ([str(tiny_llama) if a == IMAGE_MODEL else a
                                 for a in expand(group[t]["spec"]["containers"][0]["args"], env)]
                                for t in ("leaderTemplate", "workerTemplate"))  # fmt: skip
    assert leader_args[-4:] == ["--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{rendezvous}"]
    # Only what a shared test machine needs differs from the pods: the checkpoint's path here, a free API port
    # on loopback, an ephemeral admin port, a small KV cache (the pods size theirs from the memory they have),
    # and the PyTorch reference ops, so that no native-kernel build (minutes on a busy machine, the kernel
    # tests' business) delays the group.
    local = ["--kv-cache-memory", "16MiB", "--admin-port", "0", "--attention-backend", "torch", "--layer-ops", "torch",
             "--prepack-weights", "off"]  # fmt: skip
    serve = [sys.executable, "-m", "kubellm.runtime.cli", "serve"]
    worker_log, leader_log = tmp_path / "worker.log", tmp_path / "leader.log"
    with open(worker_log, "w") as wlog, open(leader_log, "w") as llog:
        worker = subprocess.Popen([*serve, *worker_args, *local], stdout=wlog, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        leader = subprocess.Popen([*serve, *leader_args, *local, "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=llog, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    logs = lambda: f"leader:\n{leader_log.read_text()}\nworker:\n{worker_log.read_text()}"  # noqa: E731
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [leader, worker], logs, 240)
        one_rank = LLM(str(tiny_llama), progress=False, dtype="float32", max_model_len=256)
        single = one_rank.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   use_tqdm=False)  # fmt: skip
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        for prompt, expected in zip(PROMPTS, single, strict=True):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
            assert out.choices[0].text == expected.text, logs()
        os.killpg(leader.pid, signal.SIGTERM)  # the group's pods are deleted: the leader drains and ends the group
        os.killpg(worker.pid, signal.SIGTERM)
        assert leader.wait(timeout=90) == 0, logs()
        assert worker.wait(timeout=90) == 0, logs()
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
