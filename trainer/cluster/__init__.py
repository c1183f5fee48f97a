"""Run the training steps on Kubernetes as Kubeflow PyTorchJobs (extra ``cluster``).

``pytorchjob`` builds the manifest from a typed ``ClusterJobConfig``; ``launcher`` creates the
job, waits for it, follows its progress and deletes it. Both import the Kubernetes and Kubeflow
SDKs, so import them directly (``trainer.cluster.pytorchjob``), not from this package.
"""
