"""Where the training steps run: the machines (``hardware``), local processes under torchrun
(``torchrun``), and Kubernetes as Kubeflow PyTorchJobs (extra ``cluster``).

``hardware`` and ``config`` are typed data (pydantic only). ``pytorchjob`` builds the manifest
from a typed ``ClusterJobConfig``; ``launcher`` creates the job, waits for it, follows its
progress and deletes it. Both import the Kubernetes and Kubeflow SDKs, so import them directly
(``cluster.pytorchjob``), not from this package.
"""
