"""``kmock``'s in-memory Kubernetes API emulator on 127.0.0.1, for the cluster tests.

No Kubernetes API server (nor training operator) can run here: kmock stores the objects the real
client sends over HTTP; a test plays the operator by writing statuses and pods through the API.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import kmock
from kubernetes import client as k8s


@contextmanager
def kube_emulator(pod_logs: dict[str, bytes] | None = None, namespace: str = "team") -> Iterator:
    """Serve an emulator (PyTorchJobs and pods) from its own event-loop thread; yields an
    ``ApiClient`` pointed at it. ``pod_logs``: pod name → the log its ``/log`` returns."""
    started = threading.Event()
    state: dict = {}

    async def serve() -> None:
        async with kmock.KubernetesEmulator() as api, kmock.Server(api) as server:
            api.resources["kubeflow.org/v1/pytorchjobs"] = {}
            api.resources["v1/pods"] = {}
            for pod, log in (pod_logs or {}).items():
                api[f"get /api/v1/namespaces/{namespace}/pods/{pod}/log"] << log
            state.update(url=str(server.url).rstrip("/"), stop=asyncio.Event())
            state["loop"] = asyncio.get_running_loop()
            started.set()
            await state["stop"].wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(10), "kmock did not start"
    configuration = k8s.Configuration()
    configuration.host = state["url"]
    try:
        yield k8s.ApiClient(configuration)
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(10)
