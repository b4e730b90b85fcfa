"""The base job template of a Prefect `kubernetes` work pool whose flow runs train on one GPU
node in-process (local backend): the trainer pods' GPU limit, toleration, nodeSelector, memory
/dev/shm and security settings, in prefect-kubernetes' format. Written to
k8s/base/work-pool-template.json by `python -m infra.k8s_manifests`."""

from __future__ import annotations

from typing import Any

# Labels every object and pod of an attempt carries; the backend finds pods by them.
from infra.k8s_manifests import (
    DASK_CONFIG_MAP,
    GENERATED_NOTE,
    HOME_ENV,
    TTL_SECONDS_AFTER_FINISHED,
    WORKDIR,
    KubeOptions,
    container_security_context,
    gpu_scheduling,
    pod_security_context,
    s3_env,
    volumes,
)

PREFECT_CONTAINER = "prefect-job"  # prefect-kubernetes requires this name for container 0


def _var(
    default: Any, type_: str | list[str], title: str, description: str, **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"title": title, "description": description, "type": type_}
    if default is not None:
        out["default"] = default
    return {**out, **extra}


def work_pool_template(opts: KubeOptions) -> dict[str, Any]:
    """A base job template for a Prefect `kubernetes` work pool whose flow runs train on one
    GPU node in-process (local backend): the same GPU limit, toleration, nodeSelector,
    memory /dev/shm and security settings as the trainer pods. The format is
    prefect-kubernetes' (KubernetesWorker.get_default_base_job_template()):
    {"job_configuration": {..., "job_manifest": {...}}, "variables": <JSON schema>}."""
    # The run configs (train.yaml, prep.yaml) at /etc/ballast, as in the trainer pods: the
    # deployments in prefect.yaml name them there.
    vols, mounts = volumes(opts, config=True)
    container: dict[str, Any] = {
        "name": PREFECT_CONTAINER,
        "image": "{{ image }}",
        "imagePullPolicy": "{{ image_pull_policy }}",
        # Our image's ENTRYPOINT is the trainer, and Prefect puts its own command
        # (`prefect flow-run execute`) in args: run the args as the command.
        "command": ["/usr/bin/env"],
        "args": "{{ command }}",
        "workingDir": WORKDIR,
        # A list, not "{{ env }}": the worker prepends the flow run's variables to it and
        # keeps these (prefect-kubernetes _populate_env_in_manifest).
        "env": [dict(HOME_ENV), *s3_env(opts)],
        # DASK_SCHEDULER_ADDRESS where the prep-dask overlay is applied (its ConfigMap): prep
        # flow runs then run their steps on that cluster. Optional, so a cluster without it
        # starts pods as before; a deployment's own `env` wins (`local` opts out).
        "envFrom": [{"configMapRef": {"name": DASK_CONFIG_MAP, "optional": True}}],
        "resources": {
            "requests": {"cpu": "{{ cpu_request }}", "memory": "{{ memory_request }}"},
            "limits": {
                "cpu": "{{ cpu_limit }}",
                "memory": "{{ memory_limit }}",
                opts.gpu_resource: "{{ gpus }}",
            },
        },
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = {
        # prefect-kubernetes checks for these two here (in the pod spec, where its own
        # default template has them) and refuses a manifest without them; the API server
        # drops them as unknown pod fields.
        "parallelism": 1,
        "completions": 1,
        "restartPolicy": "Never",
        "serviceAccountName": "{{ service_account_name }}",
        "securityContext": pod_security_context(opts),
        **gpu_scheduling(opts),
        "containers": [container],
        "volumes": vols,
    }
    manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "annotations": "{{ annotations }}",
            "labels": "{{ labels }}",
            "namespace": "{{ namespace }}",
            "generateName": "{{ name }}-",
        },
        "spec": {
            "backoffLimit": "{{ backoff_limit }}",
            "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
            # No pod labels here: the worker labels the pod itself (prefect.io/flow-run-id,
            # and app.kubernetes.io/name = the flow's name, which would override ours).
            "template": {"spec": pod},
        },
    }
    job_configuration = {
        "command": "{{ command }}",
        "env": "{{ env }}",
        "labels": "{{ labels }}",
        "name": "{{ name }}",
        "annotations": "{{ annotations }}",
        "namespace": "{{ namespace }}",
        "job_manifest": manifest,
        "job_watch_timeout_seconds": "{{ job_watch_timeout_seconds }}",
        "pod_watch_timeout_seconds": "{{ pod_watch_timeout_seconds }}",
        "stream_output": "{{ stream_output }}",
    }
    str_or_null = ["string", "null"]
    props = {
        "name": _var(
            None, str_or_null, "Name", "Name given to infrastructure created by a worker."
        ),
        "env": _var(
            None,
            "object",
            "Environment Variables",
            "Environment variables to set when starting a flow run.",
            additionalProperties={"type": str_or_null},
        ),
        "labels": _var(
            None,
            "object",
            "Labels",
            "Labels applied to infrastructure created by a worker.",
            additionalProperties={"type": "string"},
        ),
        "command": _var(
            None,
            str_or_null,
            "Command",
            "The command to start a flow run; left blank, the worker makes it.",
        ),
        "annotations": _var(
            None,
            "object",
            "Annotations",
            "Annotations applied to the jobs and pods the worker creates.",
            additionalProperties={"type": "string"},
        ),
        "namespace": _var(
            opts.namespace, "string", "Namespace", "The Kubernetes namespace to create jobs within."
        ),
        "image": _var(
            opts.image,
            "string",
            "Image",
            "The image of the flow-run pods (ours has the project installed).",
        ),
        "image_pull_policy": _var(
            "IfNotPresent",
            "string",
            "Image Pull Policy",
            "The image pull policy of the flow-run container.",
            enum=["IfNotPresent", "Always", "Never"],
        ),
        "service_account_name": _var(
            opts.service_account,
            "string",
            "Service Account Name",
            "ballast-trainer (no API token) for flows that train in-process; "
            "ballast-supervisor for flows that launch Jobs with the kubernetes backend.",
        ),
        "backoff_limit": _var(
            0,
            "integer",
            "Backoff Limit",
            "0: Prefect reschedules an evicted flow run itself.",
            minimum=0,
        ),
        "finished_job_ttl": _var(
            TTL_SECONDS_AFTER_FINISHED,
            "integer",
            "Finished Job TTL",
            "Seconds to keep finished jobs.",
            minimum=0,
        ),
        "job_watch_timeout_seconds": _var(
            None,
            ["integer", "null"],
            "Job Watch Timeout Seconds",
            "Seconds to wait for each job event; unset: forever.",
        ),
        "pod_watch_timeout_seconds": _var(
            900,
            "integer",
            "Pod Watch Timeout Seconds",
            "Seconds to wait for the pod to start: GPU nodes may take long to scale up.",
        ),
        "stream_output": _var(
            True, "boolean", "Stream Output", "Stream the job's output to the worker's log."
        ),
        "cpu_request": _var(opts.cpu, "string", "CPU Request", "CPU request of the flow run."),
        "cpu_limit": _var(opts.cpu, "string", "CPU Limit", "CPU limit of the flow run."),
        "memory_request": _var(
            opts.memory,
            "string",
            "Memory Request",
            "Memory request of the flow run (includes /dev/shm).",
        ),
        "memory_limit": _var(
            opts.memory,
            "string",
            "Memory Limit",
            "Memory limit of the flow run (includes /dev/shm).",
        ),
        "gpus": _var(
            max(opts.gpus_per_node, 1),
            "integer",
            "GPUs",
            f"{opts.gpu_resource} per flow-run pod.",
            minimum=1,
        ),
    }
    return {
        "job_configuration": job_configuration,
        "variables": {"description": GENERATED_NOTE, "type": "object", "properties": props},
    }
