"""Where the training steps run: the machines (``hardware``), local processes under torchrun
(``torchrun``), and Kubernetes as Kubeflow TrainJobs or PyTorchJobs (extra ``cluster``).

``hardware`` and ``config`` are typed data (pydantic only); ``jobs`` names the two job APIs and
reads a job's state. ``trainjob`` and ``pytorchjob`` build the manifests from a typed
``ClusterJobConfig``; ``launcher`` creates a job, waits for it, follows its progress and
deletes it; ``step_job`` runs a pipeline step's training as one, after ``access`` has asked
the API server whether the step may; ``setup`` is what a namespace needs first (``lingo cluster
setup``). They import the Kubernetes
and Kubeflow SDKs, so import them directly (``cluster.trainjob``), not from this package.
"""
